"""The poolside Laguna target."""
