"""File formats shared by the families: safetensors and GGUF readers, tokenizers and chat templates, atomic writes."""
