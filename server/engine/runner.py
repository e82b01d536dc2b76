"""The runner: turn a step plan into one jitted call (model step + sampling).

Shapes are padded to a few buckets so nothing compiles after warm-up: rows to a power of
two up to ``max_num_seqs``; tokens per row to 1 (decode-only steps) or ``chunk_size`` (any
step with a prefill chunk); page-table width (pages per sequence, which sets how much KV
the attention reads) to a few widths growing 4x up to ``ceil(max_model_len / page_size)``
(``page_buckets``), so short sequences do not pay for the longest one. Padding rows carry no
tokens and point at the scratch KDA slot, so they change nothing. The cache is donated to each
call.

One host->device transfer per call: a step's int32 metadata (input tokens, positions,
lengths, slots, page table, sampler settings; float settings bit-cast) is packed into one
``i32[B, T + P + 16]`` array (:meth:`Runner._meta`) and unpacked inside the jitted step.

Penalties and suppression read the *token table* (``sampler.token_table_row``): one device
row per running request that uses them, built on the host when the request (re)starts
running — after a preemption it is rebuilt from the request's tokens — and updated by the
step itself with each sampled token, so nothing that grows with the sequence crosses to the
device per step. The table is donated to each call like the cache.

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
token from the previous step's device output (the previous step already counted it into
the token table), so the host never waits for it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...model.cache import StepBatch
from .sampler import SamplerInputs, record_tokens, row_settings, sample, token_table_row, uses_penalties

_NUM_META = 16  # per-row scalars after the tokens and the page table (see Runner._meta)
_SUPPRESS, _RECORD = 1, 2  # per-row flag bits


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
        self.vocab_size = V = model.config.vocab_size
        # token table: row 0 for rows that use none, then one per running request that does
        self.table = jnp.zeros((max_num_seqs + 1, V), jnp.int32)
        keep = {}  # on a mesh the table stays replicated, call after call
        if par is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            keep = {"out_shardings": NamedSharding(par.mesh, PartitionSpec())}
            self.table = jax.device_put(self.table, keep["out_shardings"])
        self._table_row: dict[str, int] = {}
        self._table_free = list(range(max_num_seqs, 0, -1))
        self._set_row = jax.jit(lambda table, i, row: table.at[i].set(row), donate_argnums=(0,), **keep)
        self.table_inits = 0  # rows built on the host (admissions and re-admissions that need one)
        self._fns: dict = {}  # (T, P) -> jitted step
        graphdef = model.graphdef
        M = self.max_rows

        def fn(params, cache, table, meta, prev_a, prev_b, *, T, P):
            self.num_compiles += 1  # Python side effect: runs only while tracing
            B = meta.shape[0]
            col = lambda k: meta[:, T + P + k]  # noqa: E731
            start, lens, slots, last, from_prev, trow, top_k, seed, step, flags = (col(k) for k in range(10))
            fl = jax.lax.bitcast_convert_type(meta[:, T + P + 10: T + P + 16], jnp.float32)
            prev_tokens = jnp.concatenate([prev_a, prev_b])
            has_prev = from_prev >= 0
            prev = prev_tokens[jnp.maximum(from_prev, 0)]
            ids = meta[:, :T].at[:, 0].set(jnp.where(has_prev, prev, meta[:, 0]))
            batch = StepBatch(ids, start, lens, slots, meta[:, T:T + P])
            logits, cache = nnx.merge(graphdef, params)(batch, cache, par=par, logits_at=last)
            if par is not None:  # the cache goes out in the layout it came in (warm-up's AOT programs fix it)
                cache = par.pin_cache(cache)
            rows = logits[:, 0]  # the LM head ran on each row's sampled position only
            sinp = SamplerInputs(temperature=fl[:, 0], top_k=top_k, top_p=fl[:, 1], min_p=fl[:, 2],
                                 repetition_penalty=fl[:, 3], frequency_penalty=fl[:, 4], presence_penalty=fl[:, 5],
                                 seed=jax.lax.bitcast_convert_type(seed, jnp.uint32), step=step,
                                 suppress=(flags & _SUPPRESS) != 0, table_rows=trow, table=table)
            out = sample(rows, sinp, max_logprobs)
            table = record_tokens(table, trow, out.tokens, (flags & _RECORD) != 0)
            if keep:
                table = jax.lax.with_sharding_constraint(table, keep["out_shardings"])
            full = out.tokens if B == M else jnp.zeros(M, jnp.int32).at[:B].set(out.tokens)
            if keep:  # fed back as the next call's prev_a/prev_b: the layout warm-up compiled for
                full = jax.lax.with_sharding_constraint(full, keep["out_shardings"])
            return out, full, cache, table

        self._step_fn = fn

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
        meta, tok, table, col, fl = self._meta(B, T, P)
        start, lens, slots, last, from_prev, trow, top_k, seed, step, flags = col[:10]
        f, k_, s_ = row_settings([r.req.params for r in rows], [r.req.seed for r in rows], len(rows))
        fl[at] = f.T
        top_k[at], seed[at] = k_, s_.view(np.int32)
        for k, r in enumerate(rows):
            i = at[k]
            req = r.req
            known = req.num_known
            if r.start + r.num_tokens > known:  # the input token is the previous step's sample
                if (r.num_tokens != 1 or r.start != known or prev is None or req.sample_row is None
                        or req.sample_row[0] != prev.step):
                    raise RuntimeError(f"{req.rid}: input token {r.start} is not available from the previous step")
                from_prev[i] = req.sample_row[1]
            else:
                tok[i, : r.num_tokens] = req.token_slice(r.start, r.start + r.num_tokens)
            start[i], lens[i], last[i] = r.start, r.num_tokens, r.num_tokens - 1
            slots[i] = self.cache_mgr.slot_of(req.rid)
            table[i] = self.cache_mgr.page_table_row(req.rid, self.page_width)[:P]
            step[i] = req.num_generated
            p = req.params
            sup = bool(req.num_generated < p.min_new_tokens and self._suppress_ids(p))
            row = self._table_row.get(req.rid)
            if row is None and (sup or uses_penalties(p)):
                row = self._init_row(req)
            if row is not None:  # once a request has a row, every token it samples is counted
                trow[i] = row
                flags[i] = (_SUPPRESS if sup else 0) | (_RECORD if getattr(r, "samples", True) else 0)
        fn = self._compiled.get((B, T, P)) or self._jit(T, P)
        out, full, self.cache_mgr.device_cache, self.table = fn(
            self.model.params, self.cache_mgr.device_cache, self.table, jax.device_put(meta), *prev_pair)
        return out, full, at

    def _meta(self, B: int, T: int, P: int):
        """A padded call's packed metadata ``i32[B, T + P + 16]`` and writable views of it:
        input tokens ``[B, T]``, page table ``[B, P]``, the 10 int columns (start, lens, slot,
        last, from_prev, table row, top_k, seed (u32 bits), step, flags) and the 6 float
        columns ``[B, 6]`` (temperature, top_p, min_p, repetition, frequency, presence; f32
        bits). Padding rows: no tokens, the scratch slot of their DP group, neutral greedy."""
        meta = np.zeros((B, T + P + _NUM_META), np.int32)
        col = meta[:, T + P:].T
        col[2] = self._scratch_slots(B)
        col[4] = -1  # from_prev: none
        fl = meta[:, T + P + 10:].view(np.float32)
        fl[:, 1] = fl[:, 3] = 1.0  # top_p, repetition_penalty
        return meta, meta[:, :T], meta[:, T:T + P], col, fl

    def _jit(self, T: int, P: int):
        f = self._fns.get((T, P))
        if f is None:
            f = self._fns[(T, P)] = jax.jit(functools.partial(self._step_fn, T=T, P=P), donate_argnums=(1, 2))
        return f

    def _suppress_ids(self, p) -> list[int]:
        """Ids a request may not sample before ``min_new_tokens``: its stop ids and eos."""
        if p.min_new_tokens <= 0:
            return []
        ids = list(p.stop_token_ids)
        eos = self.model.config.eos_token_id
        if eos is not None and not p.ignore_eos:
            ids.append(eos)
        return ids

    def _init_row(self, req) -> int:
        """Give ``req`` a token-table row built from its tokens (O(L), once per admission)."""
        if req.pending:
            raise RuntimeError(f"{req.rid}: token table row built with {req.pending} tokens in flight")
        if not self._table_free:
            raise RuntimeError("token table full (more running requests than max_num_seqs)")
        i = self._table_free.pop()
        row = token_table_row(req.prompt, req.output, self._suppress_ids(req.params), self.vocab_size)
        self.table = self._set_row(self.table, np.int32(i), row)
        self._table_row[req.rid] = i
        self.table_inits += 1
        return i

    def release(self, rid) -> None:
        """``rid`` stopped running (finished or preempted): free its token-table row. A step
        still in flight may count one more token into the row; the next owner's row is
        written after it (device order), so that is harmless."""
        i = self._table_row.pop(rid, None)
        if i is not None:
            self._table_free.append(i)

    def check_table(self, requests) -> None:
        """The device token table equals the one built from the host's histories, for every
        request holding a row whose sampled tokens are all on the host (tests)."""
        rows = set(self._table_row.values())
        assert len(rows) == len(self._table_row) and not rows & set(self._table_free) and 0 not in rows
        assert len(rows) + len(self._table_free) == self.table.shape[0] - 1
        got = np.asarray(jax.device_get(self.table))
        for rid, i in self._table_row.items():
            req = requests[rid]
            if req.pending:
                continue
            want = token_table_row(req.prompt, req.output, self._suppress_ids(req.params), self.vocab_size)
            bad = np.flatnonzero(got[i] != want)
            assert not bad.size, f"{rid}: token table row {i} differs at ids {bad[:8].tolist()}"

    def shape_buckets(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens, pages) shape a step can take (a chunk must fit its pages)."""
        return [(B, T, P) for B in self.row_buckets for T in self.tok_buckets for P in self.page_buckets
                if P >= self._min_pages(T)]

    def _min_pages(self, T: int) -> int:
        return min(-(-T // self.page_size), self.page_width)

    def _padding_args(self, B: int, T: int, P: int) -> tuple:
        return self.table, jnp.asarray(self._meta(B, T, P)[0]), self._zero_prev, self._zero_prev

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
            return shape, self._jit(*shape[1:]).lower(self.model.params, self.cache_mgr.device_cache, *args).compile()

        with cf.ThreadPoolExecutor(workers, thread_name_prefix="k3-compile") as ex:
            for shape, exe in ex.map(one, shapes):
                self._compiled[shape] = exe
        # run each program once (first-run allocations), with the cache flowing through
        for shape in shapes:
            args = self._padding_args(*shape)
            out, _, self.cache_mgr.device_cache, self.table = self._compiled[shape](
                self.model.params, self.cache_mgr.device_cache, *args)
            jax.block_until_ready(out)
        return self.num_compiles - before
