"""Checkpoints: Hugging Face safetensors I/O (MXFP4 experts) and synthetic K3 checkpoints."""
