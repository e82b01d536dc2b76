"""The DSpark draft model (``model/dspark.py``) on a tiny synthetic checkpoint
(``checkpoints/dspark_checkpoint.py``), against a float64 numpy transcription of the math
written here independently of the module: target taps -> context_proj -> context_norm ->
per-layer latent context KV (RMSNorm'd latent, YaRN RoPE'd k_pe); block = anchor + mask
tokens embedded with the target's embedding; MLA in its expanded form (per-head keys and
values decompressed through kv_b_proj, which the module never builds); SiLU MLP; final norm;
the target's lm_head; the greedy Markov chain. Also: loader errors, incremental context KV,
seeded sampling, batching of requests with different context lengths."""
from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3serve.checkpoints.dspark_checkpoint import (
    generate_dspark_checkpoint,
    load_dspark,
    tensor_shapes,
    tiny_dspark_config,
)
from k3serve.checkpoints.safetensors_io import open_checkpoint, write_checkpoint
from k3serve.model.config import k3_small
from k3serve.model.dspark import SampleKeys
from k3serve.model.dspark_config import DSparkConfig
from k3serve.model.weights import CheckpointError

RAW = tiny_dspark_config()


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return generate_dspark_checkpoint(tmp_path_factory.mktemp("dspark"), RAW, seed=3)


@pytest.fixture(scope="module")
def draft(ckpt_dir):
    return load_dspark(ckpt_dir)


@pytest.fixture(scope="module")
def weights(ckpt_dir):
    with open_checkpoint(ckpt_dir) as ck:
        return {n: np.asarray(a).astype(np.float64) for n, a in ck.items()}


@pytest.fixture(scope="module")
def target():
    """The target's embedding and lm_head (shared with the draft, not in its checkpoint)."""
    rng = np.random.default_rng(11)
    V, D = RAW["vocab_size"], RAW["hidden_size"]
    emb = rng.standard_normal((V, D)).astype(np.float32)
    head = (rng.standard_normal((V, D)) * 3 / math.sqrt(D)).astype(np.float32)
    return emb, head


def _taps(rng, T):
    return rng.standard_normal((T, RAW["num_target_layers"] * RAW["target_hidden_size"])).astype(np.float32)


# ------------------------------------------------------------------------------ the reference
def _rms(x, w, eps=RAW["rms_norm_eps"]):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _yarn_mscale(factor, m):
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _inv_freq():
    """DeepSeek YaRN: frequency j is base^(-2j/R), divided by `factor` below the ramp (long
    wavelengths), kept above it; the ramp runs between the dims where a wavelength fits
    beta_fast resp. beta_slow times into the original context."""
    R, base, y = RAW["qk_rope_head_dim"], RAW["rope_theta"], RAW["rope_scaling"]
    j = np.arange(R // 2, dtype=np.float64)
    freq = base ** (-2 * j / R)

    def dim_for(rot):
        return R * math.log(y["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(math.floor(dim_for(y["beta_fast"])), 0), min(math.ceil(dim_for(y["beta_slow"])), R - 1)
    ramp = np.clip((j - lo) / (hi - lo), 0, 1)  # 0: keep the frequency, 1: interpolate it
    return freq * (1 - ramp) + freq / y["factor"] * ramp


def _rope(x, pos):
    """x [T, ..., R] at positions [T]; pairs (2j, 2j+1) rotated by pos * inv_freq[j]."""
    y = RAW["rope_scaling"]
    m = _yarn_mscale(y["factor"], y["mscale"]) / _yarn_mscale(y["factor"], y["mscale_all_dim"])
    ang = np.asarray(pos, np.float64)[:, None] * _inv_freq()
    ang = ang.reshape((len(pos),) + (1,) * (x.ndim - 2) + (-1,))
    c, s = np.cos(ang) * m, np.sin(ang) * m
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    out[..., 1::2] = x[..., 1::2] * c + x[..., 0::2] * s
    return out


def _lin(W, name, x):
    return x @ W[name + ".weight"].T


def ref_context(W, taps, pos):
    """Per layer: (normed latent c [T, Lr], rope'd shared key [T, R]) of the context tokens."""
    h = _rms(_lin(W, "context_proj", taps), W["context_norm.weight"])
    Lr, out = RAW["kv_lora_rank"], []
    for i in range(RAW["num_hidden_layers"]):
        a = f"layers.{i}.self_attn."
        ckv = _lin(W, a + "kv_a_proj_with_mqa", h)
        out.append((_rms(ckv[:, :Lr], W[a + "kv_a_layernorm.weight"]), _rope(ckv[:, Lr:], pos)))
    return out


def ref_block_logits(W, ctx, anchor, anchor_pos, emb, head):
    """Base logits [S, V] of one request whose context is `ctx` (from ref_context)."""
    S, H = RAW["block_size"], RAW["num_attention_heads"]
    nope, R, dv, Lr = RAW["qk_nope_head_dim"], RAW["qk_rope_head_dim"], RAW["v_head_dim"], RAW["kv_lora_rank"]
    y = RAW["rope_scaling"]
    scale = (nope + R) ** -0.5 * _yarn_mscale(y["factor"], y["mscale_all_dim"]) ** 2
    pos = anchor_pos + np.arange(S)
    x = emb[[anchor] + [RAW["mask_token_id"]] * (S - 1)].astype(np.float64)
    for i, (c_ctx, r_ctx) in enumerate(ctx):
        a, p = f"layers.{i}.self_attn.", f"layers.{i}."
        h = _rms(x, W[p + "input_layernorm.weight"])
        q = _lin(W, a + "q_b_proj", _rms(_lin(W, a + "q_a_proj", h), W[a + "q_a_layernorm.weight"]))
        q = q.reshape(S, H, nope + R)
        q = np.concatenate([q[..., :nope], _rope(q[..., nope:], pos)], axis=-1)
        ckv = _lin(W, a + "kv_a_proj_with_mqa", h)
        c_all = np.concatenate([c_ctx, _rms(ckv[:, :Lr], W[a + "kv_a_layernorm.weight"])])
        r_all = np.concatenate([r_ctx, _rope(ckv[:, Lr:], pos)])
        kv = _lin(W, a + "kv_b_proj", c_all).reshape(len(c_all), H, nope + dv)  # expanded keys/values
        k = np.concatenate([kv[..., :nope], np.broadcast_to(r_all[:, None], (len(c_all), H, R))], axis=-1)
        sc = np.einsum("shd,thd->hst", q, k) * scale  # every query sees every row: non-causal
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("hst,thd->shd", pr, kv[..., nope:]).reshape(S, H * dv)
        x = x + _lin(W, a + "o_proj", o)
        h = _rms(x, W[p + "post_attention_layernorm.weight"])
        g, u = _lin(W, p + "mlp.gate_proj", h), _lin(W, p + "mlp.up_proj", h)
        x = x + _lin(W, p + "mlp.down_proj", g / (1 + np.exp(-g)) * u)
    return _rms(x, W["final_norm.weight"]) @ head.astype(np.float64).T


def ref_greedy_chain(W, base, anchor):
    w1, w2 = W["markov_head.markov_w1.weight"], W["markov_head.markov_w2.weight"]
    prev, toks = anchor, []
    for i in range(len(base)):
        prev = int(np.argmax(base[i] + w2 @ w1[prev]))
        toks.append(prev)
    return toks


def _close(got, want, rel=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err <= rel, f"max abs error {err:.2e} of the largest magnitude (allowed {rel:.0e})"


# ------------------------------------------------------------------------------ (a) forward
@pytest.mark.parametrize("start", [0, 37])
def test_forward_matches_float64_reference(draft, weights, target, start):
    """Context KV rows and base logits equal the reference to ~1e-5 relative; the greedy
    Markov chain picks the same tokens. ``start`` offsets every position (RoPE at work)."""
    rng = np.random.default_rng(start)
    T, anchor = 11, 123
    taps, pos = _taps(rng, T), start + np.arange(T)
    emb, head = target
    kv = draft.context_kv(jnp.asarray(taps)[None], jnp.asarray(pos)[None])
    ref = ref_context(weights, taps.astype(np.float64), pos)
    Lr = RAW["kv_lora_rank"]
    for layer, (c, r) in enumerate(ref):
        _close(kv[0, layer, :, :Lr], c)
        _close(kv[0, layer, :, Lr:], r)
    logits = draft.propose(jnp.array([anchor]), jnp.array([start + T]), kv, jnp.array([T]), jnp.asarray(emb),
                           jnp.asarray(head))
    want = ref_block_logits(weights, ref, anchor, start + T, emb, head)
    assert logits.shape == (1, RAW["block_size"], RAW["vocab_size"]) and logits.dtype == jnp.float32
    _close(logits[0], want)
    toks, corrected = draft.sample_block(logits, jnp.array([anchor]))
    assert toks[0].tolist() == ref_greedy_chain(weights, want, anchor)
    # the Markov bias matters on this checkpoint: the chain differs from the plain argmax
    assert toks[0].tolist() != np.argmax(want, axis=-1).tolist()


def test_attention_is_non_causal_and_sees_context(draft, target):
    """Changing the last block position's input (the anchor is position 0) changes the first
    position's logits only if the block is non-causal; changing context changes them too."""
    rng = np.random.default_rng(5)
    emb, head = target
    taps = jnp.asarray(_taps(rng, 6))[None]
    kv = draft.context_kv(taps, jnp.arange(6)[None])
    args = (jnp.array([7]), jnp.array([6]), kv, jnp.array([6]))
    base = draft.propose(*args, jnp.asarray(emb), jnp.asarray(head))
    emb2 = emb.copy()
    emb2[RAW["mask_token_id"]] += 1.0  # every mask position (1..S-1) changes, the anchor does not
    moved = draft.propose(*args, jnp.asarray(emb2), jnp.asarray(head))
    assert np.max(np.abs(np.asarray(moved[0, 0] - base[0, 0]))) > 1e-3
    fewer = draft.propose(args[0], args[1], kv, jnp.array([5]), jnp.asarray(emb), jnp.asarray(head))
    assert np.max(np.abs(np.asarray(fewer[0, 0] - base[0, 0]))) > 1e-3


# ------------------------------------------------------------------------------ (b) loading
def _rewrite(src, dst, config=None, drop=(), replace=None, rename=None):
    with open_checkpoint(src) as ck:
        cfg = dict(ck.config if config is None else config)
        tensors = {n: np.asarray(a) for n, a in ck.items() if n not in drop}
    for old, new in (rename or {}).items():
        tensors[new] = tensors.pop(old)
    tensors.update(replace or {})
    return write_checkpoint(dst, cfg, tensors)


def test_loader_skips_target_copies_and_confidence_head(draft):
    assert set(draft.skipped_tensors) == {"embed_tokens.weight", "confidence_head.proj.weight",
                                          "confidence_head.proj.bias"}
    assert draft.cfg.enable_confidence_head  # set in the config, loaded around, unused


def test_loader_rejects_missing_tensor(ckpt_dir, tmp_path):
    bad = _rewrite(ckpt_dir, tmp_path / "c", drop={"layers.1.self_attn.kv_b_proj.weight"})
    with pytest.raises(CheckpointError, match=r"missing tensors: layers\.1\.self_attn\.kv_b_proj\.weight"):
        load_dspark(bad)


def test_loader_rejects_wrong_shape(ckpt_dir, tmp_path):
    bad = _rewrite(ckpt_dir, tmp_path / "c", replace={"context_proj.weight": np.zeros((64, 128), np.float32)})
    with pytest.raises(CheckpointError, match=r"'context_proj\.weight' has shape \[64, 128\], expected \[64, 192\]"):
        load_dspark(bad)


def test_loader_rejects_unexpected_and_duplicate(ckpt_dir, tmp_path):
    gate = {"layers.0.self_attn.g_proj.weight": np.zeros((64, 64), np.float32)}
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers\.0\.self_attn\.g_proj\.weight'"):
        load_dspark(_rewrite(ckpt_dir, tmp_path / "a", replace=gate))
    twice = {"norm.weight": np.ones(64, np.float32)}
    with pytest.raises(CheckpointError, match=r"duplicate tensor .*final_norm\.weight"):
        load_dspark(_rewrite(ckpt_dir, tmp_path / "b", replace=twice))


def test_loader_rejects_reduced_draft_vocab(ckpt_dir, tmp_path):
    bad = _rewrite(ckpt_dir, tmp_path / "c", config=dict(RAW, draft_vocab_size=256))
    with pytest.raises(ValueError, match=r"draft_vocab_size=256 differs from vocab_size=512.*d2t"):
        load_dspark(bad)


def test_loader_accepts_prefixed_and_alias_names(ckpt_dir, tmp_path, draft):
    with open_checkpoint(ckpt_dir) as ck:
        names = ck.keys()
    rename = {n: "model." + n for n in names if n.startswith("layers.")}
    rename.update({"final_norm.weight": "norm.weight", "markov_head.markov_w1.weight": "markov_w1.weight"})
    other = load_dspark(_rewrite(ckpt_dir, tmp_path / "c", rename=rename))
    a, b = nnx.state(draft, nnx.Param), nnx.state(other, nnx.Param)
    assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), a, b))


def test_config_validation_and_target_check():
    cfg = DSparkConfig.from_dict(RAW)
    assert DSparkConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert set(tensor_shapes(cfg)) >= {"context_proj.weight", "final_norm.weight", "markov_head.markov_w2.weight"}
    target = k3_small(hidden_size=64, vocab_size=512, num_hidden_layers=8)
    assert cfg.check_against(target) is cfg
    with pytest.raises(ValueError, match="target_hidden_size=64 does not match the target's hidden_size=96"):
        cfg.check_against(k3_small(hidden_size=96, vocab_size=512, num_hidden_layers=8))
    with pytest.raises(ValueError, match=r"target_layer_ids \[1, 3, 6\] reach past the target's 4 layers"):
        cfg.check_against(k3_small(hidden_size=64, vocab_size=512, num_hidden_layers=4))
    with pytest.raises(ValueError, match="vocab_size=512 does not match the target's vocab_size=1024"):
        cfg.check_against(k3_small(hidden_size=64, vocab_size=1024, num_hidden_layers=8))
    no_mask = {k: v for k, v in RAW.items() if k != "mask_token_id"}
    with pytest.raises(ValueError, match="lacks required key 'mask_token_id'"):
        DSparkConfig.from_dict(no_mask)
    with pytest.raises(ValueError, match="num_target_layers=4"):
        DSparkConfig.from_dict(dict(RAW, num_target_layers=4))
    with pytest.raises(ValueError, match="output gate"):
        DSparkConfig.from_dict(dict(RAW, mla_use_output_gate=True))
    with pytest.raises(ValueError, match="rope type 'linear'"):
        DSparkConfig.from_dict(dict(RAW, rope_scaling={"rope_type": "linear", "factor": 2.0}))


# ------------------------------------------------------------------------------ (c) incremental context
def test_context_kv_in_chunks_equals_at_once(draft):
    rng = np.random.default_rng(9)
    taps, pos = jnp.asarray(_taps(rng, 10))[None], jnp.arange(20, 30)[None]
    whole = draft.context_kv(taps, pos)
    parts = jnp.concatenate([draft.context_kv(taps[:, :6], pos[:, :6]), draft.context_kv(taps[:, 6:], pos[:, 6:])],
                            axis=2)
    _close(parts, whole, rel=1e-6)


# ------------------------------------------------------------------------------ (d) sampling
def test_greedy_is_argmax_of_base_plus_markov(draft, weights):
    rng = np.random.default_rng(2)
    base = rng.standard_normal((3, RAW["block_size"], RAW["vocab_size"])).astype(np.float32) * 3
    anchors = np.array([5, 77, 400])
    toks, logits = draft.sample_block(jnp.asarray(base), jnp.asarray(anchors))
    w1, w2 = weights["markov_head.markov_w1.weight"], weights["markov_head.markov_w2.weight"]
    for b in range(3):
        assert toks[b].tolist() == ref_greedy_chain(weights, base[b].astype(np.float64), anchors[b])
        prev = [anchors[b]] + toks[b, :-1].tolist()
        _close(logits[b], base[b] + np.stack([w2 @ w1[p] for p in prev]))


def test_seeded_sampling_uses_plain_decodings_keys(draft, weights):
    """Block position i of a row draws with ``fold_in(key(seed), step + i)`` — the engine
    sampler's key for that token — so the draw is a function of (seed, step, logits) only."""
    from k3serve.server.engine.sampler import _row_keys

    rng = np.random.default_rng(4)
    S, V = RAW["block_size"], RAW["vocab_size"]
    base = jnp.asarray(rng.standard_normal((2, S, V)).astype(np.float32))
    anchors = jnp.array([10, 20])
    keys = SampleKeys(seed=jnp.array([1234, 99]), step=jnp.array([7, 0]), temperature=jnp.array([0.8, 1.3]))
    toks, logits = draft.sample_block(base, anchors, keys)
    again, _ = draft.sample_block(base, anchors, keys)
    assert toks.tolist() == again.tolist()
    for b in range(2):  # the test's own draw
        for i in range(S):
            k = _row_keys(keys.seed[b:b + 1], keys.step[b:b + 1] + i)[0]
            g = jax.random.gumbel(k, (V,), jnp.float32)
            assert int(toks[b, i]) == int(jnp.argmax(logits[b, i] / keys.temperature[b] + g))
    alone, _ = draft.sample_block(base[:1], anchors[:1], SampleKeys(*(a[:1] for a in keys)))
    assert alone[0].tolist() == toks[0].tolist()  # independent of the rest of the batch
    other, _ = draft.sample_block(base, anchors, keys._replace(seed=jnp.array([1234, 100])))
    assert other[0].tolist() == toks[0].tolist()
    greedy_row = keys._replace(temperature=jnp.array([0.0, 1.3]))
    mixed, _ = draft.sample_block(base, anchors, greedy_row)
    assert mixed[0].tolist() == draft.sample_block(base, anchors)[0][0].tolist()
    assert mixed[1].tolist() == toks[1].tolist()


# ------------------------------------------------------------------------------ (e) batching
def test_batched_requests_equal_each_alone(draft, target):
    """Two requests with 11 and 6 context tokens, padded to 11 (the padding holds garbage), in
    one jitted call equal each request alone with its exact context."""
    rng = np.random.default_rng(8)
    emb, head = jnp.asarray(target[0]), jnp.asarray(target[1])
    lens, anchors = [11, 6], [300, 42]
    kvs = [draft.context_kv(jnp.asarray(_taps(rng, n))[None], jnp.arange(n)[None]) for n in lens]
    pad = jnp.asarray(rng.standard_normal(kvs[0].shape[:2] + (5, kvs[0].shape[3])) * 50, jnp.float32)
    batch_kv = jnp.concatenate([kvs[0], jnp.concatenate([kvs[1], pad], axis=2)])

    @nnx.jit
    def run(m, a, p, kv, n):
        base = m.propose(a, p, kv, n, emb, head)
        return base, m.sample_block(base, a)[0]

    base, toks = run(draft, jnp.array(anchors), jnp.array(lens), batch_kv, jnp.array(lens))
    for b in range(2):
        one, one_toks = run(draft, jnp.array(anchors[b:b + 1]), jnp.array(lens[b:b + 1]), kvs[b],
                            jnp.array(lens[b:b + 1]))
        _close(base[b], one[0])
        assert toks[b].tolist() == one_toks[0].tolist()
