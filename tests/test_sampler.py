"""The batched sampler: greedy exactness, penalty arithmetic, filters, the sampled
distribution, seed/step determinism independent of batch company, suppression, logprobs,
and SamplingParams validation.

Random draws are keyed by fixed seeds, so every statistical check here is deterministic;
bounds are set loose enough (p ~ 1e-5 under the null) that a correct sampler with another
PRNG stream would pass too.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from k3serve.server.engine.sampler import (
    COUNT_MASK,
    PROMPT_BIT,
    SUPPRESS_BIT,
    SampleOutput,
    SamplerInputs,
    apply_penalties,
    build_sampler_inputs,
    record_tokens,
    sample,
    seed_to_u32,
    table_width,
    token_table_row,
)
from k3serve.server.engine.sampling_params import SamplingParams as SP


# Few distinct shapes, so the suite compiles few programs (~2 s each on CPU): statistical
# checks use [N, VS] = [4096, 8]; the rest use [B, V] = [8, 64].
N, VS = 4096, 8
B, V = 8, 64


def _run(logits, params, *, steps=None, prompts=None, outputs=None, suppress=None,
         seeds=None, num_logprobs=0, pad_rows_to=None) -> tuple[SampleOutput, SamplerInputs]:
    """Build inputs for ``params`` and sample; ``logits`` rows beyond ``len(params)`` are
    padding (zero rows are appended up to ``pad_rows_to``)."""
    n = len(params)
    logits = np.asarray(logits, np.float32)
    if pad_rows_to is not None and logits.shape[0] < pad_rows_to:
        logits = np.concatenate(
            [logits, np.zeros((pad_rows_to - logits.shape[0], logits.shape[1]), np.float32)])
    inp = build_sampler_inputs(
        params,
        seeds if seeds is not None else [p.seed if p.seed is not None else 0 for p in params],
        steps if steps is not None else [0] * n,
        prompts if prompts is not None else [[]] * n,
        outputs if outputs is not None else [[]] * n,
        suppress,
        pad_rows_to=pad_rows_to,
        vocab_size=logits.shape[1],
    )
    return sample(logits, inp, num_logprobs), inp


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _chi2(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


RNG = np.random.default_rng(0)


# ------------------------------------------------------------------------------ greedy


def test_greedy_is_argmax_alone_and_among_sampled_rows():
    logits = RNG.normal(size=(B, V)).astype(np.float32)
    out, _ = _run(logits, [SP(temperature=0.0)] * B)
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(1))
    # greedy rows stay exact when the batch also holds sampled rows (the sort path runs)
    params = [SP(temperature=0.0), SP(temperature=1.3, seed=5)] * (B // 2)
    out, _ = _run(logits, params)
    np.testing.assert_array_equal(np.asarray(out.tokens)[::2], logits.argmax(1)[::2])
    # a tiny temperature counts as greedy too
    out, _ = _run(logits, [SP(temperature=1e-7, seed=s) for s in range(B)])
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(1))


def test_top_k_1_and_tiny_top_p_equal_greedy():
    logits = (RNG.normal(size=(N, VS)) * 2).astype(np.float32)
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        params = [SP(temperature=1.5, seed=s, **kw) for s in range(N)]
        out, _ = _run(logits, params)
        np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(1), err_msg=str(kw))
    # sanity: without the filter these rows do not all come out greedy
    out, _ = _run(logits, [SP(temperature=1.5, seed=s) for s in range(N)])
    assert (np.asarray(out.tokens) != logits.argmax(1)).sum() > N // 4


# --------------------------------------------------------------------------- penalties


def _np_penalize(logits, params, prompts, outputs, suppress):
    out = logits.astype(np.float32).copy()
    for i, p in enumerate(params):
        V = out.shape[1]
        counts = np.bincount(np.asarray(outputs[i], np.int64), minlength=V).astype(np.float32)
        seen = counts > 0
        seen[np.asarray(prompts[i], np.int64)] = True
        row = out[i]
        rp = np.float32(p.repetition_penalty)
        pen = np.where(row > 0, row / rp, row * rp)
        row = np.where(seen, pen, row)
        row = row - (np.float32(p.frequency_penalty) * counts
                     + np.float32(p.presence_penalty) * (counts > 0).astype(np.float32))
        row[np.asarray(suppress[i], np.int64)] = -np.inf
        out[i] = row
    return out


def test_penalties_match_numpy():
    logits = RNG.normal(size=(5, V)).astype(np.float32) * 3
    logits[:, 0] = 0.0  # a zero logit stays zero under the repetition penalty
    params = [
        SP(temperature=0, repetition_penalty=1.3),
        SP(temperature=0, repetition_penalty=0.7, frequency_penalty=0.5),
        SP(temperature=0, presence_penalty=1.5, frequency_penalty=-0.4),
        SP(temperature=0, repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=-2.0),
        SP(temperature=0),  # no penalties: only suppression applies
    ]
    prompts = [[0, 1, 2, 2, 9], [3, 4], [5, 6, 7], [1, 63, 63], [1, 2, 3]]
    outputs = [[9, 9, 10], [4, 4, 4, 11], [6, 6, 12, 13, 13, 13], [], [4, 4]]
    suppress = [[], [14], [2, 3], [0], [7, 8]]
    out, inp = _run(logits, params, prompts=prompts, outputs=outputs, suppress=suppress,
                    pad_rows_to=B)
    got = np.asarray(apply_penalties(np.pad(logits, ((0, B - 5), (0, 0))), inp))[:5]
    want = _np_penalize(logits, params, prompts, outputs, suppress)
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-6, atol=1e-6)
    # something actually changed in every penalized row
    for i in range(4):
        assert not np.allclose(np.where(fin[i], got[i], 0), np.where(fin[i], logits[i], 0))
    np.testing.assert_array_equal(np.asarray(out.tokens)[:5], want.argmax(1))
    # the device sees no histories, only each row's token table (counts, prompt, suppress bits)
    table = np.asarray(inp.table)
    assert table.shape == (B, table_width(V))
    np.testing.assert_array_equal(table[1, :V] & COUNT_MASK, np.bincount(outputs[1], minlength=V))
    assert {int(i) for i in np.flatnonzero(table[2, :V] & PROMPT_BIT)} == {5, 6, 7}
    assert {int(i) for i in np.flatnonzero(table[4, :V] & SUPPRESS_BIT)} == {7, 8}


def test_counts_recorded_by_steps_equal_the_table_from_histories():
    """The engine's path: a request's row is built once from its tokens, then each sampled
    token is counted in by the step (``record_tokens``); the penalties it gives equal those
    from the full histories (the numpy reference), whatever row of the table it sits in."""
    rng = np.random.default_rng(3)
    params = [SP(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4),
              SP(temperature=0, presence_penalty=1.1, min_new_tokens=4),
              SP(temperature=0)]  # holds no row: reads row 0, records nothing
    prompts = [[1, 2, 3, 9], [4, 4, 5], [6]]
    first = [[9], [], [7]]  # output known when the row was built (e.g. at re-admission)
    suppress = [[], [5, 63], []]
    rows = np.array([5, 2, 0] + [0] * (B - 3), np.int32)  # table rows of batch rows 0, 1, 2
    table = np.zeros((6, table_width(V)), np.int32)
    for i in range(2):
        table[rows[i]] = token_table_row(prompts[i], first[i], suppress[i], V)
    table = np.asarray(table)
    outputs = [list(o) for o in first]
    for _ in range(6):
        toks = rng.integers(0, V, B).astype(np.int32)
        mask = np.array([True, True, False] + [False] * (B - 3))
        table = np.asarray(record_tokens(jnp.asarray(table), rows, toks, mask))
        for i in range(2):
            outputs[i].append(int(toks[i]))
    assert (table[0] == 0).all() and (table[[1, 3, 4]] == 0).all()
    for i in range(2):
        np.testing.assert_array_equal(table[rows[i]], token_table_row(prompts[i], outputs[i], suppress[i], V))
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    n = len(params)
    inc = build_sampler_inputs(params + [SP(temperature=0)] * (B - n), None, [7] * B, [[]] * B, [[]] * B,
                               [[]] * B, vocab_size=V)
    inc.table, inc.table_rows = table, rows
    inc.suppress = np.array([False, True] + [False] * (B - 2))
    got = np.asarray(apply_penalties(logits, inc))[:n]
    want = _np_penalize(logits[:n], params, prompts, outputs, [[], [5, 63], []])
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-6, atol=1e-6)
    hist, _ = _run(logits[:n], params, steps=[7] * n, prompts=prompts, outputs=outputs,
                   suppress=[[], [5, 63], []], pad_rows_to=B)
    np.testing.assert_array_equal(np.asarray(sample(logits, inc).tokens)[:n], np.asarray(hist.tokens)[:n])


def test_unused_penalties_are_skipped_without_changing_any_bit():
    """A batch where no row uses a penalty or suppression skips them (``lax.cond``); a neutral
    row gets the same token and logprob alone as beside a penalized row (which runs them)."""
    logits = np.random.default_rng(4).normal(size=(2, V)).astype(np.float32) * 2
    plain = SP(temperature=0.9, seed=4, logprobs=3)
    inp = build_sampler_inputs([plain, plain], None, [0, 0], [[]] * 2, [[]] * 2, vocab_size=V)
    np.testing.assert_array_equal(np.asarray(apply_penalties(logits, inp)), logits)  # neutral: identity
    for seed in range(6):
        p = SP(temperature=0.9, seed=seed)
        alone, _ = _run(logits[:1], [p], steps=[seed], num_logprobs=5)
        mixed, _ = _run(logits, [p, SP(temperature=0, repetition_penalty=1.5)], steps=[seed, 0],
                        prompts=[[], [1, 2]], num_logprobs=5, pad_rows_to=B)
        assert int(alone.tokens[0]) == int(mixed.tokens[0])
        assert float(alone.logprob[0]) == float(mixed.logprob[0])


# ----------------------------------------------------------------------------- filters


def _many_seeds(row_logits, **kw):
    logits = np.broadcast_to(np.asarray(row_logits, np.float32), (N, VS))
    out, _ = _run(logits, [SP(seed=s, **kw) for s in range(N)])
    return np.asarray(out.tokens)


def test_top_k_keeps_exactly_the_k_best():
    logits = RNG.normal(size=VS).astype(np.float32)
    toks = _many_seeds(logits, temperature=3.0, top_k=3)
    assert set(toks.tolist()) == set(np.argsort(-logits)[:3].tolist())


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = np.array([0.05, 0.4, 0.12, 0.25, 0.08, 0.04, 0.03, 0.03])
    # sorted: 1 (.40), 3 (.25), 2 (.12), 4 (.08), 0 (.05), 5, 6, 7; mass before: 0 .4 .65 .77
    logits = np.log(probs)
    assert set(_many_seeds(logits, top_p=0.6).tolist()) == {1, 3}
    assert set(_many_seeds(logits, top_p=0.7).tolist()) == {1, 3, 2}
    assert set(_many_seeds(logits, top_p=0.3).tolist()) == {1}
    assert set(_many_seeds(logits, top_p=1.0).tolist()) == set(range(VS))


def test_min_p_drops_tokens_below_threshold():
    # p / p_max = exp(x - 2): tokens 0, 1 and 4 are >= 0.3 of the top, the rest below
    logits = np.array([2.0, 1.9, 0.0, -1.0, 0.9, 0.7, -3.0, 0.75], np.float32)
    toks = _many_seeds(logits, min_p=0.3)
    assert set(toks.tolist()) == {0, 1, 4}
    # min_p applies after temperature: at T=0.5 the ratio for token 4 is exp(-2.2) < 0.3
    toks = _many_seeds(logits, min_p=0.3, temperature=0.5)
    assert set(toks.tolist()) == {0, 1}


def test_suppressed_ids_are_never_chosen():
    logits = np.zeros((N, VS), np.float32)
    logits[:, 3] = 10.0
    logits[:, 5] = 9.0
    params = [SP(temperature=0.0)] + [SP(temperature=2.0, seed=s) for s in range(N - 1)]
    out, _ = _run(logits, params, suppress=[[3, 5]] * N)
    toks = np.asarray(out.tokens)
    assert not np.isin(toks, [3, 5]).any()
    assert toks[0] == 0  # greedy: lowest id among the remaining ties
    assert set(toks[1:].tolist()) == {0, 1, 2, 4, 6, 7}


# ------------------------------------------------------- top-k pre-filter and full sort


def _keep_sorted_before_prefilter(x, inp):
    """The mask of the sampler before the top-k pre-filter (one full stable sort per row,
    kept here verbatim as the reference): top-k, top-p on the top-k-renormalised
    distribution, min-p, rank 0 always kept."""
    import jax
    from k3serve.server.engine.sampler import _top_finite

    Bx, Vx = x.shape
    iota = jnp.broadcast_to(jnp.arange(Vx, dtype=jnp.int32), (Bx, Vx))
    neg, order = jax.lax.sort((-x, iota), dimension=1, is_stable=True, num_keys=1)
    xs = -neg
    rank = iota
    keep = rank < jnp.where(inp.top_k > 0, inp.top_k, Vx)[:, None]
    d = xs - _top_finite(xs[:, :1])
    e = jnp.where(keep, jnp.exp(d), 0.0)
    probs = e / jnp.sum(e, axis=1, keepdims=True)
    cum = jnp.cumsum(probs, axis=1)
    mass_before = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=1)
    p = inp.top_p[:, None]
    keep &= (mass_before < p) | (p >= 1.0)
    keep &= d >= jnp.log(inp.min_p)[:, None]
    keep |= rank == 0
    return np.asarray(jnp.zeros((Bx, Vx), bool).at[jnp.arange(Bx)[:, None], order].set(keep))


def _filter_masks(x, params, C):
    """(sampled rows, masks by path) of ``_keep_filtered`` on ``x`` with C candidates."""
    import jax
    from k3serve.server.engine.sampler import _keep_filtered

    inp = build_sampler_inputs(params, [0] * len(params), [0] * len(params), [[]] * len(params),
                               [[]] * len(params), vocab_size=x.shape[1])
    f = jax.jit(_keep_filtered, static_argnames=("candidates", "force"))
    masks = {path: np.asarray(f(jnp.asarray(x), inp, candidates=C, force=path))
             for path in ("prefilter", "full", None)}
    masks["before"] = _keep_sorted_before_prefilter(jnp.asarray(x), inp)
    sampled = ~np.array([p.greedy for p in params])
    return sampled, masks


_PREFILTER_ROWS = [SP(seed=1, top_k=5, top_p=0.9), SP(seed=1, top_p=0.8), SP(seed=1, top_k=8, min_p=0.1),
                   SP(seed=1, min_p=0.2), SP(temperature=0.0, top_k=40), SP(seed=1, top_p=0.5, min_p=0.05),
                   SP(seed=1, top_k=1), SP(seed=1)]


def test_prefilter_and_full_sort_give_the_same_mask():
    """C = 8 candidates out of V = 64: with peaked rows every row's kept set fits in the
    candidates, and the pre-filter, the full sort, the automatic choice and the sampler
    before the pre-filter agree on every sampled row; the tokens agree whatever path or C."""
    rng = np.random.default_rng(11)
    x = (rng.normal(size=(B, V)) * 4).astype(np.float32)
    sampled, m = _filter_masks(x, _PREFILTER_ROWS, C=8)
    for path in ("prefilter", None, "before"):
        np.testing.assert_array_equal(m[path][sampled], m["full"][sampled], err_msg=str(path))
    assert 1 < m["full"][1].sum() < 8  # a top-p row kept inside the candidates
    assert m["full"][7].all()  # a row without filters keeps the whole vocabulary on both paths
    toks = {}
    for C, path in ((8, "prefilter"), (8, "full"), (8, None), (V, None)):
        out, _ = _run_opts(x, _PREFILTER_ROWS, top_candidates=C, filter_path=path)
        toks[C, path] = np.asarray(out.tokens)
    for key, t in toks.items():
        np.testing.assert_array_equal(t, toks[8, "full"], err_msg=str(key))


def _run_opts(logits, params, **opts):
    inp = build_sampler_inputs(params, [p.seed or 0 for p in params], list(range(len(params))),
                               [[]] * len(params), [[]] * len(params), vocab_size=logits.shape[1])
    return sample(logits, inp, 0, **opts), inp


def test_full_sort_fallback_when_a_row_needs_more_than_the_candidates():
    """Flat rows: a top-p row whose mass is not reached within the C candidates and a top-k
    row with k > C make the pre-filter alone wrong; the automatic choice falls back to the
    full sort, which equals the sampler before the pre-filter."""
    rng = np.random.default_rng(12)
    x = (rng.normal(size=(B, V)) * 0.5).astype(np.float32)
    for params in ([SP(seed=1, top_p=0.9)] + [SP(seed=1, top_k=3)] * (B - 1),
                   [SP(seed=1, top_k=20)] + [SP(seed=1, top_k=3)] * (B - 1)):
        sampled, m = _filter_masks(x, params, C=8)
        assert m["full"][0].sum() > 8
        assert (m["prefilter"][0] != m["full"][0]).any()
        np.testing.assert_array_equal(m[None], m["full"])
        np.testing.assert_array_equal(m["before"][sampled], m["full"][sampled])
        auto, _ = _run_opts(x, params, top_candidates=8)
        full, _ = _run_opts(x, params, top_candidates=8, filter_path="full")
        np.testing.assert_array_equal(np.asarray(auto.tokens), np.asarray(full.tokens))


def test_prefilter_ties_zeros_and_suppressed_ids_rank_like_the_stable_sort():
    """Equal logits (small integers), +0.0 / -0.0 and -inf: lax.top_k's candidates are the
    stable sort's first ranks (equal values by id), so top-k and top-p boundaries inside a
    run of ties keep the same ids on every path."""
    rng = np.random.default_rng(13)
    x = rng.integers(-3, 3, size=(B, V)).astype(np.float32)
    x[:, ::7] = -0.0
    x[:, 3::11] = -np.inf
    x[1] = 0.0
    x[1, 5::2] = -0.0  # a row of zeros of both signs
    params = [SP(seed=1, top_k=3), SP(seed=1, top_k=6), SP(seed=1, top_p=0.3), SP(seed=1, top_k=7, top_p=0.6),
              SP(seed=1, top_k=2, min_p=0.5), SP(seed=1, top_p=0.05), SP(seed=1, top_k=8), SP(seed=1, min_p=0.9)]
    for C in (8, 16):
        sampled, m = _filter_masks(x, params, C)
        for path in ("prefilter", None, "before"):
            np.testing.assert_array_equal(m[path][sampled], m["full"][sampled], err_msg=f"{path} C={C}")
    assert m["full"][0].sum() == 3 and m["full"][1, :6].all() and m["full"][1].sum() == 6  # zeros: ids 0..5
    toks = [np.asarray(_run_opts(x, params, top_candidates=C, filter_path=fp)[0].tokens)
            for C, fp in ((8, "prefilter"), (8, "full"), (V, None))]
    np.testing.assert_array_equal(toks[0], toks[1])
    np.testing.assert_array_equal(toks[0], toks[2])


# ------------------------------------------------------------------------ distribution


def test_temperature_sampling_matches_softmax():
    logits = np.array([1.0, 0.0, -0.5, 0.3, -1.0, 0.8, -2.0, 0.1], np.float32)
    steps = list(range(N))  # one request over N consecutive steps
    L = np.broadcast_to(logits, (N, VS))
    out, _ = _run(L, [SP(temperature=0.7, seed=42)] * N, steps=steps)
    counts = np.bincount(np.asarray(out.tokens), minlength=VS)
    assert _chi2(counts, _softmax(logits / 0.7)) < 36.0  # df=7, p ~ 1e-5
    # penalized + filtered: presence 0.5 on token 0, then T=1.2, then top_k=5
    out, _ = _run(L, [SP(temperature=1.2, top_k=5, presence_penalty=0.5, seed=7)] * N,
                  steps=steps, outputs=[[0]] * N)
    counts = np.bincount(np.asarray(out.tokens), minlength=VS)
    x = (logits - 0.5 * (np.arange(VS) == 0)) / 1.2
    kept = np.sort(np.argsort(-x)[:5])
    assert counts[np.setdiff1d(np.arange(VS), kept)].sum() == 0
    assert _chi2(counts[kept], _softmax(x[kept])) < 29.0  # df=4, p ~ 1e-5


# ------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("req", [
    SP(temperature=0.9, top_k=50, top_p=0.95, min_p=0.01, repetition_penalty=1.1,
       frequency_penalty=0.3, presence_penalty=0.2, logprobs=5),
    # no top-k/top-p: alone it takes the sort-free path, in the batch the sorted one
    SP(temperature=0.8, min_p=0.05, frequency_penalty=0.3),
], ids=["filters", "min_p_only"])
def test_same_seed_and_step_give_same_token_whatever_the_batch(req):
    r_logits = RNG.normal(size=V).astype(np.float32) * 2
    r_prompt, r_out = [1, 2, 3, 4, 5], [7, 7, 9]
    # neighbours: (params, seed, step, prompt, output, suppress); one prompt of 40 puts the
    # batch in a longer prompt bucket than the request alone
    nb = [
        (SP(temperature=0.0), 11, 0, [], [], []),
        (SP(temperature=1.0, top_p=0.5, repetition_penalty=1.5), 12, 100, list(range(40)),
         [3], [1]),
        (SP(temperature=2.0, top_k=3), 13, 5, [5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], []),
        (SP(temperature=0.5, min_p=0.1, presence_penalty=-1.0), 14, 9, [], [60, 61], [2, 3]),
    ]
    alone, together = [], []
    for seed in range(12):
        step = 3 + seed
        o1, _ = _run(r_logits[None], [req], seeds=[seed], steps=[step], prompts=[r_prompt],
                     outputs=[r_out], suppress=[[0]], num_logprobs=5)
        rows = nb[:3] + [(req, seed, step, r_prompt, r_out, [0])] + nb[3:]
        lg = RNG.normal(size=(5, V)).astype(np.float32) * 2
        lg[3] = r_logits
        o5, inp = _run(lg, [r[0] for r in rows], seeds=[r[1] for r in rows],
                       steps=[r[2] for r in rows], prompts=[r[3] for r in rows],
                       outputs=[r[4] for r in rows], suppress=[r[5] for r in rows],
                       num_logprobs=5, pad_rows_to=B)
        alone.append(int(o1.tokens[0]))
        together.append(int(o5.tokens[3]))
        assert float(o1.logprob[0]) == float(o5.logprob[3])
        np.testing.assert_array_equal(np.asarray(o1.top_ids[0]), np.asarray(o5.top_ids[3]))
    assert alone == together
    assert len(set(alone)) > 4  # the draws really are random


def test_steps_and_seeds_change_the_draw_and_repeats_do_not():
    logits = np.zeros((N, VS), np.float32)
    a, _ = _run(logits, [SP(seed=9)] * N, steps=list(range(N)))
    b, _ = _run(logits, [SP(seed=9)] * N, steps=list(range(N)))
    c, _ = _run(logits, [SP(seed=s) for s in range(N)], steps=[0] * N)
    a, b, c = (np.asarray(o.tokens) for o in (a, b, c))
    np.testing.assert_array_equal(a, b)  # same seed + step: same token
    uniform = np.full(VS, 1.0 / VS)
    # one seed over many steps, and many seeds at one step, both look uniform
    assert _chi2(np.bincount(a, minlength=VS), uniform) < 36.0
    assert _chi2(np.bincount(c, minlength=VS), uniform) < 36.0
    # and the two streams agree only by chance (1/8)
    assert abs((a == c).mean() - 1.0 / VS) < 0.04


# ---------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_and_sorted():
    n = 5
    logits = (RNG.normal(size=(B, V)) * 3).astype(np.float32)
    params = [SP(temperature=0.0, repetition_penalty=1.8, logprobs=n),
              SP(temperature=2.0, top_k=10, seed=1, presence_penalty=2.0, logprobs=n)] * (B // 2)
    out, _ = _run(logits, params, outputs=[[int(logits[i].argmax())] for i in range(B)],
                  suppress=[[1]] * B, num_logprobs=n)
    ref = _log_softmax(logits)
    toks = np.asarray(out.tokens)
    np.testing.assert_allclose(np.asarray(out.logprob), ref[np.arange(B), toks], atol=2e-5)
    top_ids, top_lp = np.asarray(out.top_ids), np.asarray(out.top_logprobs)
    assert top_ids.shape == (B, n) and top_lp.shape == (B, n)
    np.testing.assert_array_equal(top_ids, np.argsort(-ref, axis=1, kind="stable")[:, :n])
    np.testing.assert_allclose(top_lp, np.take_along_axis(ref, top_ids, 1), atol=2e-5)
    assert (np.diff(top_lp, axis=1) <= 0).all()
    # the penalty moved the greedy choice away from the raw argmax: its logprob is raw
    assert (toks[0::2] != logits.argmax(1)[0::2]).all()
    out0, _ = _run(logits, params)
    assert out0.top_ids.shape == (B, 0) and out0.top_logprobs.shape == (B, 0)


# -------------------------------------------------------------------- host-side inputs


def test_build_sampler_inputs_padding_and_table():
    params = [SP(temperature=0.5, top_k=-1, repetition_penalty=1.2, seed=2**40 + 3)]
    inp = build_sampler_inputs(params, None, [4], [list(range(40)) + [-1, 99]], [[1, 2, 2]], [[0]],
                               pad_rows_to=4, vocab_size=V)
    assert inp.temperature.shape == (4,) and inp.table.shape == (4, table_width(V))
    np.testing.assert_array_equal(np.asarray(inp.temperature), [0.5, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(inp.top_k), [0, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(inp.repetition_penalty), np.float32([1.2, 1, 1, 1]))
    np.testing.assert_array_equal(np.asarray(inp.top_p), [1, 1, 1, 1])
    np.testing.assert_array_equal(np.asarray(inp.suppress), [True, False, False, False])
    np.testing.assert_array_equal(np.asarray(inp.table_rows), [0, 1, 2, 3])
    assert int(inp.seed[0]) == seed_to_u32(2**40 + 3) != 3
    t = np.asarray(inp.table)
    assert (t[1:] == 0).all()
    # out-of-range ids (-1, 99 >= V) are ignored, as padding always was
    want = np.zeros(V, np.int64)
    want[:40] |= PROMPT_BIT
    want[[1, 2]] += [1, 2]
    want[0] |= SUPPRESS_BIT
    np.testing.assert_array_equal(t[0, :V], want)
    with pytest.raises(ValueError, match="no seed"):
        build_sampler_inputs([SP()], None, [0], [[]], [[]], vocab_size=V)
    with pytest.raises(ValueError, match="pad_rows_to"):
        build_sampler_inputs([SP(seed=1)] * 2, None, [0, 0], [[]] * 2, [[]] * 2, pad_rows_to=1, vocab_size=V)


# -------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize("kwargs, match", [
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"max_new_tokens": 2.0}, "max_new_tokens must be an int"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.01}, "top_p"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be finite and > 0"),
    ({"frequency_penalty": 2.5}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"min_new_tokens": -1}, "min_new_tokens must be >= 0"),
    ({"min_new_tokens": 20, "max_new_tokens": 10}, "must be <= max_new_tokens"),
    ({"stop": "END"}, "not a single string"),
    ({"stop": ["ok", ""]}, "non-empty"),
    ({"stop_token_ids": [1, -3]}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SP(**kwargs)


def test_sampling_params_defaults_and_normalization():
    p = SP()
    assert (p.max_new_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (16, 1.0, 0, 1.0, 0.0)
    assert p.seed is None and p.logprobs is None and not p.greedy
    p = SP(stop=["a", "bc"], stop_token_ids=[2, 7], temperature=0, top_k=-1, logprobs=0)
    assert p.stop == ("a", "bc") and p.stop_token_ids == (2, 7)
    assert isinstance(p.temperature, float) and p.greedy
    assert SP(frequency_penalty=-2, presence_penalty=2, top_p=1, min_p=1).top_p == 1.0


def test_logit_bias_bitmask_and_id_logprobs():
    """The logit bias is added after the penalties (greedy takes its argmax: -100 removes the
    argmax, +100 forces an id), the bitmask forbids ids for its row only (sampled rows too),
    and every row reports its ``token_ids_logprob`` ids' raw log-probs."""
    rng = np.random.default_rng(7)
    B, V = 6, 100
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    top = logits.argmax(1)
    params = [SP(temperature=0, logit_bias={int(top[0]): -100.0}),
              SP(temperature=0, logit_bias={17: 100.0}, token_ids_logprob=(3, 17, 99)),
              SP(temperature=0), SP(temperature=1.0, seed=4), SP(temperature=0.7, seed=9, top_k=5),
              SP(temperature=0, token_ids_logprob=(int(top[5]),))]
    inp = build_sampler_inputs(params, None, [0] * B, [[1]] * B, [[]] * B, vocab_size=V)
    allowed = np.ones((B, V), bool)
    allowed[2] = False
    allowed[2, [5, 50, 60]] = True  # a greedy row under a grammar: its best of three
    allowed[3] = False
    allowed[3, [11, 12]] = True  # a sampled row under a grammar
    from k3serve.server.structured.grammar import pack_bitmask

    out = sample(jnp.asarray(logits), inp, 2, bitmask=jnp.asarray(pack_bitmask(allowed)))
    tok = np.asarray(out.tokens)
    second = np.argsort(-logits[0])[1]
    assert tok[0] == second and tok[1] == 17
    assert tok[2] == [5, 50, 60][int(np.argmax(logits[2, [5, 50, 60]]))]
    assert tok[3] in (11, 12) and tok[5] == top[5]
    lp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    idl = np.asarray(out.id_logprobs)
    np.testing.assert_allclose(idl[1, :3], lp[1, [3, 17, 99]], rtol=1e-5, atol=1e-5)  # raw: before the bias
    np.testing.assert_allclose(idl[5, 0], lp[5, top[5]], rtol=1e-5, atol=1e-5)
    # without a bitmask (or an all-ones one) nothing but the bias changes
    free = sample(jnp.asarray(logits), inp, 2, bitmask=jnp.full((B, 4), -1, jnp.int32))
    plain = sample(jnp.asarray(logits), inp, 2)
    np.testing.assert_array_equal(np.asarray(free.tokens), np.asarray(plain.tokens))
    assert np.asarray(plain.tokens)[2] == top[2]


def test_logit_bias_is_validated():
    for bad in ({-1: 1.0}, {1: 100.5}, {1: float("nan")}, {"1": 1.0}, {i: 1.0 for i in range(301)}):
        with pytest.raises(ValueError):
            SP(logit_bias=bad)
    with pytest.raises(ValueError):
        SP(token_ids_logprob=tuple(range(33)))
    with pytest.raises(ValueError):
        SP(regex="a", json_schema="{}")
    assert SP(logit_bias={}).logit_bias is None
