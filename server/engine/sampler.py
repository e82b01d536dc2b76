"""Batched token sampling: one jitted function turns a padded batch of logits into tokens.

Why it looks like this:

* **Per-row settings as arrays.** Every row of a decode batch may belong to a different
  request with different settings. Passing them as ``f32[B]`` / ``i32[B]`` arrays (in
  :class:`SamplerInputs`) instead of Python constants means one compiled program serves
  any mix of requests; only the shapes (rows, vocabulary, ``num_logprobs``) select a
  program.

* **No token histories per step.** Penalties and suppression read a per-request *token
  table* row (``i32[V]``: output counts, a prompt bit, a suppress bit), kept on the device
  and updated by the step with each sampled token (:func:`record_tokens`), so the host
  ships nothing that grows with the sequence. A batch where no row uses a penalty or
  suppression skips them (``lax.cond``): a neutral row's logits come out unchanged anyway.

* **Batch-independent randomness.** A row's key is ``fold_in(key(seed), step)`` where
  ``step`` counts the tokens that request has generated so far, and the noise is drawn per
  row from that key over the vocabulary. So a seeded request draws the same tokens whatever
  else shares its batch and whichever row it lands in, and a preempted-and-resumed request
  continues its stream exactly. Sampling is the Gumbel-max trick
  (``argmax(logits / T + Gumbel)``), which needs no cumulative sum over the filtered
  distribution and gives each vocabulary id its own noise value.

* **Processing order** (vLLM-compatible):
  penalties -> suppression -> greedy rows: argmax of the penalized logits /
  sampled rows: ``/ temperature`` -> top-k -> top-p -> min-p -> Gumbel-max.
  Repetition penalty (CTRL / vLLM style) touches every token seen in the prompt or the
  output: positive logits are divided by it, negative ones multiplied. Frequency and
  presence penalties (OpenAI style) use output tokens only:
  ``logit -= frequency * count + presence * (count > 0)``. Suppressed ids (e.g. EOS while
  ``min_new_tokens`` is not reached) get ``-inf``. Top-p keeps the smallest prefix of the
  sorted distribution whose mass reaches ``p`` (the top token always survives); min-p
  drops tokens whose probability is below ``min_p * max_prob``. Top-k and top-p rank only
  ``lax.top_k`` candidates (:func:`default_top_candidates`) and fall back to one full sort
  per row only when some row's kept set may reach past them (top-k larger than the
  candidates, or top-p mass not reached within them); a batch where no sampled row uses
  top-k or top-p ranks nothing, and a batch with no sampled rows skips everything after the
  argmax (``lax.cond`` on batch-wide flags, arranged so a row's result never depends on
  which branch ran).

* **Logit bias, id log-probs, grammars.** A request's ``logit_bias`` (up to
  ``MAX_LOGIT_BIAS`` ids) and ``token_ids_logprob`` (up to ``MAX_TOKEN_IDS_LOGPROB`` ids) live
  in ``EXTRA_COLS`` columns after the ``V`` counts of its token-table row (bias ids, bias
  values as f32 bits, logprob ids), written with the row; the bias is added after the
  penalties (and so before greedy's argmax), and each row's listed ids' log-probs come back
  every step (``SampleOutput.id_logprobs``). Constrained rows (``server/structured``) come with
  a packed bitmask ``int32[B, ceil(V / 32)]`` (bit ``i % 32`` of word ``i // 32``: id ``i``
  allowed); forbidden ids get ``-inf`` after the bias and suppression. One bitmask input for
  every row (unconstrained rows all ones) keeps one sampling program; a batch whose bitmask
  allows everything skips it (``lax.cond``).

* **Logprobs are the model's.** Reported log-probs (of the chosen token and of the top-n
  alternatives) are ``log_softmax`` of the *raw* logits, before penalties, suppression,
  temperature and filters. They then describe the model rather than this request's
  sampling settings, do not turn into ``-inf`` for filtered tokens, and match vLLM's
  default ``raw_logprobs`` mode. A chosen token can therefore have a lower log-prob than
  an alternative the filters removed; that is intended.

Greedy rows (temperature below ``GREEDY_TEMPERATURE``) are an exact argmax (ties go to the
lowest id) and never touch the random stream.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .sampling_params import GREEDY_TEMPERATURE, MAX_LOGIT_BIAS, MAX_TOKEN_IDS_LOGPROB, SamplingParams

_PRNG_IMPL = "threefry2x32"  # fixed, so draws do not change with jax's default PRNG config


# A request's token table row (``i32[V]``): how often each id occurs in its output (the low
# bits), whether it occurs in its prompt, and whether it is one of the ids suppressed while
# ``min_new_tokens`` is not reached (stop ids and eos). Penalties and suppression read only
# this row, so no token history ever travels to the device: the engine builds a row once when
# a request (re)starts running and the jitted step adds each sampled token to it.
COUNT_MASK = (1 << 29) - 1
PROMPT_BIT = 1 << 29
SUPPRESS_BIT = 1 << 30
# after the V counts: MAX_LOGIT_BIAS biased ids (V = none), their biases (f32 bits), then
# MAX_TOKEN_IDS_LOGPROB ids whose log-probs every step reports
BIAS_IDS, BIAS_VALUES, LOGPROB_IDS = 0, MAX_LOGIT_BIAS, 2 * MAX_LOGIT_BIAS
EXTRA_COLS = 2 * MAX_LOGIT_BIAS + MAX_TOKEN_IDS_LOGPROB


def table_width(vocab_size: int) -> int:
    """Columns of a token-table row: the counts of ``vocab_size`` ids, then ``EXTRA_COLS``."""
    return vocab_size + EXTRA_COLS


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerInputs:
    """Per-row sampling state for a padded batch of ``B`` rows (device arrays).

    ``table`` holds token-table rows (see ``COUNT_MASK``; the engine's table has one row per
    running request that uses penalties or suppression, row 0 unused); ``table_rows[i]`` is
    row ``i``'s. Only penalized or suppressing rows read it, and a batch where no row does
    skips it. ``suppress[i]``: row ``i``'s ``SUPPRESS_BIT`` ids get ``-inf`` this step.
    ``top_k`` <= 0 means off.
    """

    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
    min_p: jax.Array  # f32[B]
    repetition_penalty: jax.Array  # f32[B]
    frequency_penalty: jax.Array  # f32[B]
    presence_penalty: jax.Array  # f32[B]
    seed: jax.Array  # u32[B]
    step: jax.Array  # i32[B]
    suppress: jax.Array  # bool[B]
    table_rows: jax.Array  # i32[B]
    table: jax.Array  # i32[R, V + EXTRA_COLS]
    bias: jax.Array  # bool[B]: the row's table row carries a logit bias


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
    tokens: jax.Array  # i32[B]
    logprob: jax.Array  # f32[B]      log_softmax(raw logits)[token]
    top_ids: jax.Array  # i32[B, n]   n = num_logprobs, most likely first
    top_logprobs: jax.Array  # f32[B, n]
    id_logprobs: jax.Array  # f32[B, MAX_TOKEN_IDS_LOGPROB]  log_softmax(raw)[the row's token_ids_logprob]


# --------------------------------------------------------------------------- host side


def seed_to_u32(seed: int) -> int:
    """Fold an arbitrary Python int into 32 bits (the PRNG seed width used here)."""
    s = int(seed) % (1 << 64)
    return (s ^ (s >> 32)) & 0xFFFFFFFF


def uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def token_table_row(prompt: Sequence[int], output: Sequence[int], suppress: Sequence[int],
                    vocab_size: int, logit_bias: dict | None = None, logprob_ids: Sequence[int] = ()) -> np.ndarray:
    """A request's token-table row (``i32[V + EXTRA_COLS]``) from its histories, its logit bias
    and its ``token_ids_logprob``; ids outside ``[0, V)`` are ignored in the histories (the
    engine validates bias and logprob ids). O(len(prompt) + len(output) + V): built once per
    (re)admission, never per step."""
    def ids(xs):
        a = np.asarray(xs, np.int64).reshape(-1)
        return a[(a >= 0) & (a < vocab_size)]

    row = np.bincount(ids(output), minlength=vocab_size).astype(np.int32)
    if (row > COUNT_MASK).any():
        raise ValueError("token count overflows the token table")
    row[ids(prompt)] |= PROMPT_BIT
    row[ids(suppress)] |= SUPPRESS_BIT
    extra = np.zeros(EXTRA_COLS, np.int32)
    extra[BIAS_IDS:BIAS_IDS + MAX_LOGIT_BIAS] = vocab_size  # out of range: no bias
    if logit_bias:
        if len(logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(logit_bias)} ids; at most {MAX_LOGIT_BIAS}")
        ks = np.fromiter(logit_bias.keys(), np.int64, len(logit_bias))
        if ((ks < 0) | (ks >= vocab_size)).any():
            raise ValueError(f"logit_bias id out of range [0, {vocab_size})")
        n = len(ks)
        extra[BIAS_IDS:BIAS_IDS + n] = ks
        extra[BIAS_VALUES:BIAS_VALUES + n] = np.fromiter(logit_bias.values(), np.float32, n).view(np.int32)
    lp = np.asarray(logprob_ids, np.int64).reshape(-1)
    if lp.size > MAX_TOKEN_IDS_LOGPROB or ((lp < 0) | (lp >= vocab_size)).any():
        raise ValueError(f"token_ids_logprob: at most {MAX_TOKEN_IDS_LOGPROB} ids in [0, {vocab_size})")
    extra[LOGPROB_IDS:LOGPROB_IDS + lp.size] = lp
    return np.concatenate([row, extra])


def row_settings(params: Sequence[SamplingParams], seeds: Sequence[int | None], B: int):
    """Per-row sampling settings (numpy, padded to ``B`` neutral greedy rows):
    ``(floats f32[6, B]: temperature, top_p, min_p, repetition, frequency, presence;
    top_k i32[B]; seed u32[B])``."""
    f = np.zeros((6, B), np.float32)
    f[1] = f[3] = 1.0  # top_p, repetition_penalty
    top_k = np.zeros(B, np.int32)
    seed = np.zeros(B, np.uint32)
    for i, p in enumerate(params):
        s = seeds[i] if seeds[i] is not None else p.seed
        if s is None:
            if not p.greedy:
                raise ValueError(f"request {i} has no seed; the engine must assign one")
            s = 0  # greedy rows never read the random stream
        f[:, i] = (0.0 if p.greedy else p.temperature, p.top_p, p.min_p, p.repetition_penalty,
                   p.frequency_penalty, p.presence_penalty)
        top_k[i] = max(p.top_k, 0)
        seed[i] = seed_to_u32(s)
    return f, top_k, seed


def build_sampler_inputs(
    params: Sequence[SamplingParams],
    seeds: Sequence[int | None] | None,
    steps: Sequence[int],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    suppress: Sequence[Sequence[int]] | None = None,
    pad_rows_to: int | None = None,
    *,
    vocab_size: int,
) -> SamplerInputs:
    """Pack per-request settings and token histories into a padded :class:`SamplerInputs`
    with its own table (row ``i`` for request ``i``, built by :func:`token_table_row`). The
    engine does not use this (it keeps one table on the device, see ``runner``); tests and
    direct callers of :func:`sample` do.

    ``seeds[i]`` (or ``params[i].seed`` where ``seeds`` / the entry is ``None``) must be
    an int for sampled rows: the engine draws one for unseeded requests when they arrive,
    so a request's stream stays reproducible across steps (greedy rows may have none).
    ``steps[i]`` is the number of tokens request ``i`` has generated so far. Rows
    ``len(params) .. pad_rows_to - 1`` are padding with neutral greedy settings.
    ``suppress[i]`` lists ids row ``i`` must not sample.
    """
    n = len(params)
    B = n if pad_rows_to is None else int(pad_rows_to)
    if B < n:
        raise ValueError(f"pad_rows_to={B} < {n} requests")
    if not (len(steps) == len(prompts) == len(outputs) == n):
        raise ValueError("params, steps, prompts and outputs must have one entry per request")
    if seeds is None:
        seeds = [None] * n
    if suppress is None:
        suppress = [()] * n
    if len(seeds) != n or len(suppress) != n:
        raise ValueError("seeds and suppress must have one entry per request")
    f, top_k, seed = row_settings(params, seeds, B)
    step = np.zeros(B, np.int32)
    step[:n] = np.asarray(steps, np.int64)
    sup = np.zeros(B, bool)
    bias = np.zeros(B, bool)
    table = np.zeros((B, table_width(vocab_size)), np.int32)
    for i in range(n):
        table[i] = token_table_row(prompts[i], outputs[i], suppress[i], vocab_size, params[i].logit_bias,
                                   params[i].token_ids_logprob)
        sup[i] = len(suppress[i]) > 0
        bias[i] = bool(params[i].logit_bias)
    return SamplerInputs(
        temperature=jnp.asarray(f[0]), top_k=jnp.asarray(top_k), top_p=jnp.asarray(f[1]),
        min_p=jnp.asarray(f[2]), repetition_penalty=jnp.asarray(f[3]),
        frequency_penalty=jnp.asarray(f[4]), presence_penalty=jnp.asarray(f[5]),
        seed=jnp.asarray(seed), step=jnp.asarray(step), suppress=jnp.asarray(sup),
        table_rows=jnp.arange(B, dtype=jnp.int32), table=jnp.asarray(table), bias=jnp.asarray(bias),
    )


# ------------------------------------------------------------------------- device side


def apply_penalties(logits: jax.Array, inp: SamplerInputs) -> jax.Array:
    """Repetition, frequency and presence penalties, the logit bias, then suppression
    (``f32[B, V]``).

    This is exactly what greedy rows take the argmax of; exposed for tests and debugging.
    A row with neutral settings and no suppression comes out bit-identical to its input, so
    :func:`sample` may skip this for a batch where no row uses it.
    """
    logits = logits.astype(jnp.float32)
    B, V = logits.shape
    full = inp.table[inp.table_rows]  # [B, V + EXTRA_COLS]
    rows, extra = full[:, :V], full[:, V:]
    counts = rows & COUNT_MASK
    in_output = counts > 0
    seen = ((rows & PROMPT_BIT) != 0) | in_output
    rp = inp.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - (inp.frequency_penalty[:, None] * counts.astype(jnp.float32)
                       + inp.presence_penalty[:, None] * in_output.astype(jnp.float32))
    bias_ids = jnp.where(inp.bias[:, None], extra[:, BIAS_IDS:BIAS_IDS + MAX_LOGIT_BIAS], V)  # V: dropped
    bias = jax.lax.bitcast_convert_type(extra[:, BIAS_VALUES:BIAS_VALUES + MAX_LOGIT_BIAS], jnp.float32)
    logits = logits.at[jnp.arange(B)[:, None], bias_ids].add(bias, mode="drop")
    suppressed = inp.suppress[:, None] & ((rows & SUPPRESS_BIT) != 0)
    return jnp.where(suppressed, -jnp.inf, logits)


def uses_table(inp: SamplerInputs) -> jax.Array:
    """Whether any row of the batch reads its token-table row (a penalty, suppression or a
    logit bias)."""
    return jnp.any((inp.repetition_penalty != 1.0) | (inp.frequency_penalty != 0.0)
                   | (inp.presence_penalty != 0.0) | inp.suppress | inp.bias)


def record_tokens(table: jax.Array, rows: jax.Array, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Count each sampled token into its request's table row (rows where ``mask`` holds)."""
    return table.at[rows, tokens].add(mask.astype(table.dtype), mode="drop")


def _row_keys(seed: jax.Array, step: jax.Array) -> jax.Array:
    def one(s, t):
        return jax.random.fold_in(jax.random.key(s, impl=_PRNG_IMPL), t.astype(jnp.uint32))

    return jax.vmap(one)(seed.astype(jnp.uint32), step)


def _top_finite(x: jax.Array) -> jax.Array:
    top = jnp.max(x, axis=1, keepdims=True)
    return jnp.where(jnp.isfinite(top), top, 0.0)  # a fully suppressed row stays finite


def _keep_min_p(x: jax.Array, inp: SamplerInputs) -> jax.Array:
    """min-p alone, no sort: p / p_max >= min_p, i.e. x - max >= log(min_p)."""
    return (x - _top_finite(x)) >= jnp.log(inp.min_p)[:, None]


def default_top_candidates(V: int) -> int:
    """Candidates ranked by the top-k/top-p pre-filter when ``sample`` is not told:
    ``max(256, V // 64)`` capped at V (2,560 for K3's 163,840 ids). Measured on a 2-core CPU
    (B=8, ``tools/bench_sampler.py``): ``lax.top_k`` to 256 / 2,048 / 8,192 of 163,840 ids
    costs ~45 / ~53 / ~72 ms for the whole sampler against ~440 ms with the full sort, while
    more candidates hold a long-tailed row's top-p mass more often."""
    return min(V, max(256, V // 64))


def _rank_keep(xs, r0: int, top, z, k_lim, top_p, log_min_p, cum0=None):
    """top-k, top-p and min-p on ranks ``r0 .. r0+C-1`` (``xs`` [B, C]: those ranks' logits,
    descending). ``z`` [B, 1]: the sum that renormalises the top-k ranks; ``cum0`` [B, 1]:
    the mass of ranks ``< r0`` (None when ``r0 = 0``). Returns ``(keep, cum)``: the keep mask
    (rank 0 is forced by the caller) and the cumulative mass through each rank."""
    C = xs.shape[1]
    keep = (r0 + jnp.arange(C, dtype=jnp.int32))[None, :] < k_lim[:, None]
    d = xs - top
    cum = jnp.cumsum(jnp.where(keep, jnp.exp(d), 0.0) / z, axis=1)
    first = jnp.zeros_like(cum[:, :1])
    if cum0 is not None:
        cum = cum0 + cum
        first = cum0
    mass_before = jnp.concatenate([first, cum[:, :-1]], axis=1)
    p = top_p[:, None]
    keep &= (mass_before < p) | (p >= 1.0)
    keep &= d >= log_min_p
    return keep, cum


def _canonical(x):
    """-0.0 as +0.0: ``lax.top_k`` orders +0.0 before -0.0, the stable sort keeps them by id."""
    return jnp.where(x == 0, jnp.float32(0), x)


def _keep_filtered(x: jax.Array, inp: SamplerInputs, candidates: int | None = None,
                   force: str | None = None) -> jax.Array:
    """top-k, top-p and min-p in vocab order, ranking only ``candidates`` ids per row
    (``lax.top_k``) unless some row needs more: then one full sort per row (``lax.cond``).

    Ranks are the stable descending order (equal logits: lower id first); ``lax.top_k`` gives
    the same first ``C`` ranks. A sampled row's kept set lies inside its first ``C`` ranks when
    its top-k is on with ``k <= C``, or, top-k off, when the mass through rank ``C - 1``
    already reaches ``top_p`` or min-p drops rank ``C - 1`` (the cumulative mass never
    decreases past the head: the tail continues from the head's last value). Both paths do
    the same head arithmetic -- renormalising sum over the top-k head ranks (top-k on) or
    over the vocabulary in vocab order (top-k off), cumsum over the ``C`` head ranks -- so a
    row's mask does not depend on which path ran. Sampled rows with neither top-k nor top-p
    get the min-p mask plus their top token, which is what the ranked rules give them.
    ``force`` ("prefilter" / "full") picks a path regardless, for tests.

    Against the single full sort this replaces, the sums are the same numbers added in
    another order (the top-k-off normaliser in vocab order, not sorted order; the head's
    cumsum over ``C`` ranks, not over V), so a kept set could differ only where a top-p
    threshold sits within float rounding of a cumulative mass (none in the tests' random
    and tied batches).
    """
    B, V = x.shape
    C = min(candidates or default_top_candidates(V), V)
    greedy = inp.temperature < GREEDY_TEMPERATURE
    k_on = inp.top_k > 0
    k_lim = jnp.where(k_on, jnp.minimum(inp.top_k, V), V)
    big_k = k_on & (k_lim > C)  # top-k reaches past the candidates: full sort
    filt = ~greedy & (k_on | (inp.top_p < 1.0))
    log_min_p = jnp.log(inp.min_p)[:, None]
    key = _canonical(x)
    # descending, equal values by id. The barrier keeps XLA:CPU's TopK kernel: slicing its
    # outputs unevenly (cand[:, :1], cand_ids[:, :1]) made XLA (jax 0.10.2) fall back to a
    # full sort of the row (measured: 3.8 ms -> 350 ms at B=8, V=163840). One barrier per
    # output: a barrier over the pair let XLA fold it onto the TopK tuple itself, which its
    # TopkDecomposer then fails a check on (jax 0.10.2, on a mesh of 8 CPU devices)
    cand, cand_ids = jax.lax.top_k(key, C)
    cand, cand_ids = jax.lax.optimization_barrier(cand), jax.lax.optimization_barrier(cand_ids)
    top = _top_finite(cand[:, :1])
    iota = jnp.arange(V, dtype=jnp.int32)[None, :]
    plain = ((key - top) >= log_min_p) | (iota == cand_ids[:, :1])  # rows without top-k/top-p
    z_vocab = jnp.sum(jnp.exp(key - top), axis=1, keepdims=True)
    rows = jnp.arange(B)[:, None]

    def z_head(xs_head):
        in_k = jnp.arange(C, dtype=jnp.int32)[None, :] < k_lim[:, None]
        z = jnp.sum(jnp.where(in_k, jnp.exp(xs_head - top), 0.0), axis=1, keepdims=True)
        return jnp.where(k_on[:, None], z, z_vocab)

    keep_c, cum_c = _rank_keep(cand, 0, top, z_head(cand), k_lim, inp.top_p, log_min_p)

    def prefiltered():
        m = jnp.zeros((B, V), bool).at[rows, cand_ids].set(keep_c.at[:, 0].set(True), unique_indices=True)
        return jnp.where(filt[:, None], m, plain)

    def full():
        neg, order = jax.lax.sort((-key, jnp.broadcast_to(iota, (B, V))), dimension=1, is_stable=True,
                                  num_keys=1)
        xs = -neg
        e_all = jnp.where(iota < k_lim[:, None], jnp.exp(xs - top), 0.0)
        z = jnp.where(big_k[:, None], jnp.sum(e_all, axis=1, keepdims=True), z_head(xs[:, :C]))
        keep_h, cum_h = _rank_keep(xs[:, :C], 0, top, z, k_lim, inp.top_p, log_min_p)
        keep_t, _ = _rank_keep(xs[:, C:], C, top, z, k_lim, inp.top_p, log_min_p, cum0=cum_h[:, -1:])
        keep = jnp.concatenate([keep_h.at[:, 0].set(True), keep_t], axis=1)
        m = jnp.zeros((B, V), bool).at[rows, order].set(keep, unique_indices=True)
        return jnp.where(filt[:, None], m, plain)

    if force == "full":
        return full()
    if force == "prefilter" or C == V:
        return prefiltered()
    enough = ~filt | (k_on & ~big_k) | (~k_on & (((inp.top_p < 1.0) & (cum_c[:, -1] >= inp.top_p))
                                                 | (cand[:, -1] - top[:, 0] < log_min_p[:, 0])))
    return jax.lax.cond(jnp.all(enough), prefiltered, full)


def _sample_filtered(logits: jax.Array, inp: SamplerInputs, candidates: int | None = None,
                     force: str | None = None) -> jax.Array:
    """Temperature, top-k, top-p, min-p, then Gumbel-max; ``logits`` already penalized.

    Top-k/top-p run only when some sampled row uses them (``_keep_filtered``: a top-k
    pre-filter to ``candidates`` ids, a full sort only when a row needs more); both mask
    paths give the same mask for every row, and the Gumbel-max is taken in vocabulary order
    either way, so a row's token does not depend on which path its batch took.
    """
    B, V = logits.shape
    greedy = inp.temperature < GREEDY_TEMPERATURE
    x = logits / jnp.where(greedy, 1.0, inp.temperature)[:, None]
    needs_filter = jnp.any(~greedy & ((inp.top_k > 0) | (inp.top_p < 1.0)))
    keep = jax.lax.cond(needs_filter, partial(_keep_filtered, candidates=candidates, force=force),
                        _keep_min_p, x, inp)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (V,), jnp.float32))(
        _row_keys(inp.seed, inp.step))
    return jnp.argmax(jnp.where(keep, x + gumbel, -jnp.inf), axis=1)


def allowed_ids(bitmask: jax.Array, V: int) -> jax.Array:
    """``bool[B, V]`` from a packed ``int32[B, ceil(V / 32)]`` bitmask (bit ``i % 32`` of word
    ``i // 32``: id ``i`` allowed)."""
    ids = jnp.arange(V, dtype=jnp.int32)
    words = bitmask[:, ids // 32]
    return ((words >> (ids % 32)[None, :]) & 1) != 0


def apply_bitmask(logits: jax.Array, bitmask: jax.Array | None) -> jax.Array:
    """Forbidden ids -> ``-inf``; skipped (``lax.cond``) when the bitmask allows every id."""
    if bitmask is None:
        return logits
    V = logits.shape[1]
    return jax.lax.cond(jnp.all(bitmask == -1), lambda x: x,
                        lambda x: jnp.where(allowed_ids(bitmask, V), x, -jnp.inf), logits)



@partial(jax.jit, static_argnames=("num_logprobs", "top_candidates", "filter_path"))
def sample(logits: jax.Array, inp: SamplerInputs, num_logprobs: int = 0, top_candidates: int | None = None,
           filter_path: str | None = None, bitmask: jax.Array | None = None) -> SampleOutput:
    """Pick one token per row of ``logits`` (``[B, V]``, any float dtype).

    ``num_logprobs`` (static) is the number of top alternatives to return per row; the
    engine passes the largest any request in the batch asked for and slices per request.
    ``top_candidates`` (static; default :func:`default_top_candidates`): ids ranked by the
    top-k/top-p pre-filter before a full sort is needed; it moves the cost, not the kept sets
    (but for float rounding at a top-p threshold, see ``_keep_filtered``). ``filter_path``
    (static, tests only): "prefilter" or "full" forces that path of the top-k/top-p mask.
    ``bitmask`` (``int32[B, ceil(V / 32)]``, or None): the ids each row may sample (grammars).
    """
    raw = logits.astype(jnp.float32)
    penalized = jax.lax.cond(uses_table(inp), apply_penalties, lambda x, _: x, raw, inp)
    penalized = apply_bitmask(penalized, bitmask)
    greedy_tok = jnp.argmax(penalized, axis=1).astype(jnp.int32)
    greedy = inp.temperature < GREEDY_TEMPERATURE
    tokens = jax.lax.cond(
        jnp.all(greedy),
        lambda: greedy_tok,
        lambda: jnp.where(greedy, greedy_tok, _sample_filtered(penalized, inp, top_candidates, filter_path)
                          ).astype(jnp.int32),
    )
    lp = jax.nn.log_softmax(raw, axis=1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=1)[:, 0]
    if num_logprobs > 0:
        top_lp, top_ids = jax.lax.top_k(lp, num_logprobs)
    else:
        top_lp = jnp.zeros((raw.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((raw.shape[0], 0), jnp.int32)
    V = raw.shape[1]
    lp_ids = inp.table[inp.table_rows, V + LOGPROB_IDS:V + LOGPROB_IDS + MAX_TOKEN_IDS_LOGPROB]
    id_lp = jnp.take_along_axis(lp, jnp.clip(lp_ids, 0, V - 1), axis=1)
    return SampleOutput(tokens=tokens, logprob=chosen, top_ids=top_ids.astype(jnp.int32),
                        top_logprobs=top_lp, id_logprobs=id_lp)
