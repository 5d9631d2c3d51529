"""The gpt-oss target."""
