"""Weights in and out: official JAX .npz, safetensors, Hugging Face, exports; `python -m pretrain.weights`."""
