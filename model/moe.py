"""Mixture of experts: the sigmoid router, K3's Stable LatentMoE and Kimi Linear's MoE.

Router: ``s = sigmoid(x W_r^T)`` in fp32 on the full-width input; top-k chosen on
``s + e_score_correction_bias`` (the bias only selects); weights ``s[idx]`` renormalised
(``/ (sum + 1e-20)``) and times ``routed_scaling_factor``.

LatentMoE (K3): ``z = down(x)``, ``r = sum_j w_j E_j(z)`` (fp32), ``r = RMSNorm(r)``,
``y = up(r) + shared(x)``. Kimi Linear: experts read x directly, ``y = r + shared(x)``.
Routed experts are kept packed (MXFP4) when the checkpoint is, and dequantized inside the op.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ..kernels import ops
from .layers import F32, GatedMLP, Linear, RMSNorm, gated_act, param, rms_norm


class Router(nnx.Module):
    def __init__(self, cfg, dtype):
        self.cfg = cfg
        self.weight = param((cfg.num_experts, cfg.hidden_size), dtype, ("experts", "embed"))
        self.e_score_correction_bias = param((cfg.num_experts,), F32, ("experts",))

    def __call__(self, x):
        cfg = self.cfg
        logits = jnp.einsum("nd,ed->ne", x.astype(F32), self.weight[...].astype(F32), preferred_element_type=F32)
        scores = jax.nn.sigmoid(logits)
        _, idx = jax.lax.top_k(scores + self.e_score_correction_bias[...], cfg.num_experts_per_token)
        w = jnp.take_along_axis(scores, idx, axis=-1)
        if cfg.moe_renormalize:
            w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
        return scores, idx, w * cfg.routed_scaling_factor


class Experts(nnx.Module):
    """Stacked routed experts, checkpoint layout: w1/w3 [E, I, K], w2 [E, K, I].

    MXFP4: ``w*_packed`` uint8 [E, N, K/2] and ``w*_scale`` uint8 [E, N, K/32]. A Pallas
    backend converts both at load (``kernels.moe_gmm.repack_experts``): same shapes for the
    bytes (nibbles reordered), scales padded to [E, N, 128·ceil(K/4096)]."""

    def __init__(self, cfg, dtype):
        E, I, K = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_input_size
        self.mxfp4 = cfg.experts_mxfp4
        shapes = {"w1": (E, I, K), "w3": (E, I, K), "w2": (E, K, I)}
        axes = {"w1": ("experts", "expert_mlp", "latent"), "w3": ("experts", "expert_mlp", "latent"),
                "w2": ("experts", "latent", "expert_mlp")}
        for name, (e, n, k) in shapes.items():
            if self.mxfp4:
                setattr(self, name + "_packed", param((e, n, k // 2), jnp.uint8, axes[name]))
                setattr(self, name + "_scale", param((e, n, k // 32), jnp.uint8, axes[name]))
            else:
                setattr(self, name, param((e, n, k), dtype, axes[name]))

    def weight(self, name):
        if self.mxfp4:
            return (getattr(self, name + "_packed")[...], getattr(self, name + "_scale")[...])
        return getattr(self, name)[...]


class MoE(nnx.Module):
    def __init__(self, cfg, dtype):
        self.cfg = cfg
        D = cfg.hidden_size
        self.gate = Router(cfg, dtype)
        self.experts = Experts(cfg, dtype)
        if cfg.latent_moe:
            Lt = cfg.routed_expert_hidden_size
            self.routed_expert_down_proj = Linear(D, Lt, dtype, ("latent", "embed"))
            self.routed_expert_up_proj = Linear(Lt, D, dtype, ("embed", "latent"))
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(Lt, cfg.rms_norm_eps, dtype, "latent")
        if cfg.num_shared_experts:
            self.shared_experts = GatedMLP(cfg, D, cfg.moe_intermediate_size * cfg.num_shared_experts, dtype)
        self.act = gated_act(cfg)

    def __call__(self, x, aux=None, par=None, valid=None, group=None):
        """``valid`` (bool, x's leading shape): tokens that are padding of a token bucket are
        never routed to an expert. ``group``: the routed experts are layer stacks ``[G, E,
        ...]`` (a scanned layer, ``model.layer_plan``) and this is the layer's row."""
        cfg = self.cfg
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        scores, idx, w = self.gate(xf)
        if aux is not None:
            aux["router_scores"] = scores.reshape(*shape[:-1], -1)
            aux["router_topk_idx"] = idx.reshape(*shape[:-1], -1)
            aux["router_topk_weight"] = w.reshape(*shape[:-1], -1)
        z = self.routed_expert_down_proj(xf) if cfg.latent_moe else xf
        if cfg.latent_moe and par is not None:
            z = par.latent_down(z)
        compute = jnp.float32 if x.dtype == jnp.float32 else x.dtype
        args = (z, idx, w, self.experts.weight("w1"), self.experts.weight("w2"), self.experts.weight("w3"), self.act,
                cfg.num_experts, compute)
        kw = dict(valid=None if valid is None else valid.reshape(-1), layer=group, backend=cfg.kernels)
        # the latent RMSNorm follows the experts' output, cast to the model's dtype first
        norm = cfg.latent_moe and cfg.latent_moe_use_norm
        post = (functools.partial(_cast_norm, dtype=x.dtype, eps=cfg.rms_norm_eps),
                (self.routed_expert_norm.weight[...],)) if norm else None
        if par is None:
            r = ops.expert_ffn(*args, **kw).astype(x.dtype)
            if post is not None:
                r = post[0](r, *post[1])
        else:  # per EP rank (sharding.ep); the norm inside the exchange, on whole rows
            r = par.expert_ffn(*args, latent=cfg.latent_moe, post=post, **kw).astype(x.dtype)
        if cfg.latent_moe:
            r = self.routed_expert_up_proj(r if par is None else par.latent_up(r))
        if cfg.num_shared_experts:
            r = r + self.shared_experts(xf)
        return r.reshape(shape)


def _cast_norm(r, weight, *, dtype, eps):
    """The experts' output in the model's dtype, then the latent RMSNorm."""
    return rms_norm(r.astype(dtype), weight, eps)
