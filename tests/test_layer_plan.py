"""The scan over layers: which layers are scanned (``model.layer_plan``), routed experts read
from layer stacks by index, and Block AttnRes over a fixed bank with a count."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3serve.kernels.moe import STRATEGIES, expert_ffn
from k3serve.kernels.mxfp4 import quantize_mxfp4_np
from k3serve.model.config import k3_full, k3_small
from k3serve.model.layer_plan import part_of, plan_layers
from k3serve.model.layers import AttnResWeights, attn_res_bank, gated_act, rms_normalize


def test_k3_plan_traces_four_bodies():
    cfg = k3_full()
    plan = plan_layers(cfg)
    # two attention types (KDA, MLA) and two FFN types (dense MLP at layer 0, MoE): the MoE is
    # one traced body whatever attention precedes it
    assert plan.attn_types == ("kda", "mla") and plan.ffn_types == (False, True)
    assert plan.traced_bodies == 4
    assert [len(plan.layers_of("attn", a)) for a in range(2)] == [69, 24]
    assert [len(plan.layers_of("ffn", f)) for f in range(2)] == [1, 92]
    assert plan.locate(0, "attn") == (0, 0) and plan.locate(0, "ffn") == (0, 0)
    assert plan.locate(1, "attn") == (0, 1) and plan.locate(1, "ffn") == (1, 0)
    assert plan.locate(3, "attn") == (1, 0) and plan.locate(3, "ffn") == (1, 2)
    assert plan.locate(91, "attn") == (1, 22) and plan.locate(92, "attn") == (1, 23)
    assert plan.locate(92, "ffn") == (1, 91)
    # every layer's part sits at exactly one (type, row), rows in layer order within a type
    for part, types in (("attn", plan.attn_types), ("ffn", plan.ffn_types)):
        seen = sorted(l for t in range(len(types)) for l in plan.layers_of(part, t))
        assert seen == list(range(93))
        for t in range(len(types)):
            layers = plan.layers_of(part, t)
            assert [plan.locate(l, part) for l in layers] == [(t, r) for r in range(len(layers))]
    for l in range(93):
        assert plan.attn_types[plan.locate(l, "attn")[0]] == cfg.layer_types[l]
        assert plan.ffn_types[plan.locate(l, "ffn")[0]] == bool(cfg.is_moe_layer(l))
    with pytest.raises(IndexError):
        plan.locate(93, "attn")
    with pytest.raises(ValueError):
        plan.locate(0, "mlp")


def test_part_of_names_the_sublayer():
    for name in ("self_attn.A_log", "input_layernorm.weight", "self_attention_res.proj",
                 "self_attention_res_norm.weight"):
        assert part_of(name) == "attn"
    for name in ("post_attention_layernorm.weight", "mlp.up_proj.weight", "mlp_res_proj.weight",
                 "block_sparse_moe.experts.3.w1.weight_packed"):
        assert part_of(name) == "ffn"
    with pytest.raises(KeyError):
        part_of("self_attnx.A_log")


@pytest.mark.parametrize("layers", [13, 25, 49, 93])
def test_deeper_stacks_trace_the_same_bodies(layers):
    # the demo's shape (MLA every 4th layer and last, dense layer 0) at any depth: the traced
    # graph does not grow with depth
    cfg = k3_small(num_hidden_layers=layers)
    plan = plan_layers(cfg)
    assert plan.traced_bodies == 4
    assert sum(len(plan.layers_of("attn", a)) for a in range(2)) == layers
    assert sum(len(plan.layers_of("ffn", f)) for f in range(2)) == layers


def test_two_layers():
    cfg = k3_small(num_hidden_layers=2)
    plan = plan_layers(cfg)
    assert plan.attn_types == ("kda", "mla") and plan.ffn_types == (False, True) and plan.traced_bodies == 4
    assert plan.locate(1, "attn") == (1, 0) and plan.locate(1, "ffn") == (1, 0)


def test_model_stacks_per_type():
    # the module holds one stack per type; sublayer() and layer_weight() find any layer's part
    from flax import nnx

    from k3serve.model.k3 import KimiLM

    cfg = k3_small(num_hidden_layers=5)
    m = nnx.eval_shape(lambda: KimiLM(cfg))
    assert len(m.attn) == 2 and len(m.ffn) == 2
    assert [blk.kind for blk in m.attn] == ["kda", "mla"] and [blk.is_moe for blk in m.ffn] == [False, True]
    n_kda = sum(t == "kda" for t in cfg.layer_types)
    assert m.attn[0].self_attn.A_log.get_value().shape == (n_kda, cfg.kda_num_heads)
    assert m.ffn[1].block_sparse_moe.gate.weight.get_value().shape[0] == 4  # layers 1..4 are MoE
    mod, row, path = m.sublayer(3, "attn")
    assert mod is m.attn[1] and row == 0 and path == "attn.1"
    mod, row, path = m.sublayer(3, "ffn")
    assert mod is m.ffn[1] and row == 2 and path == "ffn.1"
    assert m.layer_weight(0, "mlp.up_proj.weight").shape == (cfg.intermediate_size, cfg.hidden_size)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mx", [False, True])
def test_experts_read_from_layer_stacks(strategy, mx):
    rng = np.random.default_rng(0)
    L, E, I, K, N, k = 3, 8, 64, 64, 5, 2
    dense = [rng.normal(size=(L, E, I, K)).astype(np.float32) for _ in range(2)] + \
            [rng.normal(size=(L, E, K, I)).astype(np.float32)]
    if mx:
        ws = [quantize_mxfp4_np(w.reshape(-1, w.shape[-1])) for w in dense]
        ws = [tuple(jnp.asarray(a.reshape(L, E, a.shape[0] // (L * E), a.shape[1])) for a in pair) for pair in ws]
    else:
        ws = [jnp.asarray(w) for w in dense]
    x = jnp.asarray(rng.normal(size=(N, K)).astype(np.float32))
    idx = jnp.asarray(rng.integers(0, E, size=(N, k)), jnp.int32)
    w = jnp.asarray(rng.random(size=(N, k)).astype(np.float32))
    act = gated_act(k3_small())
    for layer in (0, 2):
        one = [tuple(a[layer] for a in p) if mx else p[layer] for p in ws]
        want = expert_ffn(x, idx, w, one[0], one[2], one[1], act, E, strategy=strategy)
        got = jax.jit(lambda l: expert_ffn(x, idx, w, ws[0], ws[2], ws[1], act, E, strategy=strategy, layer=l))(layer)
        # outputs up to ~2e2 are sums of terms of that size: fp32 leaves ~1e-5 absolute on the
        # small ones, and the two programs' code (FMA contraction, summation order) may differ
        want = np.asarray(want)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_attn_res_bank_masks_unwritten_entries():
    rng = np.random.default_rng(1)
    D, T = 16, 3
    w = AttnResWeights(D, jnp.float32)
    w.proj.set_value(jnp.asarray(rng.normal(size=(1, D)).astype(np.float32)))
    w.norm.set_value(jnp.asarray(rng.normal(size=(D,)).astype(np.float32)))
    bank = jnp.asarray(rng.normal(size=(4, T, D)).astype(np.float32))
    p = jnp.asarray(rng.normal(size=(T, D)).astype(np.float32))
    q = w.norm[...] * w.proj[...][0]
    for count in range(5):
        srcs = jnp.concatenate([bank[:count], p[None]])
        alpha = jax.nn.softmax(jnp.einsum("ntd,d->nt", rms_normalize(srcs, 1e-6), q), axis=0)
        want = jnp.einsum("nt,ntd->td", alpha, srcs)
        got = attn_res_bank(bank.at[count:].set(1e6), count, p, w, 1e-6)  # junk past count is ignored
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # an empty bank gives the partial sum exactly
    assert np.array_equal(np.asarray(attn_res_bank(bank, 0, p, w, 1e-6)), np.asarray(p))
