"""DSpark as the engine's drafter (``server/spec/dspark_drafting.py``), on k3-tiny-a with a
synthetic draft checkpoint (no trained weights exist here, so acceptance is near zero and
proves nothing; what is checked is that the wiring is exact):

* the step's taps are the traced model's streams (both ``prefix`` and ``attn_res``, 2e-4);
* the paged proposal (context rows in the pool, the target's paged MLA attention, an LSE
  merge with the block) equals the dense ``DSparkDraft.propose``;
* every block the engine proposes equals an independent recomputation from the request's
  sequence (a one-pass trace of the target, the dense draft, greedy Markov head), with
  chunked prefill, batching and a prefix-cache hit between them;
* greedy and seeded outputs equal plain decoding; the pool's pages pay for the draft's layers;
  a P/D pair ships the context rows with the pages; what is not supported is refused before
  anything is built.
"""
from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from _util import load_case
from k3serve.checkpoints.dspark_checkpoint import generate_dspark_checkpoint, load_dspark, tiny_dspark_config
from k3serve.server.engine.engine import Engine
from k3serve.server.engine.sampling_params import SamplingParams
from k3serve.server.spec.dspark_drafting import DSparkEngineDrafter

K = 3
TAPS = [1, 4, 9]
SHAPE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=160, page_size=16, bucket_growth=16,
             num_pages=11, prefix_unit=16, warmup=False)


def _draft_config(stream="prefix"):
    """The tests' draft for k3-tiny-a: taps at layers 1, 4, 9, rows that fit its MLA pool."""
    return tiny_dspark_config(target_layer_ids=TAPS, target_num_hidden_layers=10, kv_lora_rank=16,
                              qk_rope_head_dim=8, aux_hidden_stream=stream)


def _draft_dir(tmp_path_factory, stream="prefix"):
    return generate_dspark_checkpoint(tmp_path_factory.mktemp("dspark"), _draft_config(stream), seed=1)


@pytest.fixture(scope="module")
def target():
    return load_case("k3-tiny-a")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return _draft_dir(tmp_path_factory)


def _spec(draft_dir, k=K):
    return {"method": "dspark", "num_speculative_tokens": k, "draft_model": str(draft_dir)}


class RecordingDrafter(DSparkEngineDrafter):
    """Remembers each block with the sequence it was proposed after (test code)."""

    def __init__(self, k):
        super().__init__(k)
        self.blocks = []

    def offer(self, req, tokens):
        super().offer(req, tokens)
        self.blocks.append((list(req.prompt) + list(req.output), [int(t) for t in tokens]))


def _run(model, prompts, params, spec=None, drafter=None, later=(), **kw):
    """Run ``prompts`` together, then ``later`` (after the first ones finished)."""
    e = Engine(model, speculative=spec, drafter=drafter, **{**SHAPE, **kw})
    out, cached = {}, {}
    e.cached_of = cached  # rid -> prompt tokens served from the prefix cache

    def drain(ids):
        steps = 0
        while e.has_unfinished():
            steps += 1
            assert steps < 300
            for o in e.step():
                if o.finished:
                    out[o.rid] = o.token_ids
                    cached[o.rid] = o.cached_tokens
        return [out[i] for i in ids]

    got = drain([e.add_request(p, params) for p in prompts])
    got += drain([e.add_request(p, params) for p in later])
    e.check_invariants()
    assert e.cache_mgr.num_free_slots == e.capacity_plan.max_concurrent_slots
    return got, e


def _prompts(V):
    rng = np.random.default_rng(0)
    return [rng.integers(0, V - 20, n).tolist() for n in (9, 40, 23)]


def _streams(target, ids):
    """The traced target's streams at every token of ``ids``: ``{"prefix": [T, n*D], "attn_res": ...}``."""
    _, _, rec = target.trace(ids)
    L = target.config.num_hidden_layers
    prefix = [np.asarray(rec["layers"][l]["prefix_sum"])[0] for l in TAPS]
    attn = [np.asarray(rec["layers"][l + 1]["attn_in"] if l + 1 < L else rec["attnres_out"])[0] for l in TAPS]
    T = len(ids)  # the trace pads to a bucket
    return {"prefix": np.concatenate(prefix, -1)[:T], "attn_res": np.concatenate(attn, -1)[:T]}


@pytest.mark.parametrize("stream", ["prefix", "attn_res"])
def test_step_taps_are_the_traced_streams(target, stream):
    import jax.numpy as jnp

    from k3serve.model.cache import make_batch
    from k3serve.model.step import flatten_padded, unflatten

    ids = list(range(3, 40, 2))
    T = len(ids)
    batch = make_batch(np.asarray([ids]), [0], [T], [0], np.arange(4)[None])
    cache = target.new_cache(2, 4)
    fb, index = flatten_padded(batch, cache.num_slots)
    module = nnx.merge(target.graphdef, target.params)
    _, _, taps = module.step(fb, cache, all_logits=True, taps=(tuple(TAPS), stream))
    got = np.asarray(unflatten(taps, index))[0]
    want = _streams(target, ids)[stream]
    assert got.shape == (T, len(TAPS) * target.config.hidden_size)
    # the scan and the traced (unrolled) layers fuse differently: float noise grows to ~1e-4 by layer 9
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    assert not np.allclose(want, _streams(target, ids)["prefix" if stream == "attn_res" else "attn_res"])
    assert jnp.asarray(taps).dtype == jnp.float32


def test_paged_proposal_equals_dense(draft_dir):
    import jax.numpy as jnp

    draft = load_dspark(draft_dir)
    cfg = draft.cfg
    rng = np.random.default_rng(0)
    V, D = cfg.vocab_size, cfg.hidden_size
    embed = jnp.asarray(rng.standard_normal((V, D)), jnp.float32)
    lm_head = jnp.asarray(rng.standard_normal((V, D)) * 0.1, jnp.float32)
    lens = [5, 0, 19]  # a row with no context at all
    R, ps, P, W = 3, 4, 6, 32  # pool rows wider than the draft's (24): zeros after them
    pool = jnp.zeros((1 + cfg.num_hidden_layers, 1 + R * P, ps, W), jnp.float32)
    table = jnp.asarray(1 + np.arange(R * P).reshape(R, P), jnp.int32)
    taps = [jnp.asarray(rng.standard_normal((n, cfg.context_in_features)), jnp.float32) for n in lens]
    flat = jnp.concatenate(taps)
    pos = jnp.concatenate([jnp.arange(n, dtype=jnp.int32) for n in lens])
    rows = jnp.concatenate([jnp.full(n, r, jnp.int32) for r, n in enumerate(lens)])
    pool = draft.write_context(flat, pos, rows, table, pool, 1)
    assert not np.asarray(pool[0]).any()  # the target's layer is untouched
    anchor, at = jnp.asarray([7, 9, 11]), jnp.asarray(lens)
    paged = draft.propose_paged(anchor, at, at, table, pool, 1, embed, lm_head)
    C = max(lens)
    ctx = jnp.stack([jnp.pad(draft.context_kv(t[None], jnp.arange(t.shape[0])[None])[0], ((0, 0), (0, C - len(t)), (0, 0)))
                     for t in taps])
    dense = draft.propose(anchor, at, ctx, at, embed, lm_head)
    np.testing.assert_allclose(np.asarray(paged), np.asarray(dense), rtol=1e-5, atol=1e-5)


def test_blocks_equal_an_independent_recomputation(target, draft_dir):
    """Each block the engine proposed = the dense draft on a one-pass trace of the sequence it
    was proposed after; plain decoding's tokens; a prefix-cache hit in the second wave."""
    V = target.config.vocab_size
    prompts = _prompts(V)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    later = [prompts[1][:32] + [5, 6, 7]]  # shares two 16-token units with a finished request
    plain, _ = _run(target, prompts, params, later=later)
    rec = RecordingDrafter(K)
    got, e = _run(target, prompts, params, spec=_spec(draft_dir), drafter=rec, later=later)
    assert got == plain
    assert list(e.cached_of.values())[-1] >= 16  # the second wave resumed from the first one's pages
    st = e.stats()
    assert st["spec_steps"] == e.runner.num_steps  # every step wrote the draft's context
    assert st["spec_draft_tokens"] > 0
    assert len(rec.blocks) >= 16
    _check_blocks(target, draft_dir, rec.blocks)


def test_async_rows_take_the_device_block(target, draft_dir):
    """Async scheduling (the default): every decode row is planned while the request's previous
    row runs, so its drafts are the block that row's step proposed on the device, after the
    tokens it really emitted (no guess). The same blocks are verified as when each row is planned
    after its predecessor returned (synchronous, the block handed over by the host): the same
    drafts accepted (this target and draft agree twice on these prompts), and plain decoding's
    tokens. The async run may carry fewer drafts near ``max_new_tokens`` (it counts the in-flight
    drafts as accepted when it sizes a row)."""
    V = target.config.vocab_size
    prompts = _prompts(V)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    plain, _ = _run(target, prompts, params)
    runs = {a: _run(target, prompts, params, spec=_spec(draft_dir), async_scheduling=a) for a in (True, False)}
    st = {a: e.stats() for a, (_, e) in runs.items()}
    for a, (got, e) in runs.items():
        assert got == plain, a
    assert st[True]["spec_accepted_tokens"] == st[False]["spec_accepted_tokens"] > 0, st
    assert st[True]["spec_accept_counts"][1:] == st[False]["spec_accept_counts"][1:]
    assert 0 < st[True]["spec_draft_tokens"] <= st[False]["spec_draft_tokens"]
    assert st[True]["spec_guess_rows"] == 0  # device drafts are never a guess


def _check_blocks(target, draft_dir, blocks):
    """Each ``(sequence, block)`` = the dense draft on a one-pass trace of the sequence."""
    import jax
    import jax.numpy as jnp

    draft = load_dspark(draft_dir)
    module = nnx.merge(target.graphdef, target.params)
    embed, lm_head = module.embed_tokens[...], module.lm_head.weight[...]
    C = 64  # the context padded to one length: one compile of the reference

    @jax.jit
    def reference(taps, anchor, n):
        ctx = draft.context_kv(taps, jnp.arange(C)[None])
        base = draft.propose(anchor, n, ctx, n, embed, lm_head)
        return draft.sample_block(base, anchor)[0]

    traced = {}  # the target is causal: one trace of a request's longest sequence serves its every prefix
    for seq, block in blocks:
        n = len(seq)
        assert n - 1 <= C
        full = tuple(max((s for s, _ in blocks if s[:n] == seq), key=len))
        if full not in traced:
            traced[full] = _streams(target, list(full))["prefix"]
        taps = np.zeros((1, C, len(TAPS) * target.config.hidden_size), np.float32)
        taps[0, :n - 1] = traced[full][:n - 1]
        want = np.asarray(reference(jnp.asarray(taps), jnp.asarray([seq[-1]]), jnp.asarray([n - 1])))[0].tolist()
        assert block == want, (n, block, want)


def test_pd_pair_ships_the_draft_context(target, draft_dir):
    """A DSpark prefill engine hands over to a DSpark decode engine: the draft's context rows
    travel in the pages (the decode's blocks equal the recomputation from the sequence alone),
    the tokens equal plain decoding; a plain side and a DSpark side are told apart."""
    from _util import run_to_end
    from k3serve.server.engine.warm_programs import warm_small_programs
    from k3serve.server.pd.layout import cache_layout, incompatibility

    V = target.config.vocab_size
    prompts = _prompts(V)[:2]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    plain, _ = _run(target, prompts, params)
    kw = dict(SHAPE, num_pages=24)
    pre = Engine(target, pd_role="prefill", speculative=_spec(draft_dir), **kw)
    rec = RecordingDrafter(K)
    dec = Engine(target, pd_role="decode", speculative=_spec(draft_dir), drafter=rec, **kw)
    for e in (pre, dec):
        warm_small_programs(e, e.pd_role)
    rids = [pre.admit(pre.validate(p, params), params, rid=f"p{i}", export=True) for i, p in enumerate(prompts)]
    outs = run_to_end(pre, rids)
    drids = [dec.admit_prefilled(dec.validate(p, params), params, o.handoff, rid=f"d{i}")
             for i, (p, o) in enumerate(zip(prompts, outs))]
    got = run_to_end(dec, drids)
    assert [o.token_ids for o in got] == plain
    assert len(rec.blocks) >= 6
    _check_blocks(target, draft_dir, rec.blocks)
    for e in (pre, dec):
        e.check_invariants()
        assert e.cache_mgr.num_free_slots == e.capacity_plan.max_concurrent_slots
    assert incompatibility(cache_layout(pre), cache_layout(dec)) is None
    why = incompatibility(cache_layout(Engine(target, pd_role="decode", **kw)), cache_layout(pre))
    assert why is not None and "dspark" in why


def test_seeded_sampling_equals_plain(target, draft_dir):
    V = target.config.vocab_size
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=20, seed=11, repetition_penalty=1.1)
    prompts = _prompts(V)[:2]
    plain, _ = _run(target, prompts, params)
    got, e = _run(target, prompts, params, spec=_spec(draft_dir))
    assert got == plain
    assert e.drafter.offered > 0


def test_pages_pay_for_the_draft_layers(target, draft_dir):
    plain = Engine(target, **SHAPE)
    spec = Engine(target, speculative=_spec(draft_dir), **SHAPE)
    nM = len(target.config.mla_layers)
    assert spec.cache_mgr.device_cache.mla_kv.shape[0] == nM + 2  # the draft's 2 layers
    assert spec.capacity_plan.bytes_per_page * nM == plain.capacity_plan.bytes_per_page * (nM + 2)
    assert target.config.draft_kv_layers == 0  # the caller's model is unchanged


def test_refused_before_anything_is_built(target, draft_dir, tmp_path):
    with pytest.raises(ValueError, match="block_size"):
        Engine(target, speculative=_spec(draft_dir, k=5), **SHAPE)
    with pytest.raises(ValueError, match="draft_model"):
        Engine(target, speculative={"method": "dspark", "num_speculative_tokens": 2}, **SHAPE)
    wrong = generate_dspark_checkpoint(tmp_path / "wide", tiny_dspark_config(
        target_layer_ids=TAPS, target_num_hidden_layers=10, kv_lora_rank=32, qk_rope_head_dim=8), seed=1)
    with pytest.raises(ValueError, match="MLA pool rows"):
        Engine(target, speculative=_spec(wrong), **SHAPE)
    bad_taps = generate_dspark_checkpoint(tmp_path / "taps", tiny_dspark_config(
        target_layer_ids=[1, 4, 12], target_num_hidden_layers=None, kv_lora_rank=16, qk_rope_head_dim=8), seed=1)
    with pytest.raises(ValueError, match="target_layer_ids"):
        Engine(target, speculative=_spec(bad_taps), **SHAPE)


def test_serve_flags():
    import argparse

    from k3serve.server.api.engine_args import add_spec_flags, spec_kwargs

    p = argparse.ArgumentParser()
    add_spec_flags(p)
    got = spec_kwargs(p.parse_args(["--speculative", "dspark", "--draft-model", "D", "--num-speculative-tokens", "3"]))
    assert got["speculative"] == {"method": "dspark", "num_speculative_tokens": 3, "max_rows": None,
                                  "draft_model": "D"}
    for argv in (["--speculative", "dspark"], ["--draft-model", "D"], ["--speculative", "ngram", "--draft-model", "D"]):
        with pytest.raises(SystemExit):
            spec_kwargs(p.parse_args(argv))
