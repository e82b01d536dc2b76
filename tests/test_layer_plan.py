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
from k3serve.model.layer_plan import plan_layers
from k3serve.model.layers import AttnResWeights, attn_res_bank, gated_act, rms_normalize


def test_k3_plan_traces_three_bodies():
    cfg = k3_full()
    plan = plan_layers(cfg)
    # three kinds: KDA + dense MLP (layer 0), KDA + MoE, MLA + MoE
    assert plan.kinds == (("kda", False), ("kda", True), ("mla", True))
    assert plan.traced_bodies == 3
    assert [len(plan.layers_of(k)) for k in range(3)] == [1, 68, 24]
    assert plan.locate(0) == (0, 0) and plan.locate(1) == (1, 0) and plan.locate(3) == (2, 0)
    assert plan.locate(91) == (2, 22) and plan.locate(92) == (2, 23)
    # every layer sits at exactly one (kind, row), rows in layer order within a kind
    seen = sorted(l for k in range(3) for l in plan.layers_of(k))
    assert seen == list(range(93))
    for k in range(3):
        assert [plan.locate(l) for l in plan.layers_of(k)] == [(k, r) for r in range(len(plan.layers_of(k)))]
    for l in range(93):
        k, _ = plan.locate(l)
        assert plan.kinds[k] == (cfg.layer_types[l], bool(cfg.is_moe_layer(l)))
    with pytest.raises(IndexError):
        plan.locate(93)


@pytest.mark.parametrize("layers", [13, 25, 49, 93])
def test_deeper_stacks_trace_the_same_bodies(layers):
    # the demo's shape (MLA every 4th layer and last, dense layer 0) at any depth: the traced
    # graph does not grow with depth
    cfg = k3_small(num_hidden_layers=layers)
    plan = plan_layers(cfg)
    assert plan.traced_bodies == 3
    assert sum(len(plan.layers_of(k)) for k in range(3)) == layers


def test_two_layers_two_kinds():
    cfg = k3_small(num_hidden_layers=2)
    plan = plan_layers(cfg)
    assert plan.kinds == (("kda", False), ("mla", True)) and plan.traced_bodies == 2
    assert plan.locate(1) == (1, 0)


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
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


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
