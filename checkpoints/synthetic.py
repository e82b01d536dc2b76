"""Deterministic synthetic Kimi K3 checkpoints in the real release format.

Why this module exists: the real checkpoint is 1.5 TB, so tests, the demo server and
benchmarks need small K3-shaped models. A synthetic checkpoint has exactly the release's
``config.json`` layout (top level ``kimi_k3`` + ``text_config`` incl. ``linear_attn_config``
and ``quantization_config``) and exactly its tensor names, dtypes and shapes (prefix
``language_model.``, BF16 / F32 / U8-MXFP4 as in the release, A_log zero-padded to
``head_dim``), so the loader and the model run the same code path as on the release.

Values. Every tensor is drawn in float32 from its own ``numpy.random.Generator`` seeded by
SHA-256 of (generator version, seed, tensor name), then rounded once to its stored dtype
(MXFP4: OCP-quantized). Output therefore does not depend on iteration order. The scales
mirror the golden tiny models, whose forward passes are documented as well-conditioned
(stream RMS ~1-3, logits std ~3, SiTU caps biting, KDA decays spanning (e^-5, 1), router bias
changing the selected experts); with ``d = fan_in``:

====================================================  ====================================
embed_tokens                                          N(0, 1)
lm_head                                               N(0, (3/sqrt(d))^2)  -> logits std ~3
every RMSNorm weight (BF16 and the F32 o_norm)        1 + N(0, 0.1^2)
AttnRes ``*_res_proj`` [1, D]                         N(0, (1.2/sqrt(D))^2) -> depth scores ~N(0, 1.4)
attention projections, f_a, b_proj, latent down/up    N(0, 1/d)
KDA f_b_proj                                          N(0, (0.7/sqrt(d))^2)
KDA {q,k,v}_conv1d (F32)                              N(0, 0.5^2)
KDA A_log (F32, length head_dim)                      log U(1, 16) for the first num_heads, 0 after
KDA dt_bias (F32)                                     N(-0.8, 0.5^2) (mostly slow, some fast decays)
SiTU gate matrices (dense/shared gate_proj, w1)       N(0, (2.5/sqrt(d))^2) -> gate input beyond |4|
SiTU up matrices (dense/shared up_proj, w3)           N(0, (8/sqrt(d))^2)   -> 25*tanh(u/25) cap bites
down matrices (dense/shared down_proj, w2)            N(0, (0.1/sqrt(d))^2)
router gate.weight                                    N(0, (2/sqrt(D))^2)
router e_score_correction_bias (F32)                  N(0, 0.2^2) -> bias changes top-k sets
====================================================  ====================================

Public entry points: :func:`k3_config`, :func:`demo_config`, :func:`tensor_specs`,
:func:`count_parameters`, :func:`generate_checkpoint` (the cached demo model with its tokenizer:
``k3serve.demo``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from k3serve.checkpoints.safetensors_io import write_checkpoint
from k3serve.kernels.mxfp4 import GROUP_SIZE, quantize_mxfp4_np

GENERATOR_VERSION = 2  # 2: the demo checkpoint ships a tokenizer
"""Bump when the drawn values or the layout change; part of the demo cache key."""

DEMO_SEED = 0
PREFIX = "language_model."

# Release special ids sit at fixed offsets from the end of the vocabulary (163840 in the
# release: bos 163584, eos 163586, pad 163839, media placeholder 163605).
BOS_FROM_END, EOS_FROM_END, PAD_FROM_END, MEDIA_FROM_END = 256, 254, 1, 235


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def _quantization_config() -> dict:
    """compressed-tensors MXFP4 config of the release: only the routed experts are quantized."""
    return {
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": ["Linear"],
                "weights": {
                    "dynamic": False,
                    "group_size": GROUP_SIZE,
                    "num_bits": 4,
                    "observer": "minmax",
                    "scale_dtype": "torch.uint8",
                    "strategy": "group",
                    "symmetric": True,
                    "type": "float",
                },
            }
        },
        "format": "mxfp4-pack-quantized",
        "ignore": [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            "re:.*routed_expert_(down|up)_proj.*",
            "re:.*res_proj.*",
            "re:.*lm_head.*",
        ],
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def k3_config(
    *,
    vocab_size: int,
    hidden_size: int,
    num_hidden_layers: int,
    full_attn_layers: list[int],
    kda_num_heads: int,
    kda_head_dim: int,
    mla_heads: int,
    q_lora_rank: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    num_experts: int,
    num_experts_per_token: int,
    num_shared_experts: int,
    moe_intermediate_size: int,
    routed_expert_hidden_size: int,
    intermediate_size: int,
    attn_res_block_size: int,
    routed_scaling_factor: float = 1.0,
    max_position_embeddings: int = 4096,
    rms_norm_eps: float = 1e-5,
    short_conv_kernel_size: int = 4,
    gate_lower_bound: float = -5.0,
    first_k_dense_replace: int = 1,
    activation_situ_beta: float = 4.0,
    activation_situ_linear_beta: float = 25.0,
    initializer_range: float = 0.02,
) -> dict:
    """Full top-level ``config.json`` dict in the K3 release layout.

    ``full_attn_layers`` are the MLA layers, 1-based as in the release; every other layer is
    KDA (``linear_attn_config.kda_layers``). Layers ``< first_k_dense_replace`` (0-based) use
    the dense MLP, the rest are LatentMoE with MXFP4 routed experts.
    """
    V, L = vocab_size, num_hidden_layers
    full = sorted(int(i) for i in full_attn_layers)
    problems = []
    if V < BOS_FROM_END:
        problems.append(f"vocab_size {V} < {BOS_FROM_END} (special ids are offsets from the end)")
    if len(set(full)) != len(full) or any(not 1 <= i <= L for i in full):
        problems.append(f"full_attn_layers {full_attn_layers} must be distinct 1-based ids in 1..{L}")
    if kda_head_dim < kda_num_heads:
        problems.append(
            f"kda_head_dim {kda_head_dim} < kda_num_heads {kda_num_heads}: A_log is stored with "
            f"length head_dim and holds one entry per head"
        )
    for key, val in (("routed_expert_hidden_size", routed_expert_hidden_size),
                     ("moe_intermediate_size", moe_intermediate_size)):
        if val % GROUP_SIZE:
            problems.append(f"{key} {val} must be a multiple of {GROUP_SIZE} (MXFP4 group)")
    if not 1 <= num_experts_per_token <= num_experts:
        problems.append(f"num_experts_per_token {num_experts_per_token} not in 1..{num_experts}")
    if attn_res_block_size < 1 or not 0 <= first_k_dense_replace <= L:
        problems.append("attn_res_block_size must be >= 1 and first_k_dense_replace in 0..L")
    if problems:
        raise ValueError("invalid K3 config: " + "; ".join(problems))

    bos, eos, pad = V - BOS_FROM_END, V - EOS_FROM_END, V - PAD_FROM_END
    text = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": V,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": L,
        "num_attention_heads": mla_heads,
        "num_key_value_heads": mla_heads,
        "hidden_act": "situ",
        "activation_situ_beta": float(activation_situ_beta),
        "activation_situ_linear_beta": float(activation_situ_linear_beta),
        "rms_norm_eps": rms_norm_eps,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": False,
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": kv_lora_rank,
        "qk_nope_head_dim": qk_nope_head_dim,
        "qk_rope_head_dim": qk_rope_head_dim,
        "v_head_dim": v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": num_experts,
        "num_experts_per_token": num_experts_per_token,
        "num_shared_experts": num_shared_experts,
        "moe_intermediate_size": moe_intermediate_size,
        "routed_expert_hidden_size": routed_expert_hidden_size,
        "latent_moe_use_norm": True,
        "routed_scaling_factor": float(routed_scaling_factor),
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": first_k_dense_replace,
        "moe_layer_freq": 1,
        "attn_res_block_size": attn_res_block_size,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "full_attn_layers": full,
            "kda_layers": [i for i in range(1, L + 1) if i not in full],
            "num_heads": kda_num_heads,
            "head_dim": kda_head_dim,
            "short_conv_kernel_size": short_conv_kernel_size,
            "gate_lower_bound": float(gate_lower_bound),
            "use_full_rank_gate": True,
        },
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "initializer_range": initializer_range,
        "use_cache": True,
        "dtype": "bfloat16",
        "quantization_config": _quantization_config(),
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "media_placeholder_token_id": V - MEDIA_FROM_END,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "ignore_index": -100,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "text_config": text,
    }


def demo_config(num_hidden_layers: int = 13) -> dict:
    """K3 scaled down to ~30M logical parameters (see :func:`count_parameters`).

    Keeps the release's structure: MLA at 1-based ``range(4, L, 4) + [L]`` with L = 13 (so
    the last two layers are both MLA, like release layers 91/92), AttnRes blocks of 4 layers,
    layer 0 dense, 64 routed experts top-8 + 2 shared, MXFP4 experts with latent = D/2 (as
    3584 = 7168/2), special ids at the release offsets. ``num_hidden_layers`` makes deeper
    (or shallower) variants of the same shape (``k3serve bench warmup``).
    """
    L = num_hidden_layers
    return k3_config(
        vocab_size=4096,
        hidden_size=256,
        num_hidden_layers=L,
        full_attn_layers=list(range(4, L, 4)) + [L],
        kda_num_heads=4,
        kda_head_dim=64,
        mla_heads=4,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=64,
        num_experts_per_token=8,
        num_shared_experts=2,
        moe_intermediate_size=64,
        routed_expert_hidden_size=128,
        intermediate_size=768,
        attn_res_block_size=4,
        routed_scaling_factor=1.0,
        max_position_embeddings=4096,
    )


# --------------------------------------------------------------------------------------------
# Tensor layout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Weight:
    """One logical weight: stored as BF16/F32, or as an MXFP4 packed/scale pair."""

    name: str  # full checkpoint name; for MXFP4 the ``...wN.weight`` stem of the pair
    dtype: str  # "BF16", "F32" or "MXFP4"
    shape: tuple[int, ...]  # logical shape ([N, K] for MXFP4)
    init: str
    std: float = 1.0
    extra: float = 0.0  # mean for "normal"; number of used entries for "a_log"


def _text(config: dict) -> dict:
    if "text_config" in config:
        return config["text_config"]
    if "hidden_size" in config:
        return config
    raise ValueError("config has neither text_config nor hidden_size: not a K3 config")


def _weights(config: dict) -> list[_Weight]:
    t = _text(config)
    D, V, L = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    la = t["linear_attn_config"]
    mla_layers = {i - 1 for i in la["full_attn_layers"]}
    H, dk, W = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    P = H * dk
    Hm, qr, kvr = t["num_attention_heads"], t["q_lora_rank"], t["kv_lora_rank"]
    nope, rope, vd = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
    E, Im, lat = t["num_experts"], t["moe_intermediate_size"], t["routed_expert_hidden_size"]
    Ish = Im * t["num_shared_experts"]
    dense_until = t["first_k_dense_replace"]
    if t.get("moe_layer_freq", 1) != 1:
        raise ValueError("only moe_layer_freq == 1 (every layer after the dense ones is MoE) is supported")

    out: list[_Weight] = []

    def lin(name, n, k, gain=1.0):
        out.append(_Weight(name, "BF16", (n, k), "normal", gain / math.sqrt(k)))

    def norm(name, n, dtype="BF16"):
        out.append(_Weight(name, dtype, (n,), "norm", 0.1))

    m = PREFIX + "model."
    out.append(_Weight(m + "embed_tokens.weight", "BF16", (V, D), "normal", 1.0))
    lin(PREFIX + "lm_head.weight", V, D, 3.0)
    norm(m + "norm.weight", D)
    lin(m + "output_attn_res_proj.weight", 1, D, 1.2)
    norm(m + "output_attn_res_norm.weight", D)
    for layer in range(L):
        p = f"{m}layers.{layer}."
        norm(p + "input_layernorm.weight", D)
        norm(p + "post_attention_layernorm.weight", D)
        for side in ("self_attention", "mlp"):  # layer 0's self_attention_res_* is never read
            lin(p + f"{side}_res_proj.weight", 1, D, 1.2)
            norm(p + f"{side}_res_norm.weight", D)
        a = p + "self_attn."
        if layer in mla_layers:
            lin(a + "q_a_proj.weight", qr, D)
            norm(a + "q_a_layernorm.weight", qr)
            lin(a + "q_b_proj.weight", Hm * (nope + rope), qr)
            lin(a + "kv_a_proj_with_mqa.weight", kvr + rope, D)
            norm(a + "kv_a_layernorm.weight", kvr)
            lin(a + "kv_b_proj.weight", Hm * (nope + vd), kvr)
            lin(a + "g_proj.weight", Hm * vd, D)
            lin(a + "o_proj.weight", D, Hm * vd)
        else:
            for x in "qkv":
                lin(a + f"{x}_proj.weight", P, D)
                out.append(_Weight(a + f"{x}_conv1d.weight", "F32", (P, 1, W), "normal", 0.5))
            lin(a + "g_proj.weight", P, D)
            lin(a + "o_proj.weight", D, P)
            lin(a + "f_a_proj.weight", dk, D)
            lin(a + "f_b_proj.weight", P, dk, 0.7)
            lin(a + "b_proj.weight", H, D)
            out.append(_Weight(a + "A_log", "F32", (dk,), "a_log", 0.0, float(H)))
            out.append(_Weight(a + "dt_bias", "F32", (P,), "normal", 0.5, -0.8))
            norm(a + "o_norm.weight", dk, "F32")
        if layer < dense_until:
            lin(p + "mlp.gate_proj.weight", t["intermediate_size"], D, 2.5)
            lin(p + "mlp.up_proj.weight", t["intermediate_size"], D, 8.0)
            lin(p + "mlp.down_proj.weight", D, t["intermediate_size"], 0.1)
            continue
        b = p + "block_sparse_moe."
        lin(b + "gate.weight", E, D, 2.0)
        out.append(_Weight(b + "gate.e_score_correction_bias", "F32", (E,), "normal", 0.2))
        if Ish:
            lin(b + "shared_experts.gate_proj.weight", Ish, D, 2.5)
            lin(b + "shared_experts.up_proj.weight", Ish, D, 8.0)
            lin(b + "shared_experts.down_proj.weight", D, Ish, 0.1)
        lin(b + "routed_expert_down_proj.weight", lat, D)
        norm(b + "routed_expert_norm.weight", lat)
        lin(b + "routed_expert_up_proj.weight", D, lat)
        for e in range(E):
            x = f"{b}experts.{e}."
            out.append(_Weight(x + "w1.weight", "MXFP4", (Im, lat), "normal", 2.5 / math.sqrt(lat)))
            out.append(_Weight(x + "w2.weight", "MXFP4", (lat, Im), "normal", 0.1 / math.sqrt(Im)))
            out.append(_Weight(x + "w3.weight", "MXFP4", (Im, lat), "normal", 8.0 / math.sqrt(lat)))
    out.sort(key=lambda w: w.name)
    return out


def tensor_specs(config: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (safetensors dtype, shape)}`` of every tensor of a K3 checkpoint, sorted by name."""
    specs = {}
    for w in _weights(config):
        if w.dtype == "MXFP4":
            stem = w.name[: -len(".weight")]
            n, k = w.shape
            specs[stem + ".weight_packed"] = ("U8", (n, k // 2))
            specs[stem + ".weight_scale"] = ("U8", (n, k // GROUP_SIZE))
        else:
            specs[w.name] = (w.dtype, w.shape)
    return dict(sorted(specs.items()))


def count_parameters(config: dict) -> int:
    """Logical parameter count: every stored element, MXFP4 counted as unpacked weights
    (scales not counted), A_log at its stored length ``head_dim``."""
    return sum(math.prod(w.shape) for w in _weights(config))


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"k3serve-synthetic/v{GENERATOR_VERSION}/{int(seed)}/{name}".encode()).digest()
    return np.random.default_rng(np.frombuffer(digest, dtype=np.uint32))


def _draw(w: _Weight, seed: int) -> np.ndarray:
    """float32 values of one logical weight."""
    rng = _rng(seed, w.name)
    if w.init == "normal":
        x = rng.standard_normal(w.shape, dtype=np.float32) * np.float32(w.std)
        return x + np.float32(w.extra) if w.extra else x
    if w.init == "norm":
        return np.float32(1.0) + rng.standard_normal(w.shape, dtype=np.float32) * np.float32(w.std)
    if w.init == "a_log":
        used = int(w.extra)
        x = np.zeros(w.shape, dtype=np.float32)
        x[:used] = np.log(rng.uniform(1.0, 16.0, size=used)).astype(np.float32)
        return x
    raise AssertionError(w.init)


def iter_tensors(config: dict, seed: int = 0) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, array)`` of a synthetic checkpoint one tensor at a time, sorted by name."""
    for w in _weights(config):
        x = _draw(w, seed)
        if w.dtype == "MXFP4":
            packed, scale = quantize_mxfp4_np(x)
            del x
            stem = w.name[: -len(".weight")]
            yield stem + ".weight_packed", packed
            yield stem + ".weight_scale", scale
        elif w.dtype == "BF16":
            yield w.name, x.astype(ml_dtypes.bfloat16)
        else:
            yield w.name, x


def generate_checkpoint(
    out_dir: str | os.PathLike, config: dict, seed: int = 0, max_shard_bytes: int | None = None
) -> Path:
    """Write ``config.json`` + safetensors of a synthetic K3 checkpoint; deterministic in
    ``(config, seed)``. Tensors are generated and written one at a time."""
    if "text_config" not in config:
        raise ValueError("generate_checkpoint needs a top-level K3 config (see k3_config)")
    _weights(config)  # validate before touching the output directory
    return write_checkpoint(out_dir, config, iter_tensors(config, seed), max_shard_bytes)


# --------------------------------------------------------------------------------------------
# Cached demo checkpoint
# --------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$K3SERVE_CACHE`` or ``~/.cache/k3serve``."""
    from ..compile_cache import cache_root

    return cache_root()


def demo_checkpoint_name(config: dict | None = None, seed: int = DEMO_SEED) -> str:
    """Cache folder name: short hash of (config, seed, generator version)."""
    config = demo_config() if config is None else config
    key = json.dumps({"config": config, "seed": int(seed), "version": GENERATOR_VERSION}, sort_keys=True)
    return "k3-demo-" + hashlib.sha256(key.encode()).hexdigest()[:12]
