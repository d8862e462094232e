"""Mixtral-style MoE decoder and its weight sources (synthetic and Hugging Face safetensors)."""
