"""Loading models: Hugging Face checkpoints, GGUF files, the quantized cache, random presets."""
