"""Checkpoint readers: GGUF files, Hugging Face folders, this package's own
safetensors checkpoints (``models`` docstring)."""
