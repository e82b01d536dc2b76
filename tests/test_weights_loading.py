"""Checkpoint loading: error reporting (unknown / missing / mis-shaped / duplicate tensors),
ignored vision tensors, sharded checkpoints, dequantize-at-load, A_log narrowing, the expected
name list, synthetic checkpoints, and argument validation of ``load_pretrained``/``logits``.

Every broken checkpoint is a copy of ``tests/data/k3-tiny-a`` streamed through
``write_checkpoint`` into ``tmp_path`` with one tensor dropped, added or replaced. Model
compiles are the expensive part (seconds each), so logits are computed only for the sharded,
the dequantized and the single-file model (the latter once per module), plus one greedy run.
"""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from _util import DATA, golden, load_case, rel_err
from k3serve.checkpoints.safetensors_io import INDEX_FILE, SINGLE_FILE, open_checkpoint, write_checkpoint
from k3serve.checkpoints.synthetic import generate_checkpoint, k3_config
from k3serve.kernels.mxfp4 import unpack_mxfp4_np
from k3serve.checkpoints import load_pretrained
from k3serve.model.config import K3Config
from k3serve.model.weights import CheckpointError, expected_tensor_names

K3A = DATA / "k3-tiny-a"
KL = DATA / "kimi-linear-tiny"
KLD = DATA / "kimi-linear-tiny-dense"  # written by transformers 5 save_pretrained
P = "language_model.model."


def copy_checkpoint(dst, *, src=K3A, drop=(), replace=None, extra=(), max_shard_bytes=None):
    """Stream ``src`` into ``dst``: ``drop`` names, ``replace`` {name: array or fn(old)}, append ``extra``."""
    replace = replace or {}
    with open_checkpoint(src) as ck:
        for n in (*drop, *replace):
            assert n in ck, n  # the test must touch a tensor that really exists

        def stream():
            for n in ck.keys():
                if n in drop:
                    continue
                a = ck.get(n)
                if n in replace:
                    r = replace[n]
                    a = r(a) if callable(r) else r
                yield n, a
            yield from extra

        write_checkpoint(dst, ck.config, stream(), max_shard_bytes=max_shard_bytes)
    return dst


def load_error(path, **kw) -> str:
    with pytest.raises(CheckpointError) as ei:
        load_pretrained(path, **kw)
    return str(ei.value)


def module_of(m):
    return nnx.merge(m.graphdef, m.params)


def param_leaves(m):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(m.params)]


@pytest.fixture(scope="module")
def ids():
    return [int(t) for t in golden("k3-tiny-a")["input_ids_1"]]


@pytest.fixture(scope="module")
def single(ids):
    """The single-file k3-tiny-a model and its logits on ``ids`` (one compile per module)."""
    m = load_case("k3-tiny-a")
    logits = m.logits(ids)
    assert rel_err(logits, golden("k3-tiny-a")["prefill_logits_1"]) < 1e-4
    return m, logits


# ------------------------------------------------------------------ 1-3: errors that name the tensor
def test_unknown_tensor_is_an_error(tmp_path):
    bogus = P + "layers.0.self_attn.bogus.weight"
    path = copy_checkpoint(tmp_path, extra=[(bogus, np.zeros((4, 4), np.float32))])
    msg = load_error(path)
    assert "unexpected tensor" in msg and bogus in msg


@pytest.mark.parametrize("name", [
    P + "layers.2.block_sparse_moe.experts.16.w1.weight_packed",  # expert past num_experts (16)
    P + "layers.3.self_attn.A_log",  # layer 3 is MLA, not KDA
])
def test_out_of_structure_tensor_is_an_error(tmp_path, name):
    path = copy_checkpoint(tmp_path, extra=[(name, np.zeros((2,), np.float32))])
    msg = load_error(path)
    assert "unexpected tensor" in msg and name in msg


@pytest.mark.parametrize("name", [
    P + "layers.3.self_attn.kv_b_proj.weight",
    P + "layers.2.block_sparse_moe.experts.5.w3.weight_scale",
])
@pytest.mark.parametrize("dequantize", [False, True])
def test_missing_tensor_is_an_error(tmp_path, name, dequantize):
    path = copy_checkpoint(tmp_path, drop=[name])
    msg = load_error(path, dequantize_experts=dequantize)
    assert "missing" in msg and name in msg


@pytest.mark.parametrize("name,bad,dequantize", [
    (P + "layers.1.self_attn.q_proj.weight", lambda a: np.zeros((a.shape[0], a.shape[1] + 1), a.dtype), False),
    (P + "layers.1.self_attn.A_log", lambda a: np.zeros((40,), a.dtype), False),  # neither H nor head_dim
    (P + "layers.2.block_sparse_moe.experts.3.w1.weight_packed", lambda a: a[:, :-1], False),
    (P + "layers.2.block_sparse_moe.experts.3.w1.weight_packed", lambda a: a[:, :-1], True),
    (P + "layers.2.block_sparse_moe.experts.3.w2.weight_scale", lambda a: a[:-1], True),
])
def test_misshaped_tensor_is_an_error(tmp_path, name, bad, dequantize):
    with open_checkpoint(K3A) as ck:
        orig = ck.shape(name)
        new = bad(ck.get(name)).shape
    path = copy_checkpoint(tmp_path, replace={name: bad})
    msg = load_error(path, dequantize_experts=dequantize)
    assert name in msg, msg
    assert str(list(new)) in msg, msg  # the shape found ...
    if "A_log" not in name:
        assert str(list(orig)) in msg, msg  # ... and the shape wanted
    else:
        assert "[4]" in msg and str(list(orig)) in msg, msg  # [H] or the padded [head_dim]


def test_duplicate_tensor_under_two_spellings_is_an_error(tmp_path):
    with open_checkpoint(K3A) as ck:
        lm = ck.get("language_model.lm_head.weight")
    path = copy_checkpoint(tmp_path, extra=[("lm_head.weight", lm)])
    msg = load_error(path)
    assert "duplicate" in msg and "lm_head.weight" in msg


# ------------------------------------------------------------------ 3b: dense-MLP spellings
DENSE = [f"model.layers.0.{{}}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]


def renamed_checkpoint(dst, src, rename):
    with open_checkpoint(src) as ck:
        write_checkpoint(dst, ck.config, ((rename.get(n, n), ck.get(n)) for n in ck.keys()))
    return dst


def test_dense_mlp_loads_under_both_spellings(tmp_path):
    """transformers >= 5 saves a dense layer's MLP as block_sparse_moe.*_proj (the test case),
    the original release as mlp.*_proj: both load, to the same parameters."""
    with open_checkpoint(KLD) as ck:
        names = set(ck.keys())
        assert {n.format("block_sparse_moe") for n in DENSE} <= names
        assert not any(".mlp." in n for n in names)
    saved = load_pretrained(KLD)
    assert not saved.config.is_moe_layer(0)
    orig = load_pretrained(renamed_checkpoint(
        tmp_path / "orig", KLD, {n.format("block_sparse_moe"): n.format("mlp") for n in DENSE}))
    got, want = param_leaves(orig), param_leaves(saved)
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    with open_checkpoint(KLD) as ck:
        w = ck.get(DENSE[2].format("block_sparse_moe")).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(module_of(saved).layer_weight(0, "mlp.down_proj.weight")), w)


def test_dense_mlp_under_both_spellings_at_once_is_an_error(tmp_path):
    with open_checkpoint(KLD) as ck:
        w = ck.get(DENSE[0].format("block_sparse_moe"))
    path = copy_checkpoint(tmp_path, src=KLD, extra=[(DENSE[0].format("mlp"), w)])
    msg = load_error(path)
    assert "duplicate" in msg and DENSE[0].format("mlp") in msg


def test_moe_layer_has_no_dense_mlp_spelling(tmp_path):
    """Only a dense layer's block_sparse_moe.*_proj is its MLP; on a MoE layer it is unknown."""
    bogus = "model.layers.1.block_sparse_moe.gate_proj.weight"
    path = copy_checkpoint(tmp_path, src=KLD, extra=[(bogus, np.zeros((64, 32), np.float32))])
    msg = load_error(path)
    assert "unexpected tensor" in msg and bogus in msg


# ------------------------------------------------------------------ 4: vision tensors are skipped
def test_vision_tensors_are_ignored(tmp_path):
    extra = [("vision_tower.x.weight", np.ones((3, 5), np.float32)),
             ("mm_projector.y.weight", np.ones((2,), np.float32)),
             ("language_model.vision_tower.z.weight", np.ones((2,), np.float32))]
    m = load_pretrained(copy_checkpoint(tmp_path, extra=extra))
    with open_checkpoint(K3A) as ck:
        lm = ck.get("language_model.lm_head.weight").astype(np.float32)
    np.testing.assert_array_equal(np.asarray(module_of(m).lm_head.weight[...]), lm)


# ------------------------------------------------------------------ 5: sharded checkpoints
def test_sharded_checkpoint_matches_single_file(tmp_path, single, ids):
    path = copy_checkpoint(tmp_path, max_shard_bytes=256 * 1024)
    assert (path / INDEX_FILE).is_file() and not (path / SINGLE_FILE).exists()
    shards = sorted(p.name for p in path.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 4
    assert sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values())) == shards

    m = load_pretrained(path)
    ref_m, ref_logits = single
    got, want = param_leaves(m), param_leaves(ref_m)
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    logits = m.logits(ids)
    assert logits.shape == ref_logits.shape
    assert rel_err(logits, ref_logits) <= 1e-6


# ------------------------------------------------------------------ 6: dequantize at load
def test_dequantize_experts_gives_dense_experts(single, ids):
    m = load_pretrained(K3A, dequantize_experts=True)
    assert m.config.experts_mxfp4 is False
    ref_m, ref_logits = single
    assert ref_m.config.experts_mxfp4 is True
    dense = module_of(m).sublayer(2, "ffn")[0].block_sparse_moe.experts
    packed = module_of(ref_m).sublayer(2, "ffn")[0].block_sparse_moe.experts
    cfg = m.config
    for w in ("w1", "w2", "w3"):
        assert hasattr(dense, w) and not hasattr(dense, w + "_packed") and not hasattr(dense, w + "_scale")
        assert hasattr(packed, w + "_packed") and not hasattr(packed, w)
        got = np.asarray(module_of(m).layer_weight(2, f"block_sparse_moe.experts.{w}"))
        n, k = ((cfg.moe_intermediate_size, cfg.expert_input_size) if w != "w2"
                else (cfg.expert_input_size, cfg.moe_intermediate_size))
        assert got.shape == (cfg.num_experts, n, k) and got.dtype == np.float32
        want = unpack_mxfp4_np(np.asarray(module_of(ref_m).layer_weight(2, f"block_sparse_moe.experts.{w}_packed")),
                               np.asarray(module_of(ref_m).layer_weight(2, f"block_sparse_moe.experts.{w}_scale")))
        np.testing.assert_array_equal(got, want)
    assert rel_err(m.logits(ids), ref_logits) < 1e-5


# ------------------------------------------------------------------ 7: A_log narrowing
def test_a_log_is_narrowed_to_heads(single):
    with open_checkpoint(KL) as ck:
        raw = {n: ck.get(n) for n in ck.keys() if n.endswith("self_attn.A_log")}
    m = load_pretrained(KL)
    H = m.config.kda_num_heads
    mod = module_of(m)
    assert len(raw) == len(m.config.kda_layers) > 0
    for i in m.config.kda_layers:
        a = raw[f"model.layers.{i}.self_attn.A_log"]
        assert a.shape == (1, 1, H, 1)
        got = np.asarray(mod.layer_weight(i, "self_attn.A_log"))
        assert got.shape == (H,)
        np.testing.assert_array_equal(got, a.reshape(H))

    ref_m, _ = single
    H = ref_m.config.kda_num_heads
    mod = module_of(ref_m)
    with open_checkpoint(K3A) as ck:
        for i in ref_m.config.kda_layers:
            a = ck.get(f"{P}layers.{i}.self_attn.A_log")
            assert a.shape == (ref_m.config.kda_head_dim,) and H == 4 < a.shape[0]
            got = np.asarray(mod.layer_weight(i, "self_attn.A_log"))
            assert got.shape == (H,)
            np.testing.assert_array_equal(got, a[:H])


# ------------------------------------------------------------------ 8: expected names
@pytest.mark.parametrize("case,prefix", [("k3-tiny-a", "language_model."), ("k3-tiny-b", "language_model."),
                                         ("kimi-linear-tiny", "")])
def test_expected_tensor_names_match_checkpoint(case, prefix):
    with open_checkpoint(DATA / case) as ck:
        cfg = K3Config.from_dict(ck.config)
        names = ck.keys()
    assert all(n.startswith(prefix) for n in names)
    expected = expected_tensor_names(cfg)
    assert len(expected) == len(set(expected))
    assert set(expected) == {n[len(prefix):] for n in names}


# ------------------------------------------------------------------ 9: synthetic checkpoints
def test_synthetic_checkpoint_loads_and_generates(tmp_path):
    conf = k3_config(
        vocab_size=256, hidden_size=64, num_hidden_layers=5, full_attn_layers=[4, 5],
        kda_num_heads=2, kda_head_dim=16, mla_heads=2, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=4,
        num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
        routed_expert_hidden_size=32, intermediate_size=64, attn_res_block_size=2,
    )
    path = generate_checkpoint(tmp_path / "synth", conf, seed=3)
    with open_checkpoint(path) as ck:
        cfg = K3Config.from_dict(ck.config)
        assert {"language_model." + n for n in expected_tensor_names(cfg)} == set(ck.keys())
    assert cfg.layer_types == ("kda", "kda", "kda", "mla", "mla") and cfg.experts_mxfp4
    m = load_pretrained(path)
    out = m.greedy([1, 2, 3], 4)
    assert len(out) == 4 and all(isinstance(t, int) and 0 <= t < 256 for t in out)


# ------------------------------------------------------------------ 10: argument validation
def test_bad_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="float16"):
        load_pretrained(K3A, dtype="float16")


def test_out_of_range_token_id_is_a_value_error(single):
    m, _ = single
    V = m.config.vocab_size
    for bad in (V, V + 7, -1):
        with pytest.raises(ValueError, match=rf"token id {bad}\b"):
            m.logits([1, 2, bad, 3])
    with pytest.raises(ValueError, match=rf"token id {V}\b"):
        m.greedy([1, V], 2)


def test_tied_embeddings_and_moe_layer_frequency(tmp_path):
    """A config with tie_word_embeddings and no lm_head tensor reuses the embedding; with
    moe_layer_freq 2, odd layers get the dense MLP (Kimi's ``i % freq == 0`` rule)."""
    import json

    from k3serve.checkpoints.synthetic import generate_checkpoint, k3_config
    from k3serve.checkpoints import load_pretrained
    from k3serve.checkpoints.safetensors_io import open_checkpoint, write_checkpoint

    cfg = k3_config(vocab_size=256, hidden_size=64, num_hidden_layers=4, full_attn_layers=[4],
                    kda_num_heads=2, kda_head_dim=16, mla_heads=2, q_lora_rank=32, kv_lora_rank=32,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=8,
                    num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
                    routed_expert_hidden_size=32, intermediate_size=64, attn_res_block_size=2)
    src = generate_checkpoint(tmp_path / "src", cfg, seed=1)
    cfg = json.loads((src / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    cfg["text_config"]["tie_word_embeddings"] = True
    cfg["text_config"]["moe_layer_freq"] = 2
    with open_checkpoint(src) as ck:
        keep = []
        for n in ck.keys():
            if n.endswith("lm_head.weight"):
                continue
            if ".layers.1.block_sparse_moe." in n or ".layers.3.block_sparse_moe." in n:
                continue
            keep.append((n, ck.get(n)))
        emb = ck.get("language_model.model.embed_tokens.weight")
    import ml_dtypes
    import numpy as np
    rng = np.random.default_rng(0)
    for l in (1, 3):  # dense MLPs where the frequency rule says so
        for p, shape in (("gate_proj", (64, 64)), ("up_proj", (64, 64)), ("down_proj", (64, 64))):
            keep.append((f"language_model.model.layers.{l}.mlp.{p}.weight",
                         (rng.normal(size=shape) / 8).astype(ml_dtypes.bfloat16)))
    dst = write_checkpoint(tmp_path / "dst", cfg, keep)
    m = load_pretrained(dst)
    assert m.config.tie_word_embeddings
    assert [m.config.is_moe_layer(i) for i in range(4)] == [False, False, True, False]
    mod = __import__("flax").nnx.merge(m.graphdef, m.params)
    np.testing.assert_array_equal(np.asarray(mod.lm_head.weight.get_value()), np.asarray(emb, np.float32))
    assert len(m.greedy([1, 2, 3], 2)) == 2
