"""A loaded model as a pure jitted step: prefill logits, greedy decode, the engine's step.

The model reads no files: ``k3serve.checkpoints.load_pretrained`` builds a ``KimiModel``
from a checkpoint directory or a pre-shard (docs/layout.md); everything about weight names
and shapes stays in ``weights.py``.

``KimiModel`` wraps the NNX module as a pure jitted step over explicit caches:
``step(params, cache, batch) -> (logits, cache)`` with the cache donated. ``logits`` and
``greedy`` use the same step the engine uses: one sequence in slot 0, its MLA rows in pages
``0..n-1`` of a private pool. Prompt lengths are padded to power-of-two buckets so the step
compiles once per bucket, not once per length.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .cache import Cache, StepBatch, allocate_cache, make_batch
from .config import K3Config
from .k3 import KimiLM

_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def _bucket(n: int, minimum: int = 16) -> int:
    b = minimum
    while b < n:
        b *= 2
    return b


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
        return jnp.dtype(_DTYPES[dtype])
    return jnp.dtype(dtype)


class KimiModel:
    """A loaded Kimi K3 / Kimi Linear model with explicit-cache step functions."""

    def __init__(self, module: KimiLM, config: K3Config, dtype, page_size: int = 16):
        self.config = config
        self.dtype = resolve_dtype(dtype)
        self.page_size = page_size
        self.graphdef, self.params = nnx.split(module)

        def step(params, cache, batch, capture=False):
            return nnx.merge(self.graphdef, params)(batch, cache, capture=capture)

        self._step = jax.jit(step, donate_argnums=(1,), static_argnames=("capture",))

    # ------------------------------------------------------------------ engine-level
    def new_cache(self, num_slots: int, num_pages: int, page_size: int | None = None) -> Cache:
        return allocate_cache(self.config, num_slots, num_pages, page_size or self.page_size, self.dtype)

    def step(self, cache: Cache, batch: StepBatch, capture: bool = False):
        """One jitted model step. The cache passed in is donated (do not reuse it)."""
        return self._step(self.params, cache, batch, capture=capture)

    # ------------------------------------------------------------------ convenience
    def _check_ids(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("need at least one token id")
        bad = ids[(ids < 0) | (ids >= self.config.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} out of range [0, {self.config.vocab_size})")
        return ids.astype(np.int32)

    def _prefill(self, ids: np.ndarray, total_len: int, capture: bool = False):
        T = len(ids)
        Tb = _bucket(T)
        pages = _bucket(-(-max(total_len, Tb) // self.page_size), 1)
        cache = self.new_cache(1, pages)
        tok = np.zeros((1, Tb), np.int32)
        tok[0, :T] = ids
        batch = make_batch(tok, [0], [T], [0], np.arange(pages, dtype=np.int32)[None])
        out = self.step(cache, batch, capture=capture)
        return out, batch.page_table

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Full-sequence (prefill) logits of one sequence: float32 [T, vocab]."""
        ids = self._check_ids(ids)
        (logits, _), _ = self._prefill(ids, len(ids))
        return np.asarray(logits[0, : len(ids)], dtype=np.float32)

    def trace(self, ids: Sequence[int]) -> tuple[np.ndarray, Cache, dict]:
        """Prefill with per-layer intermediates (for parity tests and debugging)."""
        ids = self._check_ids(ids)
        (logits, cache, rec), _ = self._prefill(ids, len(ids), capture=True)
        return np.asarray(logits[0, : len(ids)]), cache, rec

    def greedy(self, ids: Sequence[int], max_new_tokens: int = 16, stop_ids: Sequence[int] = (),
               return_logits: bool = False):
        """Prefill, then step-by-step cached decode; returns the new token ids."""
        ids = self._check_ids(ids)
        if max_new_tokens <= 0:
            return ([], []) if return_logits else []
        T = len(ids)
        (logits, cache), table = self._prefill(ids, T + max_new_tokens)
        last = np.asarray(logits[0, T - 1], np.float32)
        out, rows = [], []
        pos = T
        stop = set(int(s) for s in stop_ids)
        while True:
            tok = int(np.argmax(last))
            out.append(tok)
            if len(out) >= max_new_tokens or tok in stop:
                break
            batch = make_batch([[tok]], [pos], [1], [0], table)
            logits, cache = self.step(cache, batch)
            last = np.asarray(logits[0, 0], np.float32)
            rows.append(last)
            pos += 1
        return (out, rows) if return_logits else out


def default_kernels() -> str:
    """The kernel backend by platform: Pallas on TPU, the pure-JAX references elsewhere."""
    return "pallas" if jax.default_backend() == "tpu" else "reference"


def repack_experts_for_kernels(module, abstract: bool = False) -> None:
    """MXFP4 experts in the grouped-matmul kernel's stored layout (lossless, once): bytes in
    its nibble order, scales padded to 128 columns (``kernels.moe_gmm.repack_experts``).
    ``abstract``: the module holds ``ShapeDtypeStruct``s; they take the stored shapes, their
    shardings kept (``k3serve compile``).

    A placed load (a recipe's shards) is repacked shard by shard in its own sharding: the
    repack permutes bytes within the last dim and pads the scales' last dim, which no recipe
    splits, so each device rewrites only its block and nothing is gathered or moved."""
    from ..kernels.ops import repack_experts
    from .moe import Experts

    for _, node in nnx.iter_graph(module):
        if isinstance(node, Experts) and node.mxfp4:
            for name in ("w1", "w2", "w3"):
                pv, sv = getattr(node, name + "_packed"), getattr(node, name + "_scale")
                p, sc = pv.get_value(), sv.get_value()
                shardings = tuple(getattr(x, "sharding", None) for x in (p, sc))
                if not abstract and isinstance(p, jax.Array) and None not in shardings:
                    p, sc = jax.jit(repack_experts, out_shardings=shardings)(p, sc)
                else:  # host arrays, or abstract ones (shapes and shardings only)
                    p, sc = repack_experts(p, sc)
                pv.set_value(p)
                sv.set_value(sc)
