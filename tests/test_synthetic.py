"""Synthetic K3 checkpoints: release config layout, exact release tensor layout (checked
against the golden tiny checkpoints), determinism, sharding, A_log padding, MXFP4 validity,
the demo config and its cache."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from k3serve.checkpoints import synthetic
from k3serve.checkpoints.safetensors_io import open_checkpoint
from k3serve.checkpoints.synthetic import (
    count_parameters,
    demo_checkpoint_name,
    demo_config,
    generate_checkpoint,
    k3_config,
    tensor_specs,
)
from k3serve.demo import demo_checkpoint
from k3serve.kernels.mxfp4 import unpack_mxfp4_np

ROOT = Path(__file__).resolve().parents[1]

DATA = Path(__file__).parent / "data"

TINY = dict(
    vocab_size=512, hidden_size=64, kda_num_heads=4, kda_head_dim=16, mla_heads=4,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    num_experts=16, num_experts_per_token=4, num_shared_experts=2, moe_intermediate_size=32,
    routed_expert_hidden_size=96, intermediate_size=96,
)
TINY_A = dict(TINY, num_hidden_layers=10, full_attn_layers=[4, 8, 10], attn_res_block_size=3)
TINY_B = dict(TINY, num_hidden_layers=7, full_attn_layers=[4, 7], attn_res_block_size=2, routed_scaling_factor=2.5)


def _files_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def tiny_a(tmp_path_factory):
    out = tmp_path_factory.mktemp("syn") / "a"
    return generate_checkpoint(out, k3_config(**TINY_A), seed=0)


@pytest.mark.parametrize("case,kwargs", [("k3-tiny-a", TINY_A), ("k3-tiny-b", TINY_B)])
def test_config_matches_golden_exactly(case, kwargs):
    golden = json.loads((DATA / case / "config.json").read_text())
    cfg = k3_config(**kwargs)
    for key, val in golden["text_config"].items():
        assert cfg["text_config"][key] == val, key
    assert cfg == golden
    # same key order too, so a written config.json is laid out like the release's
    assert json.dumps(cfg) == json.dumps(golden)


def test_config_validation():
    with pytest.raises(ValueError, match="head_dim"):
        k3_config(**dict(TINY_A, kda_head_dim=2))
    with pytest.raises(ValueError, match="multiple of 32"):
        k3_config(**dict(TINY_A, routed_expert_hidden_size=80))
    with pytest.raises(ValueError, match="full_attn_layers"):
        k3_config(**dict(TINY_A, full_attn_layers=[0, 11]))


@pytest.mark.parametrize("case,kwargs", [("k3-tiny-a", TINY_A), ("k3-tiny-b", TINY_B)])
def test_tensor_specs_match_golden_header(case, kwargs):
    with open_checkpoint(DATA / case) as ck:
        golden = {k: (ck.dtype(k), ck.shape(k)) for k in ck.keys()}
    assert tensor_specs(k3_config(**kwargs)) == golden


def test_generated_checkpoint_has_golden_layout(tiny_a):
    with open_checkpoint(DATA / "k3-tiny-a") as g, open_checkpoint(tiny_a) as ck:
        assert ck.keys() == g.keys()
        for k in ck.keys():
            assert (ck.dtype(k), ck.shape(k)) == (g.dtype(k), g.shape(k)), k
        assert ck.config == g.config
        total = 0
        for k in ck.keys():
            a = ck.get(k)
            if k.endswith("weight_scale"):
                continue
            total += a.size * (2 if k.endswith("weight_packed") else 1)
            if a.dtype != np.uint8:
                assert np.all(np.isfinite(a.astype(np.float32))), k
        assert total == count_parameters(ck.config) == count_parameters(ck.config["text_config"])


def test_a_log_padding_and_kda_value_ranges(tiny_a):
    with open_checkpoint(tiny_a) as ck:
        names = [k for k in ck.keys() if k.endswith("self_attn.A_log")]
        assert len(names) == 7  # the KDA layers
        for k in names:
            a = ck.get(k)
            assert a.dtype == np.float32 and a.shape == (16,)
            assert np.all(a[:4] > 0) and np.all(a[:4] <= np.log(16)) and np.all(a[4:] == 0), k
        norm = ck.get("language_model.model.layers.0.self_attn.o_norm.weight")
        assert norm.dtype == np.float32 and abs(float(norm.mean()) - 1) < 0.2


def test_mxfp4_experts_decode_to_finite_values(tiny_a):
    with open_checkpoint(tiny_a) as ck:
        stems = sorted({k[: -len(".weight_packed")] for k in ck.keys() if k.endswith(".weight_packed")})
        assert len(stems) == 9 * 16 * 3
        for stem in stems[:: 7]:
            scale = ck.get(stem + ".weight_scale")
            w = unpack_mxfp4_np(ck.get(stem + ".weight_packed"), scale)
            assert np.all(np.isfinite(w)) and np.all(scale < 255) and np.any(w != 0), stem


def test_deterministic_and_seed_dependent(tiny_a, tmp_path):
    same = generate_checkpoint(tmp_path / "same", k3_config(**TINY_A), seed=0)
    assert _files_digest(same) == _files_digest(tiny_a)
    other = generate_checkpoint(tmp_path / "other", k3_config(**TINY_A), seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_a / "model.safetensors").read_bytes()


def test_values_are_seeded_per_name(tiny_a):
    # A model with different depth shares tensor names with tiny-a; their values must agree,
    # i.e. a tensor's values do not depend on which other tensors are generated.
    cfg_b = k3_config(**TINY_B)
    got = dict(synthetic.iter_tensors(cfg_b, seed=0))
    with open_checkpoint(tiny_a) as ck:
        for name in ["language_model.model.embed_tokens.weight",
                     "language_model.model.layers.3.self_attn.kv_b_proj.weight",
                     "language_model.model.layers.5.block_sparse_moe.experts.7.w2.weight_packed",
                     "language_model.model.layers.2.self_attn.A_log"]:
            assert got[name].tobytes() == ck.get(name).tobytes(), name


def test_sharded_output_readable(tiny_a, tmp_path):
    out = generate_checkpoint(tmp_path / "sh", k3_config(**TINY_A), seed=0, max_shard_bytes=100_000)
    assert (out / "model.safetensors.index.json").exists()
    with open_checkpoint(out) as sh, open_checkpoint(tiny_a) as one:
        assert len(sh.files) > 2 and sh.keys() == one.keys()
        for k in sh.keys()[::13]:
            assert sh.get(k).tobytes() == one.get(k).tobytes(), k


def test_demo_config_shape_and_size():
    cfg = demo_config()
    t = cfg["text_config"]
    L = t["num_hidden_layers"]
    full = t["linear_attn_config"]["full_attn_layers"]
    assert full == list(range(4, L, 4)) + [L] and full[-2:] == [L - 1, L]  # last two layers MLA
    assert t["num_experts"] == 64 and t["num_experts_per_token"] == 8 and t["num_shared_experts"] == 2
    assert t["routed_expert_hidden_size"] % 32 == 0 and t["moe_intermediate_size"] % 32 == 0
    assert cfg["eos_token_id"] == t["vocab_size"] - 254
    n = count_parameters(cfg)
    print(f"demo config: {n:,} logical parameters")
    assert 20_000_000 <= n <= 45_000_000


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return cache, demo_checkpoint(cache)


def test_demo_checkpoint_cache(demo_cache, monkeypatch):
    cache, path = demo_cache
    assert path.parent == cache and path.name == demo_checkpoint_name()
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temp leftovers
    assert oct(path.stat().st_mode & 0o777) != oct(0o700)  # not mkdtemp's private mode

    def must_not_run(*a, **k):
        raise AssertionError("demo checkpoint regenerated instead of reused")

    monkeypatch.setattr(synthetic, "generate_checkpoint", must_not_run)
    monkeypatch.setenv("K3SERVE_CACHE", str(cache))
    assert demo_checkpoint() == path == demo_checkpoint(cache)
    with open_checkpoint(path) as ck:
        assert ck.config == demo_config()
        assert {k: (ck.dtype(k), ck.shape(k)) for k in ck.keys()} == tensor_specs(demo_config())
    assert demo_checkpoint_name(seed=1) != path.name


def test_demo_checkpoint_lost_race(tmp_path, monkeypatch):
    # Another process renames its copy into place while we generate: we keep theirs.
    final = tmp_path / demo_checkpoint_name()

    def winner_appears(out, config, seed):
        Path(out, "config.json").write_text("{}")
        final.mkdir()
        (final / "config.json").write_text('{"winner": true}')

    monkeypatch.setattr(synthetic, "generate_checkpoint", winner_appears)
    assert demo_checkpoint(tmp_path) == final
    assert json.loads((final / "config.json").read_text()) == {"winner": True}
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def test_cli_prints_path_and_count(demo_cache, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_demo_checkpoint", ROOT / "tools" / "make_demo_checkpoint.py")
    make_demo_checkpoint = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_demo_checkpoint)

    cache, path = demo_cache
    assert make_demo_checkpoint.main(["--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == str(path) and f"{count_parameters(demo_config()):,}" in out[1]
