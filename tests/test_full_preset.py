"""The full-size K3 preset, built abstractly (no memory): shapes and sizes from the spec."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3serve.checkpoints.synthetic import count_parameters, k3_config, tensor_specs
from k3serve.model import K3Config, KimiLM, k3_full
from k3serve.model.cache import cache_shapes


def _release_json():
    f = k3_full()
    return k3_config(
        vocab_size=f.vocab_size, hidden_size=f.hidden_size, num_hidden_layers=f.num_hidden_layers,
        full_attn_layers=[i + 1 for i in f.mla_layers], kda_num_heads=f.kda_num_heads,
        kda_head_dim=f.kda_head_dim, mla_heads=f.mla_num_heads, q_lora_rank=f.q_lora_rank,
        kv_lora_rank=f.kv_lora_rank, qk_nope_head_dim=f.qk_nope_head_dim,
        qk_rope_head_dim=f.qk_rope_head_dim, v_head_dim=f.v_head_dim, num_experts=f.num_experts,
        num_experts_per_token=f.num_experts_per_token, num_shared_experts=f.num_shared_experts,
        moe_intermediate_size=f.moe_intermediate_size, routed_expert_hidden_size=f.routed_expert_hidden_size,
        intermediate_size=f.intermediate_size, attn_res_block_size=f.attn_res_block_size,
        max_position_embeddings=f.max_position_embeddings,
    )


def test_full_preset_matches_release_config_json():
    parsed = K3Config.from_dict(_release_json())
    full = k3_full()
    for field in ("layer_types", "hidden_size", "kda_num_heads", "num_experts", "attn_res_block_size",
                  "experts_mxfp4", "routed_expert_hidden_size", "gate_lower_bound"):
        assert getattr(parsed, field) == getattr(full, field), field


def test_full_model_abstract_shapes_and_parameter_count():
    m = nnx.eval_shape(lambda: KimiLM(k3_full(), jnp.bfloat16))
    total = 0
    for path, v in nnx.to_flat_state(nnx.split(m)[1]):
        a = v.get_value()
        n = int(np.prod(a.shape))
        total += 2 * n if path[-1].endswith("_packed") else (0 if path[-1].endswith("_scale") else n)
    # the checkpoint stores A_log padded to head_dim (128) where the model keeps 96 per head
    assert total == count_parameters(_release_json()) - 69 * (128 - 96) == 2_779_484_476_000
    assert m.layer_weight(91, "self_attn.q_b_proj.weight").shape == (18432, 1536)
    assert m.layer_weight(92, "self_attn.kv_b_proj.weight").shape == (24576, 512)
    assert m.layer_weight(1, "block_sparse_moe.experts.w1_packed").shape == (896, 3072, 1792)
    assert m.layer_weight(1, "block_sparse_moe.experts.w2_scale").shape == (896, 3584, 96)
    # 93 layers trace as 4 sublayer bodies: KDA (69 layers), MLA (24), the dense MLP (layer 0),
    # the MoE (92), parameters stacked per type
    plan = m.plan
    assert plan.traced_bodies == 4 and [len(plan.layers_of("attn", a)) for a in range(2)] == [69, 24]
    assert [len(plan.layers_of("ffn", f)) for f in range(2)] == [1, 92]
    assert [m.sublayer(l, "attn")[2] for l in (0, 1, 91)] == ["attn.0", "attn.0", "attn.1"]
    assert [m.sublayer(l, "ffn")[2] for l in (0, 1, 91)] == ["ffn.0", "ffn.1", "ffn.1"]
    assert m.attn[0].self_attn.q_proj.weight.get_value().shape == (69, 12288, 7168)
    assert m.ffn[1].block_sparse_moe.experts.w1_packed.get_value().shape == (92, 896, 3072, 1792)
    specs = tensor_specs(_release_json())
    assert specs["language_model.model.layers.1.block_sparse_moe.experts.895.w1.weight_packed"] == ("U8", (3072, 1792))


def test_full_cache_sizes():
    shapes = cache_shapes(k3_full(), num_slots=1, num_pages=1, page_size=256, dtype=jnp.bfloat16)
    (n_mla, _, ps, width), dt = shapes["mla_kv"]
    # 576-wide latent rows (512 + 64) stored in whole 128-lane vregs: 640 (K3Config.mla_pool_width)
    assert (n_mla, width) == (24, 640) and n_mla * width * jnp.dtype(dt).itemsize == 30_720  # bytes/token
    (n_kda, _, H, dk, dv), _ = shapes["kda_state"]
    assert (n_kda, H, dk, dv) == (69, 96, 128, 128)
    assert n_kda * H * dk * dv * 4 == 69 * 6 * 2**20  # 6 MiB per layer and request, fp32
