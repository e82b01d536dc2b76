"""Flax NNX Kimi K3 (and Kimi Linear): config, layers, forward, weight mapping.

Loading a checkpoint is ``k3serve.checkpoints.load_pretrained`` (the model reads no files).
"""
from .cache import Cache, StepBatch, allocate_cache, make_batch
from .config import K3Config, k3_full, k3_small
from .k3 import KimiLM
from .pretrained import KimiModel

__all__ = ["Cache", "StepBatch", "allocate_cache", "make_batch", "K3Config", "k3_full", "k3_small",
           "KimiLM", "KimiModel"]
