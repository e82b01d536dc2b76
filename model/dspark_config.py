"""Configuration of a DSpark draft model (``model_type: k3_dspark``), parsed from its config.json.

The K3 draft (``Inferact/Kimi-K3-DSpark``) is a separate checkpoint with its own config.json;
its field names are the ones the public loaders read (tokenspeed's ``KimiK3DSparkConfig``,
vLLM's ``K3DSparkModel``): ``target_hidden_size, num_target_layers, target_layer_ids,
hidden_size, num_hidden_layers, num_attention_heads, q_lora_rank, kv_lora_rank,
qk_rope_head_dim, qk_nope_head_dim, v_head_dim, intermediate_size, hidden_act, rms_norm_eps,
rope_theta, rope_scaling / rope_parameters, vocab_size, draft_vocab_size, markov_rank,
block_size, mask_token_id, enable_confidence_head, confidence_head_with_markov``.

What is refused here, and why (each would corrupt drafts silently rather than fail):

* ``draft_vocab_size != vocab_size`` — a reduced draft vocabulary needs its own ``lm_head``
  and a ``d2t`` id map; this port shares the target's ``lm_head`` and supports neither.
* ``mla_use_nope: true`` or ``mla_use_output_gate: true`` — the draft is RoPE MLA without a
  gate (unlike the target's MLA, ``model/mla.py``); the checkpoint carries no gate weights.
* a Markov head other than ``vanilla``, ``fc_norm: true`` (per-tap norms), a missing
  ``mask_token_id``, ``target_layer_ids`` that do not match ``num_target_layers`` or are not
  strictly ascending (the concatenation order feeds ``context_proj`` positionally).
* RoPE types other than plain (``default``) and DeepSeek YaRN (``yarn`` / ``deepseek_yarn``).

RoPE: ``rope_parameters`` (transformers 5 spelling) or ``rope_scaling`` (4.x spelling);
``rope_parameters.rope_theta`` wins over a top-level ``rope_theta``, as in the public loaders.
YaRN follows DeepSeek-V3: per-frequency interpolation ramp between ``beta_fast`` and
``beta_slow`` rotations over ``original_max_position_embeddings``; cos/sin scaled by
``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``; the softmax scale multiplied
by ``mscale(factor, mscale_all_dim)**2`` (:attr:`DSparkConfig.softmax_scale`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

MODEL_TYPE = "k3_dspark"
ARCHITECTURE = "K3DSparkModel"


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """DeepSeek-style YaRN parameters (hashable, so the config can be a jit static)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's ``yarn_get_mscale``: ``0.1 * mscale * ln(factor) + 1`` (1 when factor <= 1)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    # context conditioning: target taps -> context_proj -> context_norm
    target_hidden_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    # draft backbone
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    hidden_act: str
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: YarnScaling | None
    # vocabulary, block and heads
    vocab_size: int
    draft_vocab_size: int
    markov_rank: int
    block_size: int
    mask_token_id: int
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    target_num_hidden_layers: int | None = None  # optional in the config; checked when given
    aux_hidden_stream: str = "prefix"  # which target stream is tapped (engine's concern)
    max_position_embeddings: int | None = None
    situ_beta: float = 4.0  # only read if hidden_act == "situ" (model.layers.gated_act)
    situ_linear_beta: float = 25.0

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """One cached context/block row per token per layer: ``[RMSNorm(c) | RoPE(k_pe)]``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def context_in_features(self) -> int:
        """Width of the concatenated target taps that ``context_proj`` reads."""
        return self.num_target_layers * self.target_hidden_size

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim^-1/2``, times ``mscale(factor, mscale_all_dim)^2`` under YaRN."""
        s = self.qk_head_dim ** -0.5
        y = self.rope_scaling
        if y is not None:
            m = yarn_mscale(y.factor, y.mscale_all_dim)
            s *= m * m
        return s

    @property
    def rope_cos_sin_scale(self) -> float:
        """The factor YaRN puts on cos and sin (1 for plain RoPE and when mscale == mscale_all_dim)."""
        y = self.rope_scaling
        if y is None:
            return 1.0
        return yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "DSparkConfig":
        mt = cfg.get("model_type")
        if mt is not None and mt != MODEL_TYPE:
            raise ValueError(f"DSpark draft config has model_type {mt!r}, expected {MODEL_TYPE!r}")
        # DFlash-style configs nest block_size / mask_token_id / target_layer_ids
        nested = {}
        for k in ("dflash_config", "dspark_config"):
            if isinstance(cfg.get(k), dict):
                nested.update(cfg[k])

        def get(key, default=dataclasses.MISSING):
            for src in (cfg, nested):
                if src.get(key) is not None:
                    return src[key]
            if default is dataclasses.MISSING:
                raise ValueError(f"DSpark draft config.json lacks required key {key!r}")
            return default

        for flag, why in (("mla_use_nope", "the draft's MLA uses RoPE"),
                          ("mla_use_output_gate", "the draft's MLA has no output gate")):
            if cfg.get(flag):
                raise ValueError(f"DSpark draft config sets {flag}=true; unsupported ({why})")
        if cfg.get("fc_norm"):
            raise ValueError("DSpark draft config sets fc_norm=true (per-tap RMSNorm before context_proj); "
                             "not supported yet")
        markov_type = str(get("markov_head_type", "vanilla")).lower()
        if markov_type != "vanilla":
            raise ValueError(f"DSpark markov_head_type {markov_type!r} is not supported (only 'vanilla')")

        theta, scaling = _rope(cfg)
        vocab = int(get("vocab_size"))
        taps = [int(i) for i in get("target_layer_ids")]
        return cls(
            target_hidden_size=int(get("target_hidden_size")),
            num_target_layers=int(get("num_target_layers", len(taps))),
            target_layer_ids=tuple(taps),
            hidden_size=int(get("hidden_size")),
            num_hidden_layers=int(get("num_hidden_layers")),
            num_attention_heads=int(get("num_attention_heads")),
            q_lora_rank=int(get("q_lora_rank")),
            kv_lora_rank=int(get("kv_lora_rank")),
            qk_rope_head_dim=int(get("qk_rope_head_dim")),
            qk_nope_head_dim=int(get("qk_nope_head_dim")),
            v_head_dim=int(get("v_head_dim")),
            intermediate_size=int(get("intermediate_size")),
            hidden_act=str(get("hidden_act", "silu")),
            rms_norm_eps=float(get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            vocab_size=vocab,
            draft_vocab_size=int(get("draft_vocab_size", vocab)),
            markov_rank=int(get("markov_rank")),
            block_size=int(get("block_size")),
            mask_token_id=int(get("mask_token_id")),
            enable_confidence_head=bool(get("enable_confidence_head", False)),
            confidence_head_with_markov=bool(get("confidence_head_with_markov", False)),
            target_num_hidden_layers=(None if get("target_num_hidden_layers", None) is None
                                      else int(get("target_num_hidden_layers"))),
            aux_hidden_stream=str(get("aux_hidden_stream", "prefix")).lower(),
            max_position_embeddings=(None if get("max_position_embeddings", None) is None
                                     else int(get("max_position_embeddings"))),
            situ_beta=float(get("activation_situ_beta", 4.0)),
            situ_linear_beta=float(get("activation_situ_linear_beta", 25.0)),
        )._validated()

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "DSparkConfig":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """A config.json dict in the loaders' spelling (what ``from_dict`` reads back)."""
        d = {"model_type": MODEL_TYPE, "architectures": [ARCHITECTURE]}
        for f in dataclasses.fields(self):
            if f.name in ("rope_scaling", "situ_beta", "situ_linear_beta"):
                continue
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        d["activation_situ_beta"], d["activation_situ_linear_beta"] = self.situ_beta, self.situ_linear_beta
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"rope_type": "deepseek_yarn", **dataclasses.asdict(self.rope_scaling)}
        return {k: v for k, v in d.items() if v is not None}

    def replace(self, **kw) -> "DSparkConfig":
        return dataclasses.replace(self, **kw)._validated()

    # ------------------------------------------------------------------ checks
    def _validated(self) -> "DSparkConfig":
        if self.draft_vocab_size != self.vocab_size:
            raise ValueError(f"DSpark draft_vocab_size={self.draft_vocab_size} differs from vocab_size="
                             f"{self.vocab_size}: a reduced draft vocabulary (d2t map, own lm_head) is not "
                             "supported; only full-vocabulary drafts that share the target's lm_head")
        ids = self.target_layer_ids
        if not ids:
            raise ValueError("DSpark target_layer_ids is empty")
        if len(ids) != self.num_target_layers:
            raise ValueError(f"DSpark target_layer_ids has {len(ids)} entries but num_target_layers="
                             f"{self.num_target_layers}")
        if any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0:
            raise ValueError(f"DSpark target_layer_ids must be distinct, ascending and >= 0: {list(ids)} "
                             "(the concatenation order feeds context_proj positionally)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"DSpark mask_token_id={self.mask_token_id} is outside [0, {self.vocab_size})")
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                     "qk_nope_head_dim", "v_head_dim", "intermediate_size", "markov_rank", "block_size",
                     "target_hidden_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DSpark {name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise ValueError(f"DSpark qk_rope_head_dim must be positive and even, got {self.qk_rope_head_dim}")
        if self.aux_hidden_stream not in ("prefix", "attn_res"):
            raise ValueError(f"DSpark aux_hidden_stream {self.aux_hidden_stream!r} is not one of 'prefix', 'attn_res'")
        if self.hidden_act not in ("silu", "situ"):
            raise ValueError(f"DSpark hidden_act {self.hidden_act!r} is not supported ('silu' or 'situ')")
        if self.target_num_hidden_layers is not None and max(ids) >= self.target_num_hidden_layers:
            raise ValueError(f"DSpark target_layer_ids max {max(ids)} is out of range for a "
                             f"{self.target_num_hidden_layers}-layer target")
        return self

    def check_against(self, target_cfg) -> "DSparkConfig":
        """Refuse pairing this draft with a target it does not fit (``model.config.K3Config``):
        tap width, tapped layer indices, vocabulary, and the shared embedding / lm_head width.
        Returns self."""
        t_hidden, t_layers, t_vocab = target_cfg.hidden_size, target_cfg.num_hidden_layers, target_cfg.vocab_size
        if self.target_hidden_size != t_hidden:
            raise ValueError(f"DSpark target_hidden_size={self.target_hidden_size} does not match the target's "
                             f"hidden_size={t_hidden}")
        if self.hidden_size != t_hidden:
            raise ValueError(f"DSpark hidden_size={self.hidden_size} differs from the target's hidden_size="
                             f"{t_hidden}: the draft reads the target's embed_tokens and lm_head")
        if max(self.target_layer_ids) >= t_layers:
            raise ValueError(f"DSpark target_layer_ids {list(self.target_layer_ids)} reach past the target's "
                             f"{t_layers} layers")
        if self.target_num_hidden_layers is not None and self.target_num_hidden_layers != t_layers:
            raise ValueError(f"DSpark target_num_hidden_layers={self.target_num_hidden_layers} does not match "
                             f"the target's {t_layers} layers")
        if self.vocab_size != t_vocab:
            raise ValueError(f"DSpark vocab_size={self.vocab_size} does not match the target's vocab_size="
                             f"{t_vocab} (the draft samples through the target's lm_head)")
        return self


def _rope(cfg: dict) -> tuple[float, YarnScaling | None]:
    """``(rope_theta, YaRN or None)`` from ``rope_parameters`` / ``rope_scaling`` / ``rope_theta``."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"DSpark rope parameters must be a dict, got {params!r}")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ValueError("DSpark draft config.json lacks rope_theta (top level or in rope_parameters)")
    kind = str(params.get("rope_type", params.get("type", "default"))).lower()
    if kind == "default":
        return float(theta), None
    if kind not in ("yarn", "deepseek_yarn"):
        raise ValueError(f"DSpark rope type {kind!r} is not supported ('default', 'yarn', 'deepseek_yarn')")
    if params.get("apply_yarn_scaling", True) is False:
        raise ValueError("DSpark rope parameters set apply_yarn_scaling=false (DeepSeek llama scaling); "
                         "not supported")
    for k in ("factor", "original_max_position_embeddings"):
        if params.get(k) is None:
            raise ValueError(f"DSpark YaRN rope parameters lack {k!r}")
    return float(theta), YarnScaling(
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast", 32.0)),
        beta_slow=float(params.get("beta_slow", 1.0)),
        mscale=float(params.get("mscale", 1.0)),
        mscale_all_dim=float(params.get("mscale_all_dim", 0.0)),
    )


def k3_dspark_config() -> DSparkConfig:
    """The released K3 draft (``Inferact/Kimi-K3-DSpark``) as far as its public description
    goes (``../shared/design/k3-architecture.md`` §6): 5 dense layers of hidden 7168 on the
    target's taps 2, 23, 47, 71, 89, a 7-token block, the target's 163,840-token vocabulary, a
    rank-256 Markov head. What is not public is assumed (for compiling and planning, never for
    loading weights, which bring their own config.json): the target's MLA widths (Q-LoRA 1536,
    latent 512 + RoPE 64, 128-wide nope and value heads), 64 heads and an MLP of 14,336, which
    together with the checkpoint's copy of the embeddings give the published ~3.56B
    parameters, and DeepSeek-V3's YaRN RoPE (theta 10,000, factor 40 over 4,096)."""
    return DSparkConfig.from_dict({
        "model_type": MODEL_TYPE, "target_hidden_size": 7168, "num_target_layers": 5,
        "target_layer_ids": [2, 23, 47, 71, 89], "target_num_hidden_layers": 93, "hidden_size": 7168,
        "num_hidden_layers": 5, "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "intermediate_size": 14336,
        "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_scaling": {"rope_type": "deepseek_yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        "max_position_embeddings": 1048576, "vocab_size": 163840, "draft_vocab_size": 163840, "markov_rank": 256,
        "block_size": 7, "mask_token_id": 163839, "enable_confidence_head": False, "aux_hidden_stream": "attn_res",
    })
