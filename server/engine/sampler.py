"""Batched token sampling: one jitted function turns a padded batch of logits into tokens.

Why it looks like this:

* **Per-row settings as arrays.** Every row of a decode batch may belong to a different
  request with different settings. Passing them as ``f32[B]`` / ``i32[B]`` arrays (in
  :class:`SamplerInputs`) instead of Python constants means one compiled program serves
  any mix of requests; only the shapes (rows, id-list lengths, ``num_logprobs``) select a
  program, and :func:`build_sampler_inputs` pads those to a few buckets.

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
  drops tokens whose probability is below ``min_p * max_prob``. One sort per row serves
  top-k and top-p; a batch where no sampled row uses them skips the sort, and a batch with
  no sampled rows skips everything after the argmax (``lax.cond`` on batch-wide flags,
  arranged so a row's result never depends on which branch ran).

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
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .sampling_params import GREEDY_TEMPERATURE, SamplingParams

_MIN_BUCKET = 8
_PRNG_IMPL = "threefry2x32"  # fixed, so draws do not change with jax's default PRNG config


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerInputs:
    """Per-row sampling state for a padded batch of ``B`` rows (device arrays).

    ``prompt_ids`` / ``output_ids`` / ``suppress_ids`` are padded with -1 (any id outside
    ``[0, V)`` is ignored). ``top_k`` <= 0 means off.
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
    prompt_ids: jax.Array  # i32[B, Lp]
    output_ids: jax.Array  # i32[B, Lo]
    suppress_ids: jax.Array  # i32[B, Ls]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
    tokens: jax.Array  # i32[B]
    logprob: jax.Array  # f32[B]      log_softmax(raw logits)[token]
    top_ids: jax.Array  # i32[B, n]   n = num_logprobs, most likely first
    top_logprobs: jax.Array  # f32[B, n]


# --------------------------------------------------------------------------- host side


def bucket_len(n: int, minimum: int = _MIN_BUCKET) -> int:
    """The smallest power of two >= max(n, minimum): few distinct shapes -> few compiles."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def seed_to_u32(seed: int) -> int:
    """Fold an arbitrary Python int into 32 bits (the PRNG seed width used here)."""
    s = int(seed) % (1 << 64)
    return (s ^ (s >> 32)) & 0xFFFFFFFF


def _pad_ids(rows: Sequence[Sequence[int] | None], n_rows: int, length: int) -> np.ndarray:
    out = np.full((n_rows, length), -1, np.int32)
    for i, r in enumerate(rows):
        if r is None or len(r) == 0:
            continue
        out[i, : len(r)] = np.asarray(r, np.int64)
    return out


def _resolve_lens(pad_len_to, needed: tuple[int, int, int]) -> tuple[int, int, int]:
    if callable(pad_len_to):
        lens = tuple(int(pad_len_to(n)) for n in needed)
    elif isinstance(pad_len_to, (int, np.integer)):
        lens = (int(pad_len_to),) * 3
    else:
        lens = tuple(int(x) for x in pad_len_to)
        if len(lens) != 3:
            raise ValueError("pad_len_to must be a callable, an int, or (Lp, Lo, Ls)")
    for name, got, need in zip(("prompt", "output", "suppress"), lens, needed):
        if got < need:
            raise ValueError(f"pad_len_to gives {name} length {got} < {need} needed")
    return lens  # type: ignore[return-value]


def build_sampler_inputs(
    params: Sequence[SamplingParams],
    seeds: Sequence[int | None] | None,
    steps: Sequence[int],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    suppress: Sequence[Sequence[int]] | None = None,
    pad_rows_to: int | None = None,
    pad_len_to: Callable[[int], int] | int | tuple[int, int, int] = bucket_len,
) -> SamplerInputs:
    """Pack per-request settings and token histories into a padded :class:`SamplerInputs`.

    ``seeds[i]`` (or ``params[i].seed`` where ``seeds`` / the entry is ``None``) must be
    an int for sampled rows: the engine draws one for unseeded requests when they arrive,
    so a request's stream stays reproducible across steps (greedy rows may have none). ``steps[i]`` is the number of tokens request
    ``i`` has generated so far. Rows ``len(params) .. pad_rows_to - 1`` are padding with
    neutral greedy settings. ``pad_len_to`` maps each needed id-list length to the padded
    one (default: power-of-two bucket >= 8), or fixes it (an int for all three lists, or
    ``(Lp, Lo, Ls)``).

    Histories a row's settings never read are left out (prompt ids unless the repetition
    penalty is on; output ids unless some penalty is on), which keeps arrays short for the
    common no-penalty case without changing any result.
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

    f32 = lambda: np.zeros(B, np.float32)  # noqa: E731
    temperature, top_p, min_p = f32(), np.ones(B, np.float32), f32()
    rep, freq, pres = np.ones(B, np.float32), f32(), f32()
    top_k = np.zeros(B, np.int32)
    seed = np.zeros(B, np.uint32)
    step = np.zeros(B, np.int32)
    use_prompt: list = [None] * n
    use_output: list = [None] * n
    for i, p in enumerate(params):
        s = seeds[i] if seeds[i] is not None else p.seed
        if s is None:
            if not p.greedy:
                raise ValueError(f"request {i} has no seed; the engine must assign one")
            s = 0  # greedy rows never read the random stream
        temperature[i] = 0.0 if p.greedy else p.temperature
        top_k[i] = max(p.top_k, 0)
        top_p[i], min_p[i] = p.top_p, p.min_p
        rep[i], freq[i], pres[i] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
        seed[i] = seed_to_u32(s)
        step[i] = int(steps[i])
        if p.repetition_penalty != 1.0:
            use_prompt[i] = prompts[i]
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            use_output[i] = outputs[i]
    needed = (
        max((len(r) for r in use_prompt if r is not None), default=0),
        max((len(r) for r in use_output if r is not None), default=0),
        max((len(r) for r in suppress), default=0),
    )
    lp, lo, ls = _resolve_lens(pad_len_to, needed)
    return SamplerInputs(
        temperature=jnp.asarray(temperature),
        top_k=jnp.asarray(top_k),
        top_p=jnp.asarray(top_p),
        min_p=jnp.asarray(min_p),
        repetition_penalty=jnp.asarray(rep),
        frequency_penalty=jnp.asarray(freq),
        presence_penalty=jnp.asarray(pres),
        seed=jnp.asarray(seed),
        step=jnp.asarray(step),
        prompt_ids=jnp.asarray(_pad_ids(use_prompt, B, lp)),
        output_ids=jnp.asarray(_pad_ids(use_output, B, lo)),
        suppress_ids=jnp.asarray(_pad_ids(suppress, B, ls)),
    )


# ------------------------------------------------------------------------- device side


def _scatter_index(ids: jax.Array, V: int) -> jax.Array:
    # negative pads would wrap around in a scatter; send them out of range and drop them
    return jnp.where(ids >= 0, ids, V)


def apply_penalties(logits: jax.Array, inp: SamplerInputs) -> jax.Array:
    """Repetition, frequency and presence penalties, then suppression (``f32[B, V]``).

    This is exactly what greedy rows take the argmax of; exposed for tests and debugging.
    """
    logits = logits.astype(jnp.float32)
    B, V = logits.shape
    rows = jnp.arange(B)[:, None]
    counts = jnp.zeros((B, V), jnp.int32).at[rows, _scatter_index(inp.output_ids, V)].add(
        1, mode="drop")
    in_output = counts > 0
    seen = jnp.zeros((B, V), bool).at[rows, _scatter_index(inp.prompt_ids, V)].set(
        True, mode="drop") | in_output
    rp = inp.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - (inp.frequency_penalty[:, None] * counts.astype(jnp.float32)
                       + inp.presence_penalty[:, None] * in_output.astype(jnp.float32))
    return logits.at[rows, _scatter_index(inp.suppress_ids, V)].set(-jnp.inf, mode="drop")


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


def _keep_sorted(x: jax.Array, inp: SamplerInputs) -> jax.Array:
    """top-k, top-p and min-p from one sort per row; the mask comes back in vocab order."""
    B, V = x.shape
    iota = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (B, V))
    neg, order = jax.lax.sort((-x, iota), dimension=1, is_stable=True, num_keys=1)
    xs = -neg  # descending; xs[:, r] is the logit of token order[:, r]
    rank = iota
    # top-k (<= 0: off)
    keep = rank < jnp.where(inp.top_k > 0, inp.top_k, V)[:, None]
    # top-p on the top-k-renormalized distribution: keep ranks whose preceding mass < p
    d = xs - _top_finite(xs[:, :1])
    e = jnp.where(keep, jnp.exp(d), 0.0)
    probs = e / jnp.sum(e, axis=1, keepdims=True)
    cum = jnp.cumsum(probs, axis=1)
    mass_before = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=1)
    p = inp.top_p[:, None]
    keep &= (mass_before < p) | (p >= 1.0)
    # min-p: the ratio p / p_max is unchanged by renormalization; same test as _keep_min_p
    keep &= d >= jnp.log(inp.min_p)[:, None]
    keep |= rank == 0
    rows = jnp.arange(B)[:, None]
    return jnp.zeros((B, V), bool).at[rows, order].set(keep, unique_indices=True)


def _sample_filtered(logits: jax.Array, inp: SamplerInputs) -> jax.Array:
    """Temperature, top-k, top-p, min-p, then Gumbel-max; ``logits`` already penalized.

    The sort runs only when some sampled row uses top-k or top-p; both mask paths give
    the same mask for rows without them, and the Gumbel-max is taken in vocabulary order
    either way, so a row's token does not depend on which path its batch took.
    """
    B, V = logits.shape
    greedy = inp.temperature < GREEDY_TEMPERATURE
    x = logits / jnp.where(greedy, 1.0, inp.temperature)[:, None]
    needs_sort = jnp.any(~greedy & ((inp.top_k > 0) | (inp.top_p < 1.0)))
    keep = jax.lax.cond(needs_sort, _keep_sorted, _keep_min_p, x, inp)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (V,), jnp.float32))(
        _row_keys(inp.seed, inp.step))
    return jnp.argmax(jnp.where(keep, x + gumbel, -jnp.inf), axis=1)


@partial(jax.jit, static_argnames=("num_logprobs",))
def sample(logits: jax.Array, inp: SamplerInputs, num_logprobs: int = 0) -> SampleOutput:
    """Pick one token per row of ``logits`` (``[B, V]``, any float dtype).

    ``num_logprobs`` (static) is the number of top alternatives to return per row; the
    engine passes the largest any request in the batch asked for and slices per request.
    """
    raw = logits.astype(jnp.float32)
    penalized = apply_penalties(raw, inp)
    greedy_tok = jnp.argmax(penalized, axis=1).astype(jnp.int32)
    greedy = inp.temperature < GREEDY_TEMPERATURE
    tokens = jax.lax.cond(
        jnp.all(greedy),
        lambda: greedy_tok,
        lambda: jnp.where(greedy, greedy_tok, _sample_filtered(penalized, inp)).astype(jnp.int32),
    )
    lp = jax.nn.log_softmax(raw, axis=1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=1)[:, 0]
    if num_logprobs > 0:
        top_lp, top_ids = jax.lax.top_k(lp, num_logprobs)
    else:
        top_lp = jnp.zeros((raw.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((raw.shape[0], 0), jnp.int32)
    return SampleOutput(tokens=tokens, logprob=chosen, top_ids=top_ids.astype(jnp.int32),
                        top_logprobs=top_lp)
