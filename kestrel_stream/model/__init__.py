"""The model: configuration, weights, quantization."""
