"""Flax NNX Kimi K3 (and Kimi Linear): config, layers, forward, weight mapping.

Public API::

    from k3serve.model import load_pretrained
    m = load_pretrained("path/to/hf_dir", dtype="float32")
    m.config; m.logits([1, 2, 3]); m.greedy([1, 2, 3], max_new_tokens=8)
"""
from .cache import Cache, StepBatch, allocate_cache, make_batch
from .config import K3Config, k3_full, k3_small
from .k3 import KimiLM
from .pretrained import KimiModel, load_pretrained

__all__ = ["Cache", "StepBatch", "allocate_cache", "make_batch", "K3Config", "k3_full", "k3_small",
           "KimiLM", "KimiModel", "load_pretrained"]
