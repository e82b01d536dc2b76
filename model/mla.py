"""Multi-head Latent Attention without RoPE (K3 and Kimi Linear), over paged latent KV.

Per token the cache stores ``[RMSNorm(c) (kv_lora_rank) | k_r (qk_rope_head_dim)]``; the
"rope" dims are plain shared key dims here (NoPE model). Scores use the absorbed form:
``q_nope`` is taken into latent space through the key half of ``kv_b_proj`` and the
attention output is taken back through its value half. Softmax scale is
``(qk_nope + qk_rope)^-1/2``. K3 adds a q LoRA and a sigmoid output gate computed from the
layer input; Kimi Linear has a plain ``q_proj`` and no gate.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..kernels import ops
from .layers import F32, Linear, RMSNorm
from .step import local_rows


def write_latent_rows(rows, kv_pool, layer, fb, par=None):
    """Write a flattened step's latent ``rows`` [T, W] (``MLA.latent_rows`` of the layer input)
    into layer ``layer`` of the stacked pool; tokens with no row (``fb.tok_row < 0``) are
    dropped. Returns the pool."""
    if par is not None:  # decode context parallelism / attention DP (sharding.parallel)
        return par.mla_write_flat(rows, kv_pool, layer, fb)
    tok_row = local_rows(fb.tok_row, fb.num_rows)
    return ops.write_kv_rows(kv_pool, rows, fb.page_table, tok_row, fb.pos, layer=layer)


class MLA(nnx.Module):
    def __init__(self, cfg, dtype):
        D, H = cfg.hidden_size, cfg.mla_num_heads
        self.cfg = cfg
        qk = cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(D, H * qk, dtype, ("heads", "embed"))
        else:
            self.q_a_proj = Linear(D, cfg.q_lora_rank, dtype, ("q_lora", "embed"))
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_latent_eps, dtype, "q_lora")
            self.q_b_proj = Linear(cfg.q_lora_rank, H * qk, dtype, ("heads", "q_lora"))
        self.kv_a_proj_with_mqa = Linear(D, cfg.mla_cache_width, dtype, ("kv_latent", "embed"))
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.mla_latent_eps, dtype, "kv_latent")
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype, ("heads", "kv_latent"))
        if cfg.mla_output_gate:
            self.g_proj = Linear(D, H * cfg.v_head_dim, dtype, ("heads", "embed"))
        self.o_proj = Linear(H * cfg.v_head_dim, D, dtype, ("embed", "heads"))

    def query(self, x):
        if self.cfg.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def latent_rows(self, x):
        """The cache rows of x: ``[B, T, mla_pool_width]``: the normed latent, the rope key,
        zeros up to the pool's width (``K3Config.mla_pool_width``)."""
        ckv = self.kv_a_proj_with_mqa(x)
        c, kr = ckv[..., : self.cfg.kv_lora_rank], ckv[..., self.cfg.kv_lora_rank :]
        pad = self.cfg.mla_pool_width - self.cfg.mla_cache_width
        tail = [jnp.zeros(kr.shape[:-1] + (pad,), kr.dtype)] if pad else []
        return jnp.concatenate([self.kv_a_layernorm(c), kr] + tail, axis=-1)

    def queries(self, x):
        """The step's queries in latent space: ``q_lat [T, H, kv_lora_rank]`` float32 (``q_nope``
        absorbed through the key half of ``kv_b_proj``) and ``q_rope [T, H, rope]``."""
        cfg = self.cfg
        T = x.shape[0]
        H, nope, R, dv, Lr = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        q = self.query(x).reshape(T, H, nope + R)
        q_nope, q_rope = q[..., :nope], q[..., nope:]
        w_uk = self.kv_b_proj.weight[...].reshape(H, nope + dv, Lr)[:, :nope]
        return jnp.einsum("thn,hnl->thl", q_nope.astype(F32), w_uk.astype(F32)), q_rope

    def project_out(self, x, out_lat):
        """The attention output ``out_lat [T, H, kv_lora_rank]`` back through the value half of
        ``kv_b_proj``, the output gate of ``x`` and ``o_proj``: out [T, D]."""
        cfg = self.cfg
        T = x.shape[0]
        H, nope, dv, Lr = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        w_uv = self.kv_b_proj.weight[...].reshape(H, nope + dv, Lr)[:, nope:]
        o = jnp.einsum("thl,hvl->thv", out_lat, w_uv.astype(F32)).reshape(T, H * dv)
        if cfg.mla_output_gate:
            o = o * jax.nn.sigmoid(self.g_proj(x).astype(F32))
        return self.o_proj(o.astype(x.dtype))

    def attend(self, x, kv_pool, layer, fb, par=None):
        """Attention of the step's tokens x [T, D] over this layer's pages (the step's own rows
        already written by :func:`write_latent_rows`); returns out [T, D]."""
        cfg = self.cfg
        q_lat, q_rope = self.queries(x)
        scale, Lr = cfg.qk_head_dim ** -0.5, cfg.kv_lora_rank
        if par is None:
            tok_row = local_rows(fb.tok_row, fb.num_rows)
            out_lat = ops.mla_ragged_attention(q_lat, q_rope, kv_pool, fb.page_table, tok_row, fb.pos, fb.kv_lens,
                                               fb.cu_q_lens, fb.q_lens, scale, Lr, layer=layer)
        else:
            out_lat = par.mla_attend_flat(q_lat, q_rope, kv_pool, layer, fb, scale, Lr)
        return self.project_out(x, out_lat)
