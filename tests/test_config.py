"""K3Config: parsing of the test checkpoints' config.json files, the release schedule
(``k3_full`` / ``k3_small`` / ``release_layer_types``) and the errors of ``from_dict``."""
from __future__ import annotations

import copy
import json

import pytest

from _util import ALL_CASES, DATA, K3_CASES, golden
from k3serve.model.config import K3Config, k3_full, k3_small, release_layer_types


def raw(case: str) -> dict:
    return json.loads((DATA / case / "config.json").read_text())


def text_of(cfg: dict) -> dict:
    return cfg["text_config"] if cfg["model_type"] == "kimi_k3" else cfg


# ------------------------------------------------------------------ parsing the test configs
@pytest.mark.parametrize("case", ALL_CASES)
def test_layer_types_follow_the_1_based_lists(case):
    d = raw(case)
    lac = text_of(d)["linear_attn_config"]
    cfg = K3Config.from_json_file(DATA / case / "config.json")
    assert cfg == K3Config.from_dict(d)
    L = cfg.num_hidden_layers
    assert len(cfg.layer_types) == L == text_of(d)["num_hidden_layers"]
    assert set(cfg.layer_types) == {"kda", "mla"}
    assert cfg.mla_layers == tuple(i - 1 for i in sorted(lac["full_attn_layers"]))
    assert cfg.kda_layers == tuple(i - 1 for i in sorted(lac["kda_layers"]))
    assert sorted(cfg.mla_layers + cfg.kda_layers) == list(range(L))
    assert cfg.layer_types[-1] == "mla"  # all three end on a full-attention layer
    assert cfg.kda_num_heads == lac["num_heads"] and cfg.kda_head_dim == lac["head_dim"]
    assert cfg.mla_cache_width == cfg.kv_lora_rank + cfg.qk_rope_head_dim


@pytest.mark.parametrize("case", K3_CASES)
def test_k3_configs_match_golden_layer_indices(case):
    cfg = K3Config.from_json_file(DATA / case / "config.json")
    g = golden(case)
    assert list(cfg.mla_layers) == [int(i) for i in g["mla_layer_idx"]]
    assert list(cfg.kda_layers) == [int(i) for i in g["kda_layer_idx"]]
    # K3 features
    t = raw(case)["text_config"]
    assert cfg.family == "kimi_k3"
    assert cfg.attn_res_block_size == t["attn_res_block_size"] and cfg.uses_attn_res
    assert cfg.num_attn_res_blocks == -(-cfg.num_hidden_layers // cfg.attn_res_block_size)
    assert cfg.gate_lower_bound == -5.0 and cfg.full_rank_output_gate
    assert cfg.q_lora_rank == t["q_lora_rank"] and cfg.mla_output_gate
    assert cfg.experts_mxfp4 is True and cfg.hidden_act == "situ"
    assert cfg.latent_moe and cfg.expert_input_size == t["routed_expert_hidden_size"]
    assert cfg.bos_token_id == t["bos_token_id"] and cfg.eos_token_id == t["eos_token_id"]
    assert not cfg.is_moe_layer(0) and all(cfg.is_moe_layer(i) for i in range(1, cfg.num_hidden_layers))


def test_k3_tiny_mla_layers():
    a = K3Config.from_json_file(DATA / "k3-tiny-a" / "config.json")
    assert a.mla_layers == (3, 7, 9)
    b = K3Config.from_json_file(DATA / "k3-tiny-b" / "config.json")
    assert b.mla_layers == (3, 6)


def test_kimi_linear_config():
    cfg = K3Config.from_json_file(DATA / "kimi-linear-tiny" / "config.json")
    assert cfg.family == "kimi_linear"
    assert cfg.attn_res_block_size is None and not cfg.uses_attn_res and cfg.num_attn_res_blocks == 0
    assert cfg.gate_lower_bound is None
    assert cfg.q_lora_rank is None
    assert cfg.experts_mxfp4 is False
    assert cfg.hidden_act == "silu"
    assert cfg.full_rank_output_gate is False
    assert cfg.routed_expert_hidden_size is None and not cfg.latent_moe
    assert cfg.expert_input_size == cfg.hidden_size
    assert cfg.mla_layers == (3, 6)


# ------------------------------------------------------------------ the release schedule
def test_k3_full():
    cfg = k3_full()
    assert cfg.num_hidden_layers == len(cfg.layer_types) == 93
    mla = set(range(3, 92, 4)) | {92}
    assert 91 in mla and 92 in mla and 90 not in mla
    assert set(cfg.mla_layers) == mla and len(cfg.mla_layers) == 24
    assert len(cfg.kda_layers) == 69
    assert cfg.layer_types[-2:] == ("mla", "mla")
    assert cfg.num_attn_res_blocks == 8  # snapshots at 0, 12, ..., 84
    assert cfg.mla_cache_width == 576 and cfg.mla_pool_width == 640  # pool rows in whole 128-lane vregs
    assert cfg.experts_mxfp4 and cfg.expert_input_size == 3584 and cfg.kda_proj_size == 96 * 128
    assert cfg._validated() is cfg


def test_release_layer_types():
    assert release_layer_types(8) == ("kda",) * 3 + ("mla",) + ("kda",) * 3 + ("mla",)
    assert release_layer_types(5) == ("kda",) * 3 + ("mla", "mla")
    assert release_layer_types(3) == ("kda", "kda", "mla")
    assert release_layer_types(93) == k3_full().layer_types


def test_k3_small_gets_release_pattern():
    cfg = k3_small(num_hidden_layers=13)
    assert cfg.num_hidden_layers == 13
    assert cfg.layer_types == release_layer_types(13)
    assert cfg.mla_layers == (3, 7, 11, 12)
    assert k3_small().layer_types == release_layer_types(8)
    custom = ("kda", "mla", "kda")
    assert k3_small(num_hidden_layers=3, layer_types=custom).layer_types == custom


def test_k3_small_validates():
    with pytest.raises(ValueError, match="multiple of 32"):
        k3_small(routed_expert_hidden_size=80)
    with pytest.raises(ValueError, match="num_experts_per_token"):
        k3_small().replace(num_experts_per_token=17)
    assert k3_small(routed_expert_hidden_size=80, experts_mxfp4=False).expert_input_size == 80


# ------------------------------------------------------------------ errors
def k3a_with(**lac_or_text) -> dict:
    d = copy.deepcopy(raw("k3-tiny-a"))
    t = d["text_config"]
    for k, v in lac_or_text.items():
        if k in t["linear_attn_config"]:
            t["linear_attn_config"][k] = v
        else:
            t[k] = v
    return d


def test_unknown_model_type():
    d = raw("k3-tiny-a")
    d["model_type"] = "llama"
    with pytest.raises(ValueError, match=r"unsupported model_type 'llama'"):
        K3Config.from_dict(d)
    with pytest.raises(ValueError, match="model_type None"):
        K3Config.from_dict({k: v for k, v in raw("kimi-linear-tiny").items() if k != "model_type"})


def test_k3_without_text_config():
    d = raw("k3-tiny-a")
    del d["text_config"]
    with pytest.raises(ValueError, match="text_config"):
        K3Config.from_dict(d)


def test_layer_in_both_lists():
    d = k3a_with(kda_layers=[1, 2, 3, 4, 5, 6, 7, 9])  # 4 is also in full_attn_layers
    with pytest.raises(ValueError, match=r"layer 4 \(1-based\) listed both as MLA and KDA"):
        K3Config.from_dict(d)


@pytest.mark.parametrize("full,kda,bad", [
    ([4, 8, 10, 11], [1, 2, 3, 5, 6, 7, 9], 11),  # one past the end
    ([4, 8, 11], [1, 2, 3, 5, 6, 7, 9], 11),  # 10 written as 11: the range error, not "layer 10 in neither"
    ([4, 8, 10], [0, 1, 2, 3, 5, 6, 7, 9], 0),  # a 0-based index in a 1-based list
])
def test_layer_index_out_of_range(full, kda, bad):
    d = k3a_with(full_attn_layers=full, kda_layers=kda)
    with pytest.raises(ValueError, match=rf"layer index {bad} out of range 1\.\.10"):
        K3Config.from_dict(d)


def test_layer_in_neither_list():
    d = k3a_with(kda_layers=[1, 2, 3, 5, 6, 7])  # 9 dropped
    with pytest.raises(ValueError, match=r"layer 9 \(1-based\) is in neither"):
        K3Config.from_dict(d)


def test_only_full_attn_layers_listed_means_the_rest_are_kda():
    d = k3a_with(kda_layers=[])
    assert K3Config.from_dict(d).layer_types == K3Config.from_dict(raw("k3-tiny-a")).layer_types


@pytest.mark.parametrize("key,value,what", [
    ("routed_expert_hidden_size", 80, "expert input"),
    ("moe_intermediate_size", 48, "moe_intermediate_size"),
])
def test_mxfp4_needs_multiples_of_32(key, value, what):
    with pytest.raises(ValueError, match=rf"MXFP4 experts need {what} to be a multiple of 32, got {value}"):
        K3Config.from_dict(k3a_with(**{key: value}))
    # without the MXFP4 quantization the same sizes are fine
    d = k3a_with(**{key: value})
    del d["text_config"]["quantization_config"]
    cfg = K3Config.from_dict(d)
    assert cfg.experts_mxfp4 is False and getattr(cfg, key) == value


def test_other_errors():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        K3Config.from_dict(k3a_with(num_hidden_layers=None))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        K3Config.from_dict(k3a_with(hidden_act="gelu"))
    with pytest.raises(ValueError, match="num_expert_group"):
        K3Config.from_dict(k3a_with(num_expert_group=2))
    with pytest.raises(ValueError, match="full_attn_layers and/or kda_layers"):
        K3Config.from_dict(k3a_with(full_attn_layers=[], kda_layers=[]))
    with pytest.raises(ValueError, match="num_experts_per_token exceeds num_experts"):
        K3Config.from_dict(k3a_with(num_experts_per_token=17))
