"""The Qwen3.5 hybrid targets (and Qwen3.5-MoE, Qwen3-Next)."""
