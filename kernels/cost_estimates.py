"""What each Pallas kernel moves and computes, for XLA's cost model (``pl.CostEstimate``).

Why: XLA cannot see into a Mosaic kernel. Without an estimate, ``cost_analysis()`` of a
program counts a kernel as its small operands and nothing of what it reads through DMAs
(measured: a compiled K3 decode step under ``v7-32-prefill``, where every device reads every
MLA page, showed 0.31 GB for an MLA+MoE layer against 10.7 GB of KV). ``k3serve compile``'s
bytes and FLOPs of a step, and XLA's scheduling around the kernels, read these figures.

Each figure is what a call does for its static shapes with every row's page table full and
every state row read and written -- the planner's assumptions (``sharding/roofline.py``), so
that a compiled step and the planner count the same work. Two figures cannot be read off the
shapes and are the planner's model instead: the grouped matmul's real rows (the EP exchange's
buffers are sized for the worst case; the caller passes the balanced load) and the experts they
visit (uniform routing). A step with shorter contexts does less.
"""
from __future__ import annotations

import math

from jax.experimental import pallas as pl


def _nbytes(*arrays) -> int:
    return int(sum(math.prod(a.shape) * a.dtype.itemsize for a in arrays if a is not None))


def mla_ragged(q_lat, q_rope, kv_pool, page_table, T: int, R: int, ps: int, out_bytes: int) -> pl.CostEstimate:
    """Ragged paged MLA attention: each of the ``R`` rows reads its whole page table once
    (``P`` pages of ``ps`` rows of the pool's width), every query scores every key of its row
    (latent + rope) and mixes the latent values."""
    P = page_table.shape[1]
    W = kv_pool.shape[-1]
    H, Lat, Rr = q_lat.shape[1], q_lat.shape[2], q_rope.shape[2]
    keys = P * ps  # per row: the context a full table holds
    kv = R * keys * W * kv_pool.dtype.itemsize
    return pl.CostEstimate(flops=int(2 * T * H * keys * (2 * Lat + Rr)), transcendentals=int(T * H * keys),
                           bytes_accessed=int(kv + _nbytes(q_lat, q_rope, page_table) + out_bytes))


def mxfp4_gmm(x, w_packed, w_scale, num_experts: int, N: int, fused: bool, rows: int | None = None) -> pl.CostEstimate:
    """Grouped MXFP4 matmul of ``x [M, K]`` carrying ``rows`` real rows (default M): the tiles
    of the experts those rows visit are read -- ``E (1 − (1 − 1/E)^rows)`` of one layer's ``E``
    under uniform routing, the planner's rule -- both stacks when the gate and up projections
    are fused, and each row is multiplied by its expert (2·K·N FLOPs per stack)."""
    M, K = x.shape
    rows = M if rows is None else min(M, rows)
    stacks = 2 if fused else 1
    per_expert = (math.prod(w_packed.shape[1:]) * w_packed.dtype.itemsize
                  + math.prod(w_scale.shape[1:]) * w_scale.dtype.itemsize)
    visited = num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** rows)
    return pl.CostEstimate(flops=int(2 * rows * K * N * stacks), transcendentals=int(rows * N if fused else 0),
                           bytes_accessed=int(stacks * visited * per_expert + rows * K * x.dtype.itemsize
                                              + 2 * rows * N * 4))


def kda_state_rows(rows: int, H: int, dk: int, dv: int, state_itemsize: int, tokens: int, token_bytes: int,
                   extra_bytes: int = 0) -> pl.CostEstimate:
    """A KDA kernel over ``rows`` state rows and ``tokens`` tokens: each row's state ``[H, dk,
    dv]`` read and written, the tokens' inputs and outputs (``token_bytes`` each), the delta
    rule's ~6·dk·dv FLOPs per head and token (state decay, two products, the rank-one update)."""
    state = 2 * rows * H * dk * dv * state_itemsize
    return pl.CostEstimate(flops=int(6 * tokens * H * dk * dv), transcendentals=int(tokens * H * dk),
                           bytes_accessed=int(state + tokens * token_bytes + extra_bytes))
