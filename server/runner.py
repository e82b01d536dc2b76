"""The runner: turn a step plan into one jitted call (model step + sampling).

Shapes are padded to a few buckets so nothing compiles after warm-up: rows to a power of
two up to ``max_num_seqs``; tokens per row to 1 (decode-only steps) or ``chunk_size`` (any
step with a prefill chunk); page-table width fixed at ``ceil(max_model_len / page_size)``;
penalty histories fixed at ``max_model_len``. Padding rows carry no tokens and point at the
scratch KDA slot, so they change nothing. The cache is donated to each call.

``num_compiles`` counts traces of the step function (a trace is what triggers a compile).
"""
from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..model.cache import make_batch
from .sampler import build_sampler_inputs, sample


def _pow2_buckets(limit: int) -> list[int]:
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return sorted(set(out))


class Runner:
    def __init__(self, model, cache_mgr, *, max_num_seqs: int, chunk_size: int, max_model_len: int,
                 max_logprobs: int = 20, scratch_slot: int = 0):
        self.model = model
        self.cache_mgr = cache_mgr
        self.page_size = cache_mgr.plan.page_size
        self.row_buckets = _pow2_buckets(max_num_seqs)
        self.tok_buckets = sorted({1, chunk_size})
        self.page_width = math.ceil(max_model_len / self.page_size)
        self.hist_len = max_model_len
        self.max_logprobs = max_logprobs
        self.scratch = scratch_slot
        self.num_compiles = 0
        self.device_s = 0.0  # wall time inside the jitted call until results are on the host
        graphdef = model.graphdef

        def fn(params, cache, batch, last_idx, sinp):
            self.num_compiles += 1  # Python side effect: runs only while tracing
            logits, cache = nnx.merge(graphdef, params)(batch, cache)
            rows = logits[jnp.arange(logits.shape[0]), last_idx]
            return sample(rows, sinp, max_logprobs), cache

        self._fn = jax.jit(fn, donate_argnums=(1,))

    def _bucket(self, n: int, buckets: list[int]) -> int:
        for b in buckets:
            if n <= b:
                return b
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")

    def execute(self, rows):
        """Run one step for ``rows`` (ScheduledRow-like: req, start, num_tokens)."""
        B = self._bucket(len(rows), self.row_buckets)
        T = self._bucket(max(r.num_tokens for r in rows), self.tok_buckets)
        tok = np.zeros((B, T), np.int32)
        start = np.zeros(B, np.int32)
        lens = np.zeros(B, np.int32)
        slots = np.full(B, self.scratch, np.int32)
        table = np.zeros((B, self.page_width), np.int32)
        last = np.zeros(B, np.int32)
        for i, r in enumerate(rows):
            req = r.req
            tok[i, : r.num_tokens] = req.tokens[r.start : r.start + r.num_tokens]
            start[i], lens[i], last[i] = r.start, r.num_tokens, r.num_tokens - 1
            slots[i] = self.cache_mgr.slot_of(req.rid)
            table[i] = self.cache_mgr.page_table_row(req.rid, self.page_width)
        batch = make_batch(tok, start, lens, slots, table)
        sinp = build_sampler_inputs(
            [r.req.params for r in rows], [r.req.seed for r in rows], [len(r.req.output) for r in rows],
            [r.req.prompt for r in rows], [r.req.output for r in rows], [self._suppress(r.req) for r in rows],
            pad_rows_to=B, pad_len_to=self.hist_len,
        )
        t = time.perf_counter()
        out, self.cache_mgr.cache = self._fn(self.model.params, self.cache_mgr.cache, batch, jnp.asarray(last), sinp)
        out = jax.device_get(out)
        self.device_s += time.perf_counter() - t
        return out

    def _suppress(self, req) -> list[int]:
        p = req.params
        if len(req.output) >= p.min_new_tokens:
            return []
        ids = list(p.stop_token_ids)
        eos = self.model.config.eos_token_id
        if eos is not None and not p.ignore_eos:
            ids.append(eos)
        return ids

    def warmup(self) -> int:
        """Compile every (rows, tokens) bucket with an all-padding batch; returns compiles."""
        before = self.num_compiles
        for B in self.row_buckets:
            for T in self.tok_buckets:
                batch = make_batch(np.zeros((B, T), np.int32), np.zeros(B), np.zeros(B), np.full(B, self.scratch),
                                   np.zeros((B, self.page_width)))
                sinp = build_sampler_inputs([], [], [], [], [], [], pad_rows_to=B,
                                            pad_len_to=self.hist_len)
                out, self.cache_mgr.cache = self._fn(self.model.params, self.cache_mgr.cache, batch,
                                                     jnp.zeros(B, jnp.int32), sinp)
                jax.block_until_ready(out)
        return self.num_compiles - before
