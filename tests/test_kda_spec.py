"""The KDA journal and fold of speculative verification (``kernels/kda_spec.py``, issue #34):
for every accept length the committed state and conv window equal plain decoding of the
accepted tokens bit for bit, with ragged drafts (0 allowed) per row.

Why: a state that drifts from plain decoding leaves every output looking right for a while
(SGLang's ReplaySSM notes, ../shared/design/spec-decode.md); only a parity test catches it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3serve.kernels import kda, kda_spec

R, N, H, DK, DV = 3, 5, 4, 16, 16  # rows, positions (1 + 4 drafts), heads


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q, k = f(R, N, H, DK), f(R, N, H, DK)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(DK)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = -np.abs(f(R, N, H, DK)) * 0.3
    beta = 1 / (1 + np.exp(-f(R, N, H)))
    return q, k, f(R, N, H, DV), g, beta, f(R, H, DK, DV)


def _plain(q, k, v, g, beta, S, upto):
    """Decode positions 0..upto-1 one program call at a time (the engine's plain decode)."""
    step = jax.jit(kda_spec.kda_decode_step_journal)
    outs = []
    for t in range(upto):
        o, S = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        outs.append(np.asarray(o))
    return outs, np.asarray(S)


def test_fold_equals_plain_decoding_bitwise_for_every_accept_length():
    q, k, v, g, beta, S0 = _inputs()
    o, journal = jax.jit(kda_spec.kda_verify)(q, k, v, g, beta, S0)
    fold = jax.jit(kda_spec.kda_fold)
    outs, _ = _plain(q, k, v, g, beta, S0, N)
    for t in range(N):  # each position's output is plain decoding's
        np.testing.assert_array_equal(np.asarray(o[:, t]), outs[t])
    for a in range(N + 1):
        want = _plain(q, k, v, g, beta, S0, a)[1] if a else S0
        got = np.asarray(fold(S0, journal, jnp.full((R,), a, jnp.int32)))
        np.testing.assert_array_equal(got, want, err_msg=f"accept {a}")
    # and the journal's arithmetic is the decode step's
    o1, S1 = jax.jit(kda.kda_decode_step)(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0)
    np.testing.assert_allclose(np.asarray(S1), _plain(q, k, v, g, beta, S0, 1)[1], rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(o1), outs[0], rtol=0, atol=1e-6)


def test_ragged_drafts_and_accept_lengths_per_row():
    """Rows with 0, 2 and 4 drafts in one call (positions past a row's drafts are padding that
    must not advance its running state), each accepting a different count."""
    q, k, v, g, beta, S0 = _inputs(1)
    drafts = np.array([0, 2, 4])
    valid = np.arange(N)[None, :] <= drafts[:, None]
    o, journal = jax.jit(kda_spec.kda_verify)(q, k, v, g, beta, S0, valid)
    accepted = np.array([1, 3, 2])  # the last token plus accepted drafts (at most 1 + drafts)
    got = np.asarray(jax.jit(kda_spec.kda_fold)(S0, journal, accepted))
    for r in range(R):
        sl = lambda x: x[r:r + 1]  # noqa: E731
        outs, want = _plain(*(sl(x) for x in (q, k, v, g, beta, S0)), accepted[r])
        np.testing.assert_array_equal(got[r:r + 1], want, err_msg=f"row {r}")
        for t in range(accepted[r]):
            np.testing.assert_array_equal(np.asarray(o[r:r + 1, t]), outs[t])


def test_zero_accepted_leaves_the_state_untouched():
    q, k, v, g, beta, S0 = _inputs(2)
    _, journal = kda_spec.kda_verify(q, k, v, g, beta, S0)
    np.testing.assert_array_equal(np.asarray(kda_spec.kda_fold(S0, journal, np.zeros(R, np.int32))), S0)


@pytest.mark.parametrize("accepted", [[0, 1, 5], [2, 4, 3]])
def test_conv_window_commit_is_the_shifted_window(accepted):
    rng = np.random.default_rng(3)
    window = rng.standard_normal((R, 3, 24)).astype(np.float32)
    rows = rng.standard_normal((R, N, 24)).astype(np.float32)
    got = np.asarray(kda_spec.conv_window_commit(window, rows, np.array(accepted)))
    for r, a in enumerate(accepted):
        want = window[r]
        for t in range(a):  # plain decode: shift one row in per token
            want = np.concatenate([want[1:], rows[r, t:t + 1]])
        np.testing.assert_array_equal(got[r], want)


def test_journal_memory_at_k3_size():
    from k3serve.model.config import k3_full

    cfg = k3_full()  # 69 KDA layers of 96 heads of 128
    journal = kda_spec.journal_bytes_per_request(cfg, 7)
    copies = kda_spec.state_copies_bytes_per_request(cfg, 7)
    assert journal == 69 * 8 * (96 * 3 * 128 * 4 + 3 * 96 * 128 * 2)  # 116.4 MiB
    assert copies == 69 * 8 * 96 * 128 * 128 * 4  # 3.23 GiB
    assert copies / journal > 27
