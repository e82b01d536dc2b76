"""DSpark draft checkpoints: load one into ``model.dspark.DSparkDraft``, or write a tiny
synthetic one for tests.

Tensor names. The published K3 draft is loaded by vLLM with a mapper that prefixes every
name with ``model.`` and by tokenspeed after stripping an optional ``model.``; both then
address ``layers.{i}...``, ``context_proj``, ``context_norm``, ``final_norm`` and
``markov_head.markov_w{1,2}``. So the canonical names here (what the synthetic writer
emits) are, per draft layer ``i``::

    layers.{i}.input_layernorm.weight            [D]
    layers.{i}.post_attention_layernorm.weight   [D]
    layers.{i}.self_attn.q_a_proj.weight         [q_lora_rank, D]
    layers.{i}.self_attn.q_a_layernorm.weight    [q_lora_rank]
    layers.{i}.self_attn.q_b_proj.weight         [H * (nope + rope), q_lora_rank]
    layers.{i}.self_attn.kv_a_proj_with_mqa.weight [kv_lora_rank + rope, D]
    layers.{i}.self_attn.kv_a_layernorm.weight   [kv_lora_rank]
    layers.{i}.self_attn.kv_b_proj.weight        [H * (nope + v), kv_lora_rank]
    layers.{i}.self_attn.o_proj.weight           [D, H * v]
    layers.{i}.mlp.{gate,up}_proj.weight         [I, D];  layers.{i}.mlp.down_proj.weight [D, I]

and ``context_proj.weight [D, n_taps * Dt]``, ``context_norm.weight [D]``,
``final_norm.weight [D]``, ``markov_head.markov_w1.weight [V, r]``,
``markov_head.markov_w2.weight [V, r]``. Also accepted: a leading ``model.`` on any name,
``norm.weight`` for ``final_norm.weight`` and bare ``markov_w{1,2}.weight`` (the spellings
our design notes used); two spellings of one tensor are an error.

Skipped on purpose: ``embed_tokens.*`` and ``lm_head.*`` (the draft uses the frozen target's;
the release ships an embedding copy), ``confidence_head.*`` (training-only in the K3 draft;
loaded by nobody here even when ``enable_confidence_head`` is set — adaptive verification is
not implemented), ``t2d`` (training-only), ``rotary_emb.inv_freq`` and ``mask_embedding``
(placeholders). A ``d2t`` map is accepted only if it is the identity (all zeros). Anything
else unknown, anything missing, and any shape mismatch is a ``CheckpointError`` naming the
tensor.
"""
from __future__ import annotations

import hashlib
import math
import os
import re
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from ..model.dspark import DSparkDraft
from ..model.dspark_config import DSparkConfig
from ..model.pretrained import resolve_dtype
from ..model.weights import CheckpointError
from .safetensors_io import open_checkpoint, write_checkpoint

GENERATOR_VERSION = 1
"""Bump when the synthetic draft's drawn values or layout change."""

_SKIPPED = re.compile(r"^(embed_tokens\.|lm_head\.|confidence_head\.|t2d$|mask_embedding)|rotary_emb\.inv_freq$")
_ALIASES = {
    "norm.weight": "final_norm.weight",
    "markov_w1.weight": "markov_head.markov_w1.weight",
    "markov_w2.weight": "markov_head.markov_w2.weight",
}
_LAYER_PARTS = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


def tensor_shapes(cfg: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the draft reads: canonical name -> shape."""
    D, H, Dt = cfg.hidden_size, cfg.num_attention_heads, cfg.target_hidden_size
    qr, lr, nope, R, dv, inter = (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                  cfg.v_head_dim, cfg.intermediate_size)
    per_layer = {
        "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
        "self_attn.q_a_proj.weight": (qr, D), "self_attn.q_a_layernorm.weight": (qr,),
        "self_attn.q_b_proj.weight": (H * (nope + R), qr),
        "self_attn.kv_a_proj_with_mqa.weight": (lr + R, D), "self_attn.kv_a_layernorm.weight": (lr,),
        "self_attn.kv_b_proj.weight": (H * (nope + dv), lr), "self_attn.o_proj.weight": (D, H * dv),
        "mlp.gate_proj.weight": (inter, D), "mlp.up_proj.weight": (inter, D), "mlp.down_proj.weight": (D, inter),
    }
    out = {"context_proj.weight": (D, cfg.num_target_layers * Dt), "context_norm.weight": (D,)}
    for i in range(cfg.num_hidden_layers):
        out.update({f"layers.{i}.{k}": v for k, v in per_layer.items()})
    out["final_norm.weight"] = (D,)
    out["markov_head.markov_w1.weight"] = (cfg.vocab_size, cfg.markov_rank)
    out["markov_head.markov_w2.weight"] = (cfg.draft_vocab_size, cfg.markov_rank)
    return out


def canonical_name(raw: str) -> str | None:
    """A checkpoint name in the canonical spelling, or None for a tensor skipped on purpose."""
    name = raw[len("model."):] if raw.startswith("model.") else raw
    if _SKIPPED.search(name):
        return None
    return _ALIASES.get(name, name)


def _param(module: DSparkDraft, name: str) -> nnx.Variable:
    if name.startswith("markov_head."):
        return getattr(module, name.split(".")[1])
    obj = module
    for part in name.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def load_dspark(path: str | os.PathLike, dtype="float32", *, target_cfg=None) -> DSparkDraft:
    """Load a draft checkpoint directory (config.json + safetensors) into a ``DSparkDraft`` of
    ``dtype``. ``target_cfg`` (``model.config.K3Config``): refuse a draft that does not fit
    that target (``DSparkConfig.check_against``). The names of the tensors skipped on purpose
    are left in ``module.skipped_tensors``."""
    dt = resolve_dtype(dtype)
    with open_checkpoint(path) as ckpt:
        if not ckpt.config:
            raise CheckpointError(f"{path}: no config.json next to the DSpark draft's safetensors")
        cfg = DSparkConfig.from_dict(ckpt.config)
        if target_cfg is not None:
            cfg.check_against(target_cfg)
        module = nnx.eval_shape(lambda: DSparkDraft(cfg, dt))
        expected = tensor_shapes(cfg)
        seen: dict[str, str] = {}
        skipped = []
        for raw in ckpt.keys():
            name = canonical_name(raw)
            if name is None:
                skipped.append(raw)
                continue
            if name == "d2t":
                if np.any(np.asarray(ckpt.get(raw)) != 0):
                    raise CheckpointError(f"{path}: tensor {raw!r} maps draft ids to other target ids; a "
                                          "reduced draft vocabulary is not supported")
                skipped.append(raw)
                continue
            if name not in expected:
                raise CheckpointError(f"{path}: unexpected tensor {raw!r} (shape {list(ckpt.shape(raw))}) "
                                      "for this DSpark config")
            if name in seen:
                raise CheckpointError(f"{path}: duplicate tensor {raw!r} (same as {seen[name]!r})")
            seen[name] = raw
            shape = tuple(ckpt.shape(raw))
            if shape != expected[name]:
                raise CheckpointError(f"{path}: tensor {raw!r} has shape {list(shape)}, expected "
                                      f"{list(expected[name])}")
            _param(module, name).set_value(jnp.asarray(np.asarray(ckpt.get(raw)).astype(dt)))
        missing = [n for n in expected if n not in seen]
        if missing:
            more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
            raise CheckpointError(f"{path}: missing tensors: {', '.join(missing[:10])}{more}")
    module.skipped_tensors = tuple(skipped)
    return module


# ------------------------------------------------------------------------------ synthetic
def tiny_dspark_config(**overrides) -> dict:
    """A config.json dict of a tiny DSpark draft with the release's structure (RoPE with
    YaRN, a Markov head, the confidence head flag on as in the release): for tests."""
    cfg = {
        "model_type": "k3_dspark", "architectures": ["K3DSparkModel"],
        "target_hidden_size": 64, "num_target_layers": 3, "target_layer_ids": [1, 3, 6],
        "target_num_hidden_layers": 8, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16, "v_head_dim": 16, "intermediate_size": 96, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8},
        "max_position_embeddings": 4096, "vocab_size": 512, "draft_vocab_size": 512, "markov_rank": 16,
        "block_size": 4, "mask_token_id": 500, "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    }
    cfg.update(overrides)
    return cfg


def dspark_config_for(target_cfg, block_size: int = 4, num_layers: int = 2) -> dict:
    """A config.json dict of a small synthetic draft that fits ``target_cfg`` (a ``K3Config``):
    its taps three spread layers, its latent rows the target's MLA row width, the target's
    vocabulary (benchmarks and tests: the drafting machinery's cost, not its acceptance)."""
    L = target_cfg.num_hidden_layers
    taps = sorted({max(0, min(L - 1, round(f * (L - 1)))) for f in (0.1, 0.5, 0.9)})
    D = target_cfg.hidden_size
    return tiny_dspark_config(
        target_hidden_size=D, hidden_size=D, num_target_layers=len(taps), target_layer_ids=taps,
        target_num_hidden_layers=L, num_hidden_layers=num_layers, num_attention_heads=4,
        q_lora_rank=max(16, D // 4), kv_lora_rank=target_cfg.kv_lora_rank, qk_rope_head_dim=target_cfg.qk_rope_head_dim,
        qk_nope_head_dim=16, v_head_dim=16, intermediate_size=2 * D, vocab_size=target_cfg.vocab_size,
        draft_vocab_size=target_cfg.vocab_size, mask_token_id=target_cfg.vocab_size - 1, block_size=block_size)


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"k3serve-dspark-synthetic/v{GENERATOR_VERSION}/{int(seed)}/{name}".encode()).digest()
    return np.random.default_rng(np.frombuffer(digest, dtype=np.uint32))


def _draw(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """float32 values: norms ``1 + N(0, 0.1^2)``; ``markov_w1`` N(0, 1); ``markov_w2``
    N(0, (1.5/sqrt(r))^2) (a bias of std ~1.5 next to logits of std ~3: it flips some argmaxes);
    embeddings N(0, 1); other matrices N(0, 1/fan_in)."""
    x = _rng(seed, name).standard_normal(shape, dtype=np.float32)
    if name.endswith("norm.weight"):
        return np.float32(1.0) + np.float32(0.1) * x
    if name.endswith("markov_w1.weight") or name.startswith("embed_tokens"):
        return x
    if name.endswith("markov_w2.weight"):
        return x * np.float32(1.5 / math.sqrt(shape[1]))
    return x * np.float32(1.0 / math.sqrt(shape[-1]))


def generate_dspark_checkpoint(path: str | os.PathLike, cfg: DSparkConfig | dict, seed: int = 0) -> Path:
    """Write config.json + ``model.safetensors`` of a synthetic DSpark draft, BF16 like the
    release, deterministic in ``(config, seed)``. Like the release it also carries what the
    loader skips: an ``embed_tokens`` copy and, when ``enable_confidence_head``, the
    confidence head (``proj``: ``[1, D (+ r)]`` and a bias)."""
    raw = cfg.to_dict() if isinstance(cfg, DSparkConfig) else dict(cfg)
    parsed = DSparkConfig.from_dict(raw)  # validate before touching the output directory
    shapes = dict(tensor_shapes(parsed))
    shapes["embed_tokens.weight"] = (parsed.vocab_size, parsed.hidden_size)
    if parsed.enable_confidence_head:
        width = parsed.hidden_size + (parsed.markov_rank if parsed.confidence_head_with_markov else 0)
        shapes["confidence_head.proj.weight"] = (1, width)
        shapes["confidence_head.proj.bias"] = (1,)

    def tensors():
        for name in sorted(shapes):
            yield name, _draw(name, shapes[name], seed).astype(ml_dtypes.bfloat16)

    return write_checkpoint(path, raw, tensors())
