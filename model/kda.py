"""Kimi Delta Attention layer (K3 and Kimi Linear variants).

Per token: q/k/v projections -> causal depthwise conv (kernel W, zero left-pad) -> SiLU;
forget gate from a low-rank projection (K3: ``LB*sigmoid(exp(A_log_h)*(f+dt_bias))``,
lower bound -5; Kimi Linear: ``-exp(A_log_h)*softplus(f+dt_bias)``); ``beta = sigmoid(b x)``
per head; L2-normalised q (times dk^-1/2) and k; the decay-then-delta recurrence in fp32;
per-head RMSNorm of the output times sigmoid of the output gate; o_proj.

State that outlives a step is passed in and returned explicitly, per row:
  conv  [B, W-1, 3P] float32: the last W-1 *raw* (pre-conv) q|k|v projections, oldest first
  state [B, H, dk, dv] float32: math layout S[k, v] (o = S^T q)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ..kernels import ops
from ..kernels.kda_ragged import draft_tokens
from .layers import F32, Linear, matmul, param, rms_normalize
from .step import local_rows

L2_EPS = 1e-6


def l2_normalize(x):
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def causal_conv(raw, conv_state, weight, seq_lens):
    """Depthwise causal conv over [old window | new tokens].

    raw [B,T,C]; conv_state [B,W-1,C]; weight [C,W] (column W-1 multiplies the newest).
    Returns (y [B,T,C] fp32 before the activation, new conv_state [B,W-1,C]) where the new
    window ends at each row's last valid token (seq_lens), so padding never enters it.
    """
    W = weight.shape[1]
    B, T, C = raw.shape
    window = jnp.concatenate([conv_state.astype(F32), raw.astype(F32)], axis=1)  # [B, W-1+T, C]
    w = weight.astype(F32)
    y = sum(window[:, i : i + T, :] * w[:, i] for i in range(W))
    new_state = jax.vmap(lambda win, n: jax.lax.dynamic_slice_in_dim(win, n, W - 1, axis=0))(window, seq_lens)
    return y, new_state


class KDA(nnx.Module):
    def __init__(self, cfg, dtype):
        D, H, dk = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        P = H * dk
        self.cfg = cfg
        self.q_proj = Linear(D, P, dtype, ("kda_heads", "embed"))
        self.k_proj = Linear(D, P, dtype, ("kda_heads", "embed"))
        self.v_proj = Linear(D, P, dtype, ("kda_heads", "embed"))
        # depthwise conv weights [P, W] (checkpoint [P, 1, W]); fp32 like the checkpoint
        W = cfg.conv_kernel_size
        self.q_conv1d = param((P, W), F32, ("kda_heads", "conv_window"))
        self.k_conv1d = param((P, W), F32, ("kda_heads", "conv_window"))
        self.v_conv1d = param((P, W), F32, ("kda_heads", "conv_window"))
        self.f_a_proj = Linear(D, dk, dtype, ("kda_rank", "embed"))
        self.f_b_proj = Linear(dk, P, dtype, ("kda_heads", "kda_rank"))
        self.b_proj = Linear(D, H, dtype, ("kda_head_count", "embed"))
        self.A_log = param((H,), F32, ("kda_head_count",))
        self.dt_bias = param((P,), F32, ("kda_heads",))
        if cfg.full_rank_output_gate:
            self.g_proj = Linear(D, P, dtype, ("kda_heads", "embed"))
        else:
            self.g_a_proj = Linear(D, dk, dtype, ("kda_rank", "embed"))
            self.g_b_proj = Linear(dk, P, dtype, ("kda_heads", "kda_rank"))
        self.o_norm = param((dk,), F32, ("kda_head_dim",))
        self.o_proj = Linear(P, D, dtype, ("embed", "kda_heads"))

    def output_gate(self, x):
        if self.cfg.full_rank_output_gate:
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def gates(self, x):
        """Per-token log-decay ``g [.., H, dk]`` and write strength ``beta [.., H]`` (fp32)."""
        cfg = self.cfg
        H, dk = cfg.kda_num_heads, cfg.kda_head_dim
        f = self.f_b_proj(self.f_a_proj(x)).astype(F32).reshape(*x.shape[:-1], H, dk)
        a = jnp.exp(self.A_log[...])[:, None]  # [H, 1]
        f = f + self.dt_bias[...].reshape(H, dk)
        if cfg.gate_lower_bound is not None:
            g = cfg.gate_lower_bound * jax.nn.sigmoid(a * f)
        else:
            g = -a * jax.nn.softplus(f)
        beta = jax.nn.sigmoid(matmul(x, self.b_proj.weight[...]).astype(F32))
        return g, beta

    def output(self, x, o):
        """Per-head RMSNorm of the core output times the sigmoid output gate, then o_proj."""
        cfg = self.cfg
        H, dk = cfg.kda_num_heads, cfg.kda_head_dim
        gate = self.output_gate(x).astype(F32).reshape(*x.shape[:-1], H, dk)
        o = rms_normalize(o, cfg.rms_norm_eps) * self.o_norm[...] * jax.nn.sigmoid(gate)
        return self.o_proj(o.reshape(*x.shape[:-1], H * dk).astype(x.dtype))

    def project(self, x):
        """The per-token inputs of the layer's core on the pools (``ops.kda_layer_on_pools``):
        raw ``q, k, v`` projections stacked [T, 3, P], the raw forget projection [T, P] (before
        ``dt_bias``), beta [T, H] (fp32) and the raw output gate [T, P]. Stacked, not
        concatenated along P: under a recipe P is split over heads, and XLA's partitioner
        turned the concatenation of three head-split arrays into four all-to-alls per layer
        (to token rows and back)."""
        raw = jnp.stack([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=1)
        f = self.f_b_proj(self.f_a_proj(x))
        beta = jax.nn.sigmoid(matmul(x, self.b_proj.weight[...]).astype(F32))
        return raw, f, beta, self.output_gate(x)

    def core_params(self):
        """The small per-layer parameters of the core: conv weights [3P, W], ``A_log`` [H],
        ``dt_bias`` [P], the output norm's weight [dk] (fp32)."""
        conv_w = jnp.concatenate([self.q_conv1d[...], self.k_conv1d[...], self.v_conv1d[...]], axis=0)
        return conv_w, self.A_log[...], self.dt_bias[...], self.o_norm[...]

    def flat(self, x, conv_rows, state_rows, fb, aux=None, par=None, drafts: int = 0):
        """The layer on a flattened step (``model.step.FlatBatch``): x [T, D]; conv_rows
        [R, W-1, 3P] and state_rows [R, H, dk, dv] read for the step's rows (fresh rows zeroed).
        Returns (out [T, D], (new conv rows, new state rows, snapshot conv [NS, ..],
        snapshot state [NS, ..])); with ``drafts`` (speculative decode rows of up to that many
        drafts, ``kernels/kda_spec.py``) the tuple goes on with the drafts' journal: keys, decays,
        deltas ``[R, drafts, H, d]`` fp32 and pre-conv rows ``[R, drafts, 3P]``."""
        cfg = self.cfg
        T = x.shape[0]
        H, dk = cfg.kda_num_heads, cfg.kda_head_dim
        P = H * dk
        raw = jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
        conv_w = jnp.concatenate([self.q_conv1d[...], self.k_conv1d[...], self.v_conv1d[...]], axis=0)
        g, beta = self.gates(x)
        valid = fb.valid
        g = jnp.where(valid[:, None, None], g, 0.0)
        beta = jnp.where(valid[:, None], beta, 0.0)
        if aux is not None:
            aux["kda_log_decay"] = g
            aux["kda_beta"] = beta
        core = functools.partial(_flat_core, H=H, dk=dk, P=P, drafts=drafts)
        args = (raw, conv_w, g, beta, conv_rows, state_rows, fb.tok_row, fb.cu_q_lens, fb.q_lens, fb.start_pos,
                fb.snap_row, fb.snap_len, fb.decode if drafts else None)  # without drafts a decode row is one token
        o, new = core(*args) if par is None else par.kda_core(core, *args)
        del T
        return self.output(x, o), new


def _flat_core(raw, conv_w, g, beta, conv_rows, state_rows, tok_row, cu_q_lens, q_lens, start_pos, snap_row, snap_len,
               decode=None, *, H, dk, P, drafts: int = 0):
    """Conv, activation, normalisation and the ragged recurrence of one KDA layer on a
    flattened step; everything per row lives in ``conv_rows`` / ``state_rows``. ``decode``: the
    step's row kinds (bool [R], optional without ``drafts``)."""
    T, R = raw.shape[0], q_lens.shape[0]
    tok_row, snap_row = local_rows(tok_row, R), local_rows(snap_row, R)
    commit = None if decode is None else jnp.where(decode, jnp.minimum(q_lens, 1), q_lens)
    y, new_conv, snap_conv = ops.ragged_causal_conv(raw, conv_rows, conv_w, tok_row, cu_q_lens, q_lens, snap_row,
                                                    snap_len, commit)
    y = jax.nn.silu(y)
    q, k, v = (t.reshape(T, H, dk) for t in (y[:, :P], y[:, P : 2 * P], y[:, 2 * P :]))
    qn = l2_normalize(q) * (dk ** -0.5)
    kn = l2_normalize(k)
    out = ops.kda_ragged(qn, kn, v, g, beta, state_rows, tok_row, cu_q_lens, q_lens, start_pos, snap_row, snap_len,
                         decode=decode, drafts=drafts)
    o, new_state, snap_state = out[:3]
    if not drafts:
        return o, (new_conv, new_state, snap_conv, snap_state)
    raw_drafts = draft_tokens(raw, cu_q_lens, drafts)  # the drafts' pre-conv rows, for the conv window's fold
    return o, (new_conv, new_state, snap_conv, snap_state, *out[3], raw_drafts)
