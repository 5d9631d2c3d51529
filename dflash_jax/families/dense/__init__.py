"""Dense decoder targets (Llama incl. SmolLM2, Mistral, Qwen2, Qwen3)."""
