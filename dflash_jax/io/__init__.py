"""Checkpoint, tokenizer and chat-template readers."""
