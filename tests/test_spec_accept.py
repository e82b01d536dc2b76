"""Acceptance of weight-free drafts (``server/spec/accept.py``, issue #34): sampling each verify
position with plain decoding's key and keeping drafts while they match emits exactly the
tokens plain sampling emits (seeded, token for token), and its accept / reject laws are
rejection sampling's for a one-hot proposal (chi-square against the exact probabilities).

The "model" is a fixed table of logits over a 5-token vocabulary indexed by the previous token
and the position, so its distribution after any prefix is known exactly."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3serve.server.engine.sampler import build_sampler_inputs, sample
from k3serve.server.engine.sampling_params import SamplingParams
from k3serve.server.spec.accept import accepted_lengths, emitted, position_steps

V, SEEDS, L = 5, 1000, 6
TABLE = np.random.default_rng(0).standard_normal((L + 8, V, V)).astype(np.float32) * 1.5


def _logits(prev, t):
    """Logits of the token at position ``t`` after token ``prev`` (arrays of rows)."""
    return TABLE[np.asarray(t), np.asarray(prev)]


def _inputs(steps, temperature=1.0):
    n = len(steps)
    params = [SamplingParams(temperature=temperature, seed=1000 + i % SEEDS) for i in range(n)]
    return build_sampler_inputs(params, None, list(steps), [[0]] * n, [[]] * n, vocab_size=V)


_sample = jax.jit(lambda logits, inp: sample(logits, inp).tokens)


def _decode_plain(first, rows, inputs):
    """Each of ``rows`` seeds decodes L tokens one at a time after token ``first``;
    ``inputs(outs)`` gives the sampler's inputs for the outputs so far."""
    outs, prev = [[] for _ in range(rows)], np.full(rows, first)
    for t in range(L):
        y = np.asarray(_sample(jnp.asarray(_logits(prev, t)), inputs(outs)))
        for r in range(rows):
            outs[r].append(int(y[r]))
        prev = y
    return np.array(outs)


def _decode_speculative(first, rows, draft_fn, inputs, d=3):
    """Each of ``rows`` seeds decodes L tokens, verifying ``d`` drafts a step: every position
    sampled with plain decoding's key for that token (``inputs(outs, steps, drafts, num)``:
    the sampler's inputs of the ``rows * (d + 1)`` positions), drafts kept while they match.
    Every row runs every step (one shape, one compile); a finished row's tokens are ignored."""
    out, prev = [[] for _ in range(rows)], [first] * rows
    while min(len(o) for o in out) < L:
        steps = np.array([len(o) for o in out])
        drafts = np.array([draft_fn(out[r], prev[r]) for r in range(rows)]).reshape(rows, d)
        num = np.clip(L - 1 - steps, 0, d)  # no drafts past the last token wanted
        ctx = np.concatenate([np.array(prev)[:, None], drafts], axis=1)  # input of each position
        logits = _logits(ctx.reshape(-1), np.minimum(position_steps(steps, d + 1), L + 7).reshape(-1))
        y = np.asarray(_sample(jnp.asarray(logits), inputs(out, steps, drafts, num))).reshape(rows, d + 1)
        for r, toks in enumerate(emitted(y, accepted_lengths(y, drafts, num))):
            if len(out[r]) < L:
                out[r].extend(toks)
                prev[r] = out[r][-1]
    return np.array([o[:L] for o in out])


def _plain(first, temperature=1.0):
    return _decode_plain(first, SEEDS, lambda outs: _inputs([len(outs[0])] * SEEDS, temperature))


def _speculative(first, draft_fn, d, temperature=1.0):
    def inputs(out, steps, drafts, num):  # each position a row of its own, settings and seed repeated
        seeds = np.repeat(np.arange(SEEDS), d + 1)
        params = [SamplingParams(temperature=temperature, seed=1000 + int(s)) for s in seeds]
        return build_sampler_inputs(params, None, position_steps(steps, d + 1).reshape(-1).tolist(),
                                    [[0]] * len(params), [[]] * len(params), vocab_size=V)

    return _decode_speculative(first, SEEDS, draft_fn, inputs, d)


def _constant(tok):
    return lambda out, prev: [tok] * 3


def _argmax_guess(out, prev):
    """The toy model's greedy continuation: often right, sometimes not."""
    toks, p = [], prev
    for j in range(3):
        p = int(np.argmax(TABLE[len(out) + j, p]))
        toks.append(p)
    return toks


@pytest.mark.parametrize("draft_fn", [_constant(2), _argmax_guess], ids=["constant", "greedy-guess"])
def test_seeded_sampling_emits_exactly_the_plain_tokens(draft_fn):
    plain = _plain(first=1)
    spec = _speculative(1, draft_fn, d=3)
    np.testing.assert_array_equal(spec, plain)


def test_greedy_rows_emit_the_argmax_chain():
    plain = _plain(first=3, temperature=0.0)
    spec = _speculative(3, _constant(4), d=3, temperature=0.0)
    np.testing.assert_array_equal(spec, plain)
    chain, p = [], 3
    for t in range(L):
        p = int(np.argmax(TABLE[t, p]))
        chain.append(p)
    assert (plain == np.array(chain)).all()


def _chi2(counts, probs):
    exp = probs * counts.sum()
    return float(((counts - exp) ** 2 / exp).sum())


def test_accept_and_residual_laws_are_rejection_samplings():
    """At one position with draft x: P(accept) = p(x), and a rejected token follows p with x
    removed, renormalised (chi-square, 4 degrees of freedom: 99.9 % quantile 18.47)."""
    N, x, prev = 20000, 2, 1
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(N)]
    inp = build_sampler_inputs(params, None, [0] * N, [[0]] * N, [[]] * N, vocab_size=V)
    y = np.asarray(_sample(jnp.asarray(np.repeat(_logits([prev], [0]), N, axis=0)), inp))
    p = np.exp(TABLE[0, prev] - TABLE[0, prev].max())
    p /= p.sum()
    acc = accepted_lengths(np.stack([y, y], 1), np.full((N, 1), x), np.ones(N, np.int32))
    rate = acc.mean()
    assert abs(rate - p[x]) < 4 * np.sqrt(p[x] * (1 - p[x]) / N), (rate, p[x])
    rejected = y[acc == 0]
    counts = np.bincount(rejected, minlength=V).astype(float)
    assert counts[x] == 0
    resid = np.delete(p, x) / (1 - p[x])
    assert _chi2(np.delete(counts, x), resid) < 16.27  # 3 dof, 99.9 %
    assert _chi2(np.bincount(y, minlength=V).astype(float), p) < 18.47


def test_accepted_lengths_stop_at_the_first_mismatch_and_at_the_row_drafts():
    sampled = np.array([[5, 6, 7, 8], [5, 6, 0, 8], [1, 2, 3, 4], [9, 9, 9, 9]])
    drafts = np.array([[5, 6, 7], [5, 6, 7], [0, 2, 3], [9, 9, 9]])
    num = np.array([3, 3, 3, 1])
    np.testing.assert_array_equal(accepted_lengths(sampled, drafts, num), [3, 2, 0, 1])
    np.testing.assert_array_equal(np.asarray(accepted_lengths(jnp.asarray(sampled), jnp.asarray(drafts),
                                                              jnp.asarray(num))), [3, 2, 0, 1])
    assert emitted(sampled, [3, 2, 0, 1]) == [[5, 6, 7, 8], [5, 6, 0], [1], [9, 9]]
    with pytest.raises(ValueError, match="positions - 1"):
        accepted_lengths(sampled, drafts[:, :2], num)


# ---- penalties and min_new_tokens inside the block (server/engine/spec_positions.py)

EOS, MIN_NEW = 0, 4
PENAL = dict(temperature=1.0, frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.3,
             min_new_tokens=MIN_NEW)
NP = 400  # seeds


def _penal_inputs(outputs):
    params = [SamplingParams(seed=7000 + i, **PENAL) for i in range(len(outputs))]
    steps = [len(o) for o in outputs]
    return build_sampler_inputs(params, None, steps, [[1, 3]] * len(outputs), outputs,
                                [[EOS] if s < MIN_NEW else [] for s in steps], vocab_size=V)


def _plain_penalized(first):
    return _decode_plain(first, NP, _penal_inputs)


def _spec_penalized(first, draft_fn, d=3):
    from k3serve.server.engine.spec_positions import suppress_positions, verify_sampler_inputs

    def inputs(outs, steps, drafts, num):
        params = [SamplingParams(seed=7000 + r, **PENAL) for r in range(NP)]
        base = build_sampler_inputs(params, None, steps.tolist(), [[1, 3]] * NP, outs, [[EOS]] * NP, vocab_size=V)
        sup = suppress_positions(steps, [MIN_NEW] * NP, [True] * NP, d + 1)
        return verify_sampler_inputs(base, jnp.asarray(drafts), jnp.asarray(num), jnp.asarray(sup), use_table=True)

    return _decode_speculative(first, NP, draft_fn, inputs, d)


def test_penalties_and_min_new_tokens_count_the_drafts_before_each_position():
    """Frequency, presence and repetition penalties and EOS suppressed for the first 4 tokens:
    the speculative path emits the plain path's tokens, seed by seed."""
    def repeat_last(out, prev):  # drafts that repeat tokens (what penalties act on) and EOS early
        return [prev, prev, EOS]

    plain = _plain_penalized(2)
    assert not (plain[:, :MIN_NEW] == EOS).any() and (plain[:, MIN_NEW:] == EOS).any()
    for fn in (repeat_last, _argmax_guess):
        np.testing.assert_array_equal(_spec_penalized(2, fn), plain)


def test_positions_without_the_table_keep_the_engines():
    from k3serve.server.engine.spec_positions import verify_sampler_inputs

    base = _inputs([3, 5], temperature=0.0)
    inp = verify_sampler_inputs(base, jnp.asarray([[1, 2], [3, 4]]), jnp.asarray([2, 1]),
                                jnp.zeros((2, 3), bool), use_table=False)
    assert inp.table is base.table
    np.testing.assert_array_equal(np.asarray(inp.step), [3, 4, 5, 5, 6, 7])
    np.testing.assert_array_equal(np.asarray(inp.table_rows), [0, 0, 0, 1, 1, 1])


def test_dspark_drafts_are_coupled_with_the_target_sample():
    """A sampled DSpark draft uses the Gumbel noise plain decoding uses for the same token
    (``DSparkDraft.sample_block``), so "keep the draft while the target's sample equals it"
    accepts far more than independent drafts would: every draft when ``q = p``, and, for a
    ``q`` off ``p``, at least the Gumbel-max coupling's ``(1 - TV) / (1 + TV)``, close to the
    ``1 - TV`` of rejection sampling against ``q`` (``tools/dspark_coupling.py``; the figures are
    in docs/speculative.md)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "tools" / "dspark_coupling.py"
    spec = importlib.util.spec_from_file_location("dspark_coupling", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    rng = np.random.default_rng(1)
    n, vocab = 1500, 32
    p = rng.standard_normal((n, vocab)).astype(np.float32) * 2
    seeds, steps = np.arange(n) + 3, rng.integers(0, 500, n)
    same = tool.coupling_rates(p, p, seeds, steps)
    assert same["coupled"] == 1.0 and same["independent"] < 0.3
    r = tool.coupling_rates(p, p + rng.standard_normal(p.shape).astype(np.float32) * 0.5, seeds, steps)
    se = 0.5 / np.sqrt(n)  # a binomial mean's standard error, at most
    assert r["bound"] - 3 * se <= r["coupled"] <= r["q_rule"] + 3 * se, r
    assert r["coupled"] > 3 * r["independent"], r
