"""The Gemma 4 text target."""
