"""The one entry point the model calls for its heavy ops.

Each op resolves to its pure-JAX reference (the CPU path and the oracle for kernels). TPU
Pallas kernels plug in here by backend (``K3Config.kernels``: "reference", "pallas",
"pallas-interpret", chosen once at load); the model never imports a kernel module directly.
Wired in: the routed MXFP4 experts (``expert_ffn(..., backend=...)``: ``gmm_mxfp4``), the MLA
layers' row write + ragged paged attention (``mla_write_attend``: ``mla_ragged_attention_kernel``)
and each KDA layer's core on the state and conv pools in place (``kda_layer_on_pools``:
``kda_decode`` for one-token rows, ``kda_prefill`` for the others). ``kda_decode_reference`` and
``kda_prefill_reference`` are the kernels' pure-JAX oracles (the model's reference path runs
``kda_ragged`` on gathered rows instead).
"""
from __future__ import annotations

from .kda import kda_chunked, kda_recurrent
from .kda_decode_kernel import kda_decode, kda_decode_reference
from .kda_pools import kda_layer_on_pools as _kda_layer_on_pools
from .kda_prefill_kernel import kda_prefill, kda_prefill_reference
from .kda_ragged import kda_ragged, ragged_causal_conv
from .mla import merge_partials, mla_paged_attention, write_kv_pages
from .mla_ragged import mla_ragged_attention, write_kv_rows
from .mla_ragged_kernel import mla_ragged_attention_kernel
from .moe import expert_ffn, dequant_experts
from .moe_gmm import interpret_params, repack_experts
from .mxfp4 import unpack_mxfp4


def _interpret(backend: str):
    if backend not in ("pallas", "pallas-interpret"):
        raise ValueError(f"unknown kernel backend {backend!r}")
    return interpret_params() if backend == "pallas-interpret" else None


def mla_write_attend(q_lat, q_rope, rows, kv_pool, layer, page_table, tok_row, pos, kv_lens, cu_q_lens, q_lens,
                     scale, latent_dim, *, backend: str = "reference", page_ordinals=None, return_lse: bool = False,
                     cost_rows: int | None = None):
    """One MLA layer on a flattened step: write the step's latent ``rows [T, W]`` into layer
    ``layer`` of the stacked pool, then ragged paged attention of ``q_lat``/``q_rope`` over it
    (arguments as :func:`kernels.mla_ragged.mla_ragged_attention`; ``tok_row`` outside ``[0,
    R)`` is padding). Returns ``(out_lat [T, H, latent_dim] float32, kv_pool)``, or ``(out_lat,
    lse [T, H], kv_pool)`` with ``return_lse`` (what a decode-context-parallel rank's partial
    needs for the exact merge, ``sharding.parallel``). ``rows`` None writes nothing;
    ``page_ordinals`` (None, ``[P]`` or ``[R, P]``): which page of its sequence each table
    column is. ``backend`` "reference": :func:`write_kv_rows` then :func:`mla_ragged_attention`;
    "pallas" / "pallas-interpret": the rows by XLA's in-place scatter, then the kernel reads the
    pool (no whole-pool copy when the pool is donated and its layout row-major: see
    ``kernels/mla_ragged_kernel.py``). ``cost_rows``: the rows whose pages the kernel reads,
    for XLA's cost model only (``kernels.cost_estimates``; None: every row, 0: a write-only call)."""
    if backend == "reference":
        if rows is not None:
            kv_pool = write_kv_rows(kv_pool, rows, page_table, tok_row, pos, layer=layer)
        out = mla_ragged_attention(q_lat, q_rope, kv_pool, page_table, tok_row, pos, kv_lens, cu_q_lens, q_lens,
                                   scale, latent_dim, layer=layer, page_ordinals=page_ordinals, return_lse=True)
        return (*out, kv_pool) if return_lse else (out[0], kv_pool)
    out, lse, kv_pool = mla_ragged_attention_kernel(q_lat, q_rope, rows, kv_pool, layer, page_table, tok_row, pos,
                                                    kv_lens, cu_q_lens, q_lens, scale, latent_dim,
                                                    page_ordinals=page_ordinals, interpret=_interpret(backend),
                                                    cost_rows=cost_rows)
    return (out, lse, kv_pool) if return_lse else (out, kv_pool)


def kda_kernels_fit(head_dim: int, backend: str) -> bool:
    """Whether the KDA kernels take heads of ``head_dim`` on ``backend``. Compiled by Mosaic
    ("pallas") they need whole 128-lane heads: a block's conv-window columns are DMA'd
    per head, and a 64-wide column slice of the pool does not lower ("Source and target
    leading tiles have different trailing dimensions", tpu7x, the demo model's 64-wide heads).
    K3's heads are 128 wide. Interpret mode takes any width. A model whose heads do not fit
    runs its KDA layers on the reference path (``model/k3.py``); MLA and the experts keep
    their kernels."""
    return backend != "pallas" or head_dim % 128 == 0


def kda_layer_on_pools(qkv_raw, f, beta, gate_out, conv_w, A_log, dt_bias, o_norm, state_pool, conv_pool, layer,
                       tok_row, cu_q_lens, q_lens, start_pos, read_slot, write_slot, fresh, snap_row, snap_len,
                       snap_slot, *, lower_bound, eps, backend: str, journal=None, decode=None, jrow=None,
                       fold_len=None, prefill_rows: bool = True, any_prefill=None):
    """One KDA layer's core on the flattened step, on the state and conv pools in place, with
    the Pallas decode and prefill kernels (``kernels/kda_pools.py``); "pallas" or
    "pallas-interpret" only (the reference path runs on gathered rows: ``model/kda.py``).
    With a speculative ``journal`` (and the step's ``decode``, ``jrow``, ``fold_len``) decode
    rows run the record-mode kernel (``kernels/kda_spec_kernel.py``) and the journal comes back
    fourth. ``prefill_rows=False``: no row takes the prefill path (it is not built);
    ``any_prefill``: whether it runs (a bool scalar; None: whether some row takes it)."""
    return _kda_layer_on_pools(qkv_raw, f, beta, gate_out, conv_w, A_log, dt_bias, o_norm, state_pool, conv_pool, layer,
                               tok_row, cu_q_lens, q_lens, start_pos, read_slot, write_slot, fresh, snap_row,
                               snap_len, snap_slot, lower_bound=lower_bound, eps=eps,
                               interpret=_interpret(backend), journal=journal, decode=decode, jrow=jrow,
                               fold_len=fold_len, prefill_rows=prefill_rows,
                               any_prefill=any_prefill)


__all__ = [
    "kda_kernels_fit",
    "kda_chunked",
    "kda_recurrent",
    "kda_ragged",
    "kda_decode",
    "kda_decode_reference",
    "kda_prefill",
    "kda_prefill_reference",
    "ragged_causal_conv",
    "mla_paged_attention",
    "merge_partials",
    "write_kv_pages",
    "mla_ragged_attention",
    "write_kv_rows",
    "mla_ragged_attention_kernel",
    "mla_write_attend",
    "kda_layer_on_pools",
    "expert_ffn",
    "dequant_experts",
    "repack_experts",
    "unpack_mxfp4",
]
