"""Model forwards as pure functions over parameter pytrees."""
