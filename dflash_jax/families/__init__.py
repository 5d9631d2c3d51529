"""Target families: the contract every family fulfils, the registry (one entry per family) and one folder per family (config, model, safetensors and GGUF loading)."""
