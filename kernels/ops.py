"""The one entry point the model calls for its heavy ops.

Each op resolves to its pure-JAX reference (the CPU path and the oracle for kernels). TPU
Pallas kernels plug in here by backend (``K3Config.kernels``: "reference", "pallas",
"pallas-interpret", chosen once at load); the model never imports a kernel module directly.
So far the routed MXFP4 experts have a kernel (``expert_ffn(..., backend=...)``).
"""
from __future__ import annotations

from .kda import kda_chunked, kda_recurrent
from .kda_ragged import kda_ragged, ragged_causal_conv
from .mla import merge_partials, mla_paged_attention, write_kv_pages
from .mla_ragged import mla_ragged_attention, write_kv_rows
from .moe import expert_ffn, dequant_experts
from .moe_gmm import repack_experts
from .mxfp4 import unpack_mxfp4

__all__ = [
    "kda_chunked",
    "kda_recurrent",
    "kda_ragged",
    "ragged_causal_conv",
    "mla_paged_attention",
    "merge_partials",
    "write_kv_pages",
    "mla_ragged_attention",
    "write_kv_rows",
    "expert_ffn",
    "dequant_experts",
    "repack_experts",
    "unpack_mxfp4",
]
