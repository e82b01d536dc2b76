"""The model config (``config.json``'s dict) of a checkpoint directory, whichever kind it is:
Hugging Face safetensors, or pre-sharded (``k3serve preshard``), read without any weights."""
from __future__ import annotations


def checkpoint_config(path) -> dict:
    from .preshard_format import is_preshard, read_manifest
    from .safetensors_io import open_checkpoint

    if is_preshard(path):
        return read_manifest(path)["config"]
    with open_checkpoint(path) as ckpt:
        return ckpt.config
