"""The Qwen3-MoE target."""
