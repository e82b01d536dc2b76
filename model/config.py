"""Model configuration: one dataclass for Kimi K3 and Kimi Linear, parsed from config.json.

Why one class: both families share the layer skeleton (KDA / MLA mixers, MoE FFN); the
differences are a handful of switches (AttnRes, latent MoE, SiTU, the forget-gate form,
the output-gate rank, MLA's q LoRA and output gate). Keeping them as plain fields lets the
model code branch on *features*, never on a family name.

The layer schedule comes only from ``linear_attn_config.full_attn_layers`` /
``kda_layers`` (1-based in config.json). K3's last two layers are both MLA, so an
``i % 4`` rule would be wrong.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


KERNEL_BACKENDS = ("reference", "pallas", "pallas-interpret")


@dataclasses.dataclass(frozen=True)
class K3Config:
    family: str  # "kimi_k3" or "kimi_linear"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # per 0-based layer: "kda" or "mla"
    rms_norm_eps: float
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    gate_lower_bound: float | None  # K3: -5 (sigmoid gate); Kimi Linear: None (softplus gate)
    full_rank_output_gate: bool  # K3: g_proj; Kimi Linear: g_b(g_a(x))
    # MLA
    mla_num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_output_gate: bool
    mla_latent_eps: float  # q_a/kv_a layernorm eps (the official class default, 1e-6)
    # FFN / MoE
    hidden_act: str  # "situ" or "silu"
    situ_beta: float
    situ_linear_beta: float
    intermediate_size: int  # dense MLP (layers < first_k_dense_replace)
    first_k_dense_replace: int
    moe_layer_freq: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int | None  # latent width; None = experts read the hidden state
    latent_moe_use_norm: bool
    routed_scaling_factor: float
    moe_renormalize: bool
    num_expert_group: int
    topk_group: int
    # Block Attention Residuals (None = plain residual adds)
    attn_res_block_size: int | None
    # quantization of routed experts
    experts_mxfp4: bool
    # special tokens
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    # the kernel backend the ops use (a load option, not in config.json; ``load_pretrained``):
    # "reference" (pure JAX), "pallas" (TPU) or "pallas-interpret" (Pallas TPU kernels run
    # by the interpreter: CPU tests)
    kernels: str = "reference"
    # latent layers of a draft model's context KV kept in the MLA pool after the target's own
    # (speculative decoding with DSpark, ``server/spec/dspark_drafting.py``): set by the engine
    draft_kv_layers: int = 0

    # ------------------------------------------------------------------ derived
    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "kda")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mla")

    @property
    def kda_proj_size(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:
        """Per-token MLA latent row: normed latent + the shared extra key dims."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mla_pool_width(self) -> int:
        """The MLA pool's row width: :attr:`mla_cache_width` rounded up to whole 128-lane
        vregs when it is wider than one (K3: 576 -> 640), zeros after the row. A TPU lays a
        576-wide row out padded to 640 anyway; stored 576 wide, XLA:TPU gave the pool a
        page-minor layout (no padding) and copied the whole pool into the kernels' row-major
        layout and back every step (7.5 GiB per device under v7-32-decode, docs/compile.md).
        Narrow rows (the small test models) stay as they are."""
        w = self.mla_cache_width
        return w if w <= 128 else -(-w // 128) * 128

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def expert_input_size(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    def is_moe_layer(self, i: int) -> bool:
        # Kimi's (and DeepSeek's) rule: MoE from first_k_dense_replace on, at multiples of the frequency
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def num_attn_res_blocks(self) -> int:
        """Snapshots in the bank at the end of the stack (taken at layers 0, b, 2b, ...)."""
        if not self.uses_attn_res:
            return 0
        b = self.attn_res_block_size
        return (self.num_hidden_layers + b - 1) // b

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "K3Config":
        top = cfg
        mt = cfg.get("model_type")
        if mt == "kimi_k3":
            text = cfg.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("kimi_k3 config.json has no text_config")
            family = "kimi_k3"
        elif mt == "kimi_linear":
            text = cfg
            family = "kimi_linear"
        else:
            raise ValueError(f"unsupported model_type {mt!r} (expected 'kimi_k3' or 'kimi_linear')")

        def get(key, default=dataclasses.MISSING):
            if key in text and text[key] is not None:
                return text[key]
            if key in top and top[key] is not None:
                return top[key]
            if default is dataclasses.MISSING:
                raise ValueError(f"config.json lacks required key {key!r}")
            return default

        L = int(get("num_hidden_layers"))
        lac = text.get("linear_attn_config") or {}
        full = [int(i) for i in lac.get("full_attn_layers", [])]
        kda = [int(i) for i in lac.get("kda_layers", [])]
        if not full and not kda:
            raise ValueError("linear_attn_config must list full_attn_layers and/or kda_layers")
        for i in full + kda:  # before the per-layer scan, so a typo'd index is reported as such
            if not 1 <= i <= L:
                raise ValueError(f"layer index {i} out of range 1..{L} in linear_attn_config")
        types = []
        for i in range(1, L + 1):
            in_full, in_kda = i in full, i in kda
            if in_full and in_kda:
                raise ValueError(f"layer {i} (1-based) listed both as MLA and KDA")
            if in_full:
                types.append("mla")
            elif in_kda or not kda:  # lists may give only full_attn_layers
                types.append("kda")
            else:
                raise ValueError(f"layer {i} (1-based) is in neither full_attn_layers nor kda_layers")

        k3 = family == "kimi_k3"
        quant = text.get("quantization_config") or top.get("quantization_config") or {}
        fmt = str(quant.get("format", ""))
        hidden_act = str(get("hidden_act", "silu"))
        if hidden_act not in ("situ", "silu"):
            raise ValueError(f"unsupported hidden_act {hidden_act!r}")
        q_lora = text.get("q_lora_rank")
        latent = text.get("routed_expert_hidden_size")
        return cls(
            family=family,
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            num_hidden_layers=L,
            layer_types=tuple(types),
            rms_norm_eps=float(get("rms_norm_eps", 1e-5)),
            kda_num_heads=int(lac.get("num_heads", 0)),
            kda_head_dim=int(lac.get("head_dim", 0)),
            conv_kernel_size=int(lac.get("short_conv_kernel_size", 4)),
            gate_lower_bound=(None if lac.get("gate_lower_bound") is None else float(lac["gate_lower_bound"])),
            full_rank_output_gate=bool(lac.get("use_full_rank_gate", False)),
            mla_num_heads=int(get("num_attention_heads")),
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(get("kv_lora_rank")),
            qk_nope_head_dim=int(get("qk_nope_head_dim")),
            qk_rope_head_dim=int(get("qk_rope_head_dim")),
            v_head_dim=int(get("v_head_dim")),
            mla_output_gate=bool(text.get("mla_use_output_gate", False)),
            mla_latent_eps=1e-6,
            hidden_act=hidden_act,
            situ_beta=float(text.get("activation_situ_beta", 4.0)),
            situ_linear_beta=float(text.get("activation_situ_linear_beta", 25.0)),
            intermediate_size=int(get("intermediate_size")),
            first_k_dense_replace=int(get("first_k_dense_replace", 1)),
            moe_layer_freq=int(get("moe_layer_freq", 1)),
            num_experts=int(get("num_experts")),
            num_experts_per_token=int(get("num_experts_per_token")),
            num_shared_experts=int(get("num_shared_experts", 0)),
            moe_intermediate_size=int(get("moe_intermediate_size")),
            routed_expert_hidden_size=None if latent is None else int(latent),
            latent_moe_use_norm=bool(text.get("latent_moe_use_norm", latent is not None)),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
            moe_renormalize=bool(get("moe_renormalize", True)),
            num_expert_group=int(get("num_expert_group", 1)),
            topk_group=int(get("topk_group", 1)),
            attn_res_block_size=(int(text["attn_res_block_size"]) if k3 and text.get("attn_res_block_size") else None),
            experts_mxfp4="mxfp4" in fmt,
            bos_token_id=top.get("bos_token_id", text.get("bos_token_id")),
            eos_token_id=top.get("eos_token_id", text.get("eos_token_id")),
            pad_token_id=top.get("pad_token_id", text.get("pad_token_id")),
            max_position_embeddings=text.get("max_position_embeddings"),
            tie_word_embeddings=bool(top.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        )._validated()

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "K3Config":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def _validated(self) -> "K3Config":
        if self.kernels not in KERNEL_BACKENDS:
            raise ValueError(f"kernels={self.kernels!r} is not one of {', '.join(KERNEL_BACKENDS)}")
        if self.kda_layers and (self.kda_num_heads <= 0 or self.kda_head_dim <= 0):
            raise ValueError("KDA layers present but linear_attn_config lacks num_heads/head_dim")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError("num_experts_per_token exceeds num_experts")
        if self.num_expert_group != 1:
            raise ValueError("grouped top-k with num_expert_group > 1 is not supported (K3 uses 1)")
        if self.experts_mxfp4:
            for name, k in (("expert input", self.expert_input_size), ("moe_intermediate_size", self.moe_intermediate_size)):
                if k % 32:
                    raise ValueError(f"MXFP4 experts need {name} to be a multiple of 32, got {k}")
        return self

    def replace(self, **kw) -> "K3Config":
        return dataclasses.replace(self, **kw)._validated()


def release_layer_types(num_layers: int, every: int = 4) -> tuple[str, ...]:
    """The release's schedule: MLA at 1-based every-th layer and at the last layer."""
    full = set(range(every, num_layers, every)) | {num_layers}
    return tuple("mla" if i in full else "kda" for i in range(1, num_layers + 1))


def k3_full() -> K3Config:
    """The released Kimi K3 text model (2.8T parameters): for abstract shapes and planning."""
    return K3Config(
        family="kimi_k3", vocab_size=163840, hidden_size=7168, num_hidden_layers=93,
        layer_types=release_layer_types(93), rms_norm_eps=1e-5,
        kda_num_heads=96, kda_head_dim=128, conv_kernel_size=4, gate_lower_bound=-5.0,
        full_rank_output_gate=True, mla_num_heads=96, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_output_gate=True,
        mla_latent_eps=1e-6, hidden_act="situ", situ_beta=4.0, situ_linear_beta=25.0,
        intermediate_size=33792, first_k_dense_replace=1, moe_layer_freq=1, num_experts=896,
        num_experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072,
        routed_expert_hidden_size=3584, latent_moe_use_norm=True, routed_scaling_factor=1.0,
        moe_renormalize=True, num_expert_group=1, topk_group=1, attn_res_block_size=12,
        experts_mxfp4=True, bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
        max_position_embeddings=1048576,
    )


def k3_small(**overrides) -> K3Config:
    """A small K3 with the release's structure (tests, planning examples)."""
    base = dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=8, layer_types=release_layer_types(8),
        kda_num_heads=4, kda_head_dim=16, mla_num_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=96,
        num_experts=16, num_experts_per_token=4, moe_intermediate_size=32,
        routed_expert_hidden_size=96, attn_res_block_size=3, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, max_position_embeddings=4096,
    )
    base.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        base["layer_types"] = release_layer_types(base["num_hidden_layers"])
    return k3_full().replace(**base)
