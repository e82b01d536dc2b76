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


def test_k3_plan_traces_nine_bodies():
    plan = plan_layers(k3_full())
    assert (plan.head, plan.start, plan.period, plan.groups, plan.tail) == ((0,), 1, 4, 22, (89, 90, 91, 92))
    assert plan.traced_bodies == 9
    seen = sorted([l for l in plan.head] + list(plan.scanned) + list(plan.tail))
    assert seen == list(range(93))
    assert plan.locate(0) == ("head", 0, None)
    assert plan.locate(1) == ("blocks", 0, 0) and plan.locate(88) == ("blocks", 3, 21)
    assert plan.locate(92) == ("tail", 3, None)
    with pytest.raises(IndexError):
        plan.locate(93)


@pytest.mark.parametrize("layers", [13, 25, 49, 93])
def test_deeper_stacks_trace_the_same_bodies(layers):
    # the demo's shape (MLA every 4th layer and last, dense layer 0) at any depth: the traced
    # graph does not grow with depth
    cfg = k3_small(num_hidden_layers=layers)
    plan = plan_layers(cfg)
    assert plan.period == 4 and plan.traced_bodies == 9 and plan.groups == (layers - 5) // 4
    for g in range(plan.groups):  # every scanned group has the same layer kinds
        kinds = [cfg.layer_types[plan.layer_of(i, g)] for i in range(plan.period)]
        assert kinds == [cfg.layer_types[plan.layer_of(i, 0)] for i in range(plan.period)]
        assert all(cfg.is_moe_layer(plan.layer_of(i, g)) for i in range(plan.period))


def test_no_repeat_means_no_scan():
    cfg = k3_small(num_hidden_layers=2)
    plan = plan_layers(cfg)
    assert plan.groups == 0 and plan.head == (0, 1) and plan.traced_bodies == 2


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
