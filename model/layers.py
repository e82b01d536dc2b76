"""Small building blocks shared by every layer: parameters with logical axes, linear,
RMSNorm, SiTU / SiLU gated activations, the gated MLP and Block Attention Residuals.

Weights keep the checkpoint layout ``[out, in]`` so loading never transposes; matmuls
accumulate in float32 and return the activation dtype.

Every parameter carries ``logical_axes`` metadata (``embed``, ``vocab``, ``heads``, ...).
``sharding/`` maps those names to mesh axes; model code never names a mesh axis.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

F32 = jnp.float32


def param(shape, dtype, axes) -> nnx.Param:
    assert len(axes) == len(shape), (shape, axes)
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=tuple(axes))


def matmul(x, w):
    """x [..., in] @ w[out, in]^T with fp32 accumulation, result in x's dtype."""
    y = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=F32)
    return y.astype(x.dtype)


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, dtype, axes=("out", "in")):
        self.weight = param((out_features, in_features), dtype, axes)

    def __call__(self, x):
        return matmul(x, self.weight[...])


def rms_normalize(x, eps):
    xf = x.astype(F32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """``w * cast(x / sqrt(mean(x^2) + eps))``: normalised in fp32, cast back, then weighted."""

    def __init__(self, dim: int, eps: float, dtype, axis: str = "norm"):
        self.weight = param((dim,), dtype, (axis,))
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


def rms_norm(x, weight, eps):
    """:class:`RMSNorm` as a function of its weight."""
    y = rms_normalize(x, eps).astype(x.dtype)
    return (weight.astype(F32) * y.astype(F32)).astype(x.dtype)


def situ(gate, up, beta: float, linear_beta: float):
    """SiTU: (b*tanh(g/b)*sigmoid(g)) * (bl*tanh(u/bl)), in fp32 (K3's soft-capped SwiGLU)."""
    g, u = gate.astype(F32), up.astype(F32)
    return (beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g)) * (linear_beta * jnp.tanh(u / linear_beta))


def silu_mul(gate, up):
    return jax.nn.silu(gate.astype(F32)) * up.astype(F32)


def gated_act(cfg):
    if cfg.hidden_act == "situ":
        b, bl = cfg.situ_beta, cfg.situ_linear_beta
        return lambda g, u: situ(g, u, b, bl)
    return silu_mul


class GatedMLP(nnx.Module):
    """down(act(gate(x), up(x))): K3's dense layer-0 MLP and the shared experts."""

    def __init__(self, cfg, hidden: int, inter: int, dtype):
        self.gate_proj = Linear(hidden, inter, dtype, ("mlp", "embed"))
        self.up_proj = Linear(hidden, inter, dtype, ("mlp", "embed"))
        self.down_proj = Linear(inter, hidden, dtype, ("embed", "mlp"))
        self.act = gated_act(cfg)

    def __call__(self, x):
        h = self.act(self.gate_proj(x), self.up_proj(x)).astype(x.dtype)
        return self.down_proj(h)


class AttnResWeights(nnx.Module):
    """One (pseudo-query proj, norm) pair of Block Attention Residuals."""

    def __init__(self, hidden: int, dtype):
        self.proj = param((1, hidden), dtype, ("one", "embed"))
        self.norm = param((hidden,), dtype, ("embed",))


def attn_res_bank(bank, count, partial, w: AttnResWeights, eps):
    """Softmax over depth of RMS-normalised sources (no weight), mixing the raw sources.

    The sources are ``bank[:count]`` (block snapshots; ``bank`` is a fixed ``[N, .., D]``
    array, entries from ``count`` on are ignored) and ``partial``, the current block's prefix
    sum. fp32 inside. With an empty bank the result is ``partial`` exactly (weight 1).
    """
    query = w.norm[...].astype(F32) * w.proj[...][0].astype(F32)
    p = partial.astype(F32)
    s_p = jnp.einsum("...d,d->...", rms_normalize(p, eps), query)
    if bank is None or bank.shape[0] == 0:
        return partial
    V = bank.astype(F32)
    s_b = jnp.einsum("n...d,d->n...", rms_normalize(V, eps), query)
    live = (jnp.arange(V.shape[0]) < count).reshape((-1,) + (1,) * (s_b.ndim - 1))
    s_b = jnp.where(live, s_b, -jnp.inf)
    m = jnp.maximum(jnp.max(s_b, axis=0), s_p)
    e_b, e_p = jnp.exp(s_b - m), jnp.exp(s_p - m)
    den = jnp.sum(e_b, axis=0) + e_p
    out = jnp.einsum("n...,n...d->...d", e_b / den, V) + (e_p / den)[..., None] * p
    return out.astype(partial.dtype)
