"""The runner: turn a step plan into one jitted call (model step + sampling).

Shapes are padded to a few buckets so nothing compiles after warm-up: rows to a power of
two up to ``max_num_seqs``; tokens per row to 1 (decode-only steps) or ``chunk_size`` (any
step with a prefill chunk); page-table width (pages per sequence, which sets how much KV
the attention reads) to a few widths growing 4x up to ``ceil(max_model_len / page_size)``
(``page_buckets``), so short sequences do not pay for the longest one; penalty histories
fixed at ``max_model_len``. Padding rows carry no tokens and point at the
scratch KDA slot, so they change nothing. The cache is donated to each call.

Attention DP (a recipe with ``dp > 1``): the rows of a step are laid out by DP group — group
g's rows in block g of ``B = dp * Bg`` rows (``Bg`` the group row bucket), its padding rows on
its own scratch slot — because the step splits rows over the mesh's ``"dp"`` axis and each
group's rows may name only that group's slots and pages. ``par`` (the recipe's
``sharding.parallel.StepParallel``) goes into the model call.

``num_compiles`` counts traces of the step function (a trace is what triggers a compile).

``launch`` only dispatches: it returns an :class:`InFlight` whose results stay on the device
until ``InFlight.result()`` fetches them, so the engine can plan and launch step N+1 before
it waits for step N. A decode row whose input token was sampled by the previous step (and is
not on the host yet) names that step's row in ``from_prev``; the jitted step reads the
token from the previous step's device output, and also patches it into the row's penalty
history, so the host never waits for it.
"""
from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...model.cache import make_batch
from .sampler import build_sampler_inputs, sample


def default_page_buckets(width: int, minimum: int = 4) -> list[int]:
    """Pages-per-sequence buckets: ``width`` and a few 4x-smaller ones (not below ``minimum``)."""
    out, b = [width], width
    while -(-b // 4) >= minimum:
        b = -(-b // 4)
        out.append(b)
    return sorted(out)


def _pow2_buckets(limit: int) -> list[int]:
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return sorted(set(out))


@dataclasses.dataclass
class HostSample:
    """A step's sampled tokens and logprobs on the host, in plan row order."""

    tokens: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclasses.dataclass
class InFlight:
    """A launched step: its rows, its step number and its device outputs.

    A step may run as one or two jitted calls (parts); ``index[i]`` is where plan row ``i``'s
    sampled token sits in the concatenation of the parts' ``tokens`` — what the next step
    reads through ``from_prev``.
    """

    step: int
    rows: list
    parts: list  # [(plan row numbers, their rows in the part's batch, SampleOutput on device)]
    tokens: tuple  # (i32[max_rows], i32[max_rows]): sampled tokens of part 0 / part 1 by row
    index: list[int]
    runner: "Runner"
    _host: HostSample | None = None

    def result(self) -> HostSample:
        """Block until the step is done; the sampled tokens / logprobs on the host."""
        if self._host is None:
            t = time.perf_counter()
            got = jax.device_get([o for _, _, o in self.parts])
            self.runner.wait_s += time.perf_counter() - t
            n = len(self.rows)
            fields = {}
            for name in ("tokens", "logprob", "top_ids", "top_logprobs"):
                first = getattr(got[0], name)
                arr = np.zeros((n,) + first.shape[1:], first.dtype)
                for (pos, at, _), o in zip(self.parts, got):
                    arr[pos] = getattr(o, name)[at]
                fields[name] = arr
            self._host = HostSample(**fields)
        return self._host


class Runner:
    def __init__(self, model, cache_mgr, *, max_num_seqs: int, chunk_size: int, max_model_len: int,
                 max_logprobs: int = 20, page_buckets=None, split_mixed: bool = True, par=None):
        self.model = model
        self.cache_mgr = cache_mgr
        self.page_size = cache_mgr.capacity_plan.page_size
        self.par = par
        self.dp = dp = par.dp if par is not None else 1
        self.group_buckets = _pow2_buckets(-(-max_num_seqs // dp))  # rows per DP group
        self.row_buckets = [dp * b for b in self.group_buckets]
        self.tok_buckets = sorted({1, chunk_size})
        self.page_width = math.ceil(max_model_len / self.page_size)
        pb = sorted({min(int(b), self.page_width) for b in page_buckets}) if page_buckets else \
            default_page_buckets(self.page_width)
        if pb[-1] != self.page_width:
            pb.append(self.page_width)
        self.page_buckets = pb
        self.shapes_used: set[tuple[int, int, int]] = set()  # (rows, tokens, pages) launched
        self.hist_len = max_model_len
        self.max_logprobs = max_logprobs
        self.max_rows = self.row_buckets[-1]
        self.split_mixed = split_mixed
        self._compiled: dict = {}  # (rows, tokens, pages) -> AOT-compiled step (warm-up)
        self.num_split_steps = 0  # mixed steps run as a prefill call + a decode call
        self.num_compiles = 0
        self.launch_s = 0.0  # host time building inputs and dispatching
        self.wait_s = 0.0  # host time blocked waiting for step results
        self.num_steps = 0
        self._zero_prev = jnp.zeros(self.max_rows, jnp.int32)
        graphdef = model.graphdef
        M = self.max_rows

        def fn(params, cache, batch, last_idx, sinp, prev_a, prev_b, from_prev, pend_pos):
            self.num_compiles += 1  # Python side effect: runs only while tracing
            prev_tokens = jnp.concatenate([prev_a, prev_b])
            has_prev = from_prev >= 0
            prev = prev_tokens[jnp.maximum(from_prev, 0)]
            ids = batch.input_ids.at[:, 0].set(jnp.where(has_prev, prev, batch.input_ids[:, 0]))
            batch = dataclasses.replace(batch, input_ids=ids)
            lo = sinp.output_ids.shape[1]
            hit = has_prev[:, None] & (jnp.arange(lo)[None, :] == pend_pos[:, None])
            sinp = dataclasses.replace(sinp, output_ids=jnp.where(hit, prev[:, None], sinp.output_ids))
            logits, cache = nnx.merge(graphdef, params)(batch, cache, par=par)
            if par is not None:  # the cache goes out in the layout it came in (warm-up's AOT programs fix it)
                cache = par.pin_cache(cache)
            rows = logits[jnp.arange(logits.shape[0]), last_idx]
            out = sample(rows, sinp, max_logprobs)
            B = out.tokens.shape[0]
            full = out.tokens if B == M else jnp.zeros(M, jnp.int32).at[:B].set(out.tokens)
            return out, full, cache

        self._fn = jax.jit(fn, donate_argnums=(1,))

    def _bucket(self, n: int, buckets: list[int]) -> int:
        for b in buckets:
            if n <= b:
                return b
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")

    def launch(self, rows, prev: InFlight | None = None) -> InFlight:
        """Dispatch one step for ``rows`` (ScheduledRow-like: req, start, num_tokens) and return
        at once. Tokens a row needs that are still on the device must come from ``prev``.

        A mixed step (prefill chunks beside decode rows) runs as two calls — prefill rows at
        ``chunk_size`` tokens, decode rows at 1 — when that at least halves the padded token
        count (``split_mixed``); the cache flows from the first call into the second."""
        t = time.perf_counter()
        prev_pair = prev.tokens if prev is not None else (self._zero_prev, self._zero_prev)
        order = list(range(len(rows)))
        groups = [order]
        if self.split_mixed:
            pre = [i for i in order if rows[i].num_tokens > 1]
            dec = [i for i in order if rows[i].num_tokens == 1]
            if pre and dec:
                T = self._bucket(max(rows[i].num_tokens for i in pre), self.tok_buckets)
                merged = self._bucket(len(rows), self.row_buckets) * T
                split = self._bucket(len(pre), self.row_buckets) * T + self._bucket(len(dec), self.row_buckets)
                if 2 * split <= merged:
                    groups = [pre, dec]
                    self.num_split_steps += 1
        parts, outs, index = [], [], [0] * len(rows)
        for g, pos in enumerate(groups):
            out, full, at = self._launch_part([rows[i] for i in pos], prev, prev_pair)
            parts.append((np.asarray(pos), at, out))
            outs.append(full)
            for j, i in enumerate(pos):
                index[i] = g * self.max_rows + int(at[j])
        tokens = (outs[0], outs[1] if len(outs) > 1 else self._zero_prev)
        self.num_steps += 1
        self.launch_s += time.perf_counter() - t
        return InFlight(self.num_steps, list(rows), parts, tokens, index, self)

    def _layout(self, rows):
        """(B, each row's position in the batch): rows of DP group g in block g of B / dp rows."""
        if self.dp == 1:
            return self._bucket(len(rows), self.row_buckets), np.arange(len(rows))
        groups = [self.cache_mgr.group_of(r.req.rid) for r in rows]
        Bg = self._bucket(max(groups.count(g) for g in range(self.dp)), self.group_buckets)
        at, seen = np.zeros(len(rows), np.int64), [0] * self.dp
        for i, g in enumerate(groups):
            at[i] = g * Bg + seen[g]
            seen[g] += 1
        return self.dp * Bg, at

    def _scratch_slots(self, B: int) -> np.ndarray:
        """Each padding row on the scratch slot of the DP group its batch block belongs to."""
        Bg = B // self.dp
        return np.asarray([self.cache_mgr.scratch_slot(i // Bg) for i in range(B)], np.int32)

    def _launch_part(self, rows, prev, prev_pair):
        B, at = self._layout(rows)
        T = self._bucket(max(r.num_tokens for r in rows), self.tok_buckets)
        need = max(-(-(r.start + r.num_tokens) // self.page_size) for r in rows)
        P = self._bucket(max(need, self._min_pages(T)), self.page_buckets)  # a shape warm-up compiled
        self.shapes_used.add((B, T, P))
        tok = np.zeros((B, T), np.int32)
        start = np.zeros(B, np.int32)
        lens = np.zeros(B, np.int32)
        slots = self._scratch_slots(B)
        table = np.zeros((B, P), np.int32)
        last = np.zeros(B, np.int32)
        from_prev = np.full(B, -1, np.int32)
        pend_pos = np.zeros(B, np.int32)
        for k, r in enumerate(rows):
            i = at[k]
            req = r.req
            known = req.num_known
            if r.start + r.num_tokens > known:  # the input token is the previous step's sample
                if (r.num_tokens != 1 or r.start != known or prev is None or req.sample_row is None
                        or req.sample_row[0] != prev.step):
                    raise RuntimeError(f"{req.rid}: input token {r.start} is not available from the previous step")
                from_prev[i] = req.sample_row[1]
                pend_pos[i] = len(req.output)
            else:
                tok[i, : r.num_tokens] = req.tokens[r.start : r.start + r.num_tokens]
            start[i], lens[i], last[i] = r.start, r.num_tokens, r.num_tokens - 1
            slots[i] = self.cache_mgr.slot_of(req.rid)
            table[i] = self.cache_mgr.page_table_row(req.rid, self.page_width)[:P]
        batch = make_batch(tok, start, lens, slots, table)
        # sampler rows in batch order; padding rows get no request
        by_pos: list = [None] * B
        for k, r in enumerate(rows):
            by_pos[at[k]] = r.req
        reqs = by_pos if self.dp > 1 else [r.req for r in rows]
        sinp = build_sampler_inputs(*self._sampler_lists(reqs), pad_rows_to=B, pad_len_to=self.hist_len)
        fn = self._compiled.get((B, T, P), self._fn)
        out, full, self.cache_mgr.device_cache = fn(self.model.params, self.cache_mgr.device_cache, batch, jnp.asarray(last),
                                                   sinp, *prev_pair, jnp.asarray(from_prev), jnp.asarray(pend_pos))
        return out, full, at

    def _sampler_lists(self, reqs) -> tuple:
        """build_sampler_inputs' per-row lists; a None entry (padding row) samples greedily."""
        from .sampling_params import SamplingParams

        pad = SamplingParams(temperature=0.0)
        return ([q.params if q else pad for q in reqs], [q.seed if q else 0 for q in reqs],
                [q.num_generated if q else 0 for q in reqs], [q.prompt if q else [] for q in reqs],
                [q.output if q else [] for q in reqs], [self._suppress(q) if q else [] for q in reqs])

    def _suppress(self, req) -> list[int]:
        p = req.params
        if req.num_generated >= p.min_new_tokens:
            return []
        ids = list(p.stop_token_ids)
        eos = self.model.config.eos_token_id
        if eos is not None and not p.ignore_eos:
            ids.append(eos)
        return ids

    def shape_buckets(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens, pages) shape a step can take (a chunk must fit its pages)."""
        return [(B, T, P) for B in self.row_buckets for T in self.tok_buckets for P in self.page_buckets
                if P >= self._min_pages(T)]

    def _min_pages(self, T: int) -> int:
        return min(-(-T // self.page_size), self.page_width)

    def _padding_args(self, B: int, T: int, P: int) -> tuple:
        batch = make_batch(np.zeros((B, T), np.int32), np.zeros(B), np.zeros(B), self._scratch_slots(B),
                           np.zeros((B, P)))
        sinp = build_sampler_inputs([], [], [], [], [], [], pad_rows_to=B, pad_len_to=self.hist_len)
        z = jnp.zeros(B, jnp.int32)
        return batch, z, sinp, self._zero_prev, self._zero_prev, z - 1, z

    def warmup(self, workers: int | None = None) -> int:
        """Compile every shape bucket ahead of time, ``workers`` programs at once; returns
        compiles. XLA's CPU compiler already keeps 2 cores busy with one program (measured:
        6 programs of k3-tiny-a in 71.8 s with 1 worker, 69.0 s with 4), so the default is one
        worker below 8 host cores.

        The compiled executables are kept and called directly by ``launch``; a shape that
        was not compiled here would fall back to ``jax.jit`` (and count as a compile)."""
        import concurrent.futures as cf
        import os

        before = self.num_compiles
        shapes = [s for s in self.shape_buckets() if s not in self._compiled]
        cpus = os.cpu_count() or 1
        workers = workers or (1 if cpus < 8 else min(8, cpus // 4))

        def one(shape):
            args = self._padding_args(*shape)
            return shape, self._fn.lower(self.model.params, self.cache_mgr.device_cache, *args).compile()

        with cf.ThreadPoolExecutor(workers, thread_name_prefix="k3-compile") as ex:
            for shape, exe in ex.map(one, shapes):
                self._compiled[shape] = exe
        # run each program once (first-run allocations), with the cache flowing through
        for shape in shapes:
            args = self._padding_args(*shape)
            out, _, self.cache_mgr.device_cache = self._compiled[shape](self.model.params, self.cache_mgr.device_cache, *args)
            jax.block_until_ready(out)
        return self.num_compiles - before
