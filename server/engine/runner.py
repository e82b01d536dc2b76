"""The runner: turn a step plan into two device calls, the model step and sampling.

A step is one call of the flattened model step (``model.step``): the plan's rows' tokens laid
end to end — decode rows first, then prefill chunks, no per-row padding — padded to a token
bucket ``T`` (``model.step.token_buckets``: 1, the row count, that times powers of
``bucket_growth``, and ``max_num_batched_tokens`` exactly as the largest). Row
arrays have ``min(T, max_num_seqs)`` rows per attention-DP group (a row has at least one
token, so a small step carries no idle rows — on CPU each row slot costs state traffic in
every KDA layer) and the page table is always ``ceil(max_model_len / page_size)`` wide (the
attention's cost follows the real context, not the table width), so the token bucket is the
only shape of the step program that varies. Its logits stay on the device and go to the
sampling program, which depends on the row count only: warm-up compiles one step program per
bucket and one sampling program per row count, and nothing after. Padding tokens belong to
no row; rows without tokens write no KDA state. The cache is donated to each step call.

One host->device transfer per call: a step's int32 metadata (tokens, positions, rows, page
table, sampler settings; float settings bit-cast) is packed into one flat ``i32`` array
(:class:`_Layout`) and unpacked inside the jitted step.

Penalties and suppression read the *token table* (``sampler.token_table_row``): one device
row per running request that uses them, built on the host when the request (re)starts
running — after a preemption it is rebuilt from the request's tokens — and updated by the
sampling program with each sampled token, so nothing that grows with the sequence crosses to
the device per step. The table is donated to each sampling call.

Attention DP (a recipe with ``dp > 1``): group g's tokens fill block g of the token axis and
its rows block g of the row axis (``model.step``), because the step splits both over the
mesh's ``"dp"`` axis and each group's rows may name only that group's slots and pages. ``par``
(the recipe's ``sharding.parallel.StepParallel``) goes into the model call.

``num_compiles`` counts every program of the engine (``programs.Programs``, shared with the
cache manager): the step and sampling functions, the token-table row write, the cache copies.

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
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...intmath import cdiv
from ...model.step import FlatBatch, token_buckets
from .process_barrier import wait_for_processes
from .sampler import (SamplerInputs, record_tokens, row_settings, sample, table_width, token_table_row,
                      uses_penalties)
from .spec_follow import follow_rows

# per-row flag bits: suppress the stop ids now; count the sampled token into the token table; the
# request has ids to suppress before ``min_new_tokens`` (a speculative step decides per position on
# the device); the row's drafts are the previous step's block on the device (DSpark, async)
# the row's token table row carries a logit bias
_SUPPRESS, _RECORD, _SUPP_IDS, _DEV_DRAFTS, _BIAS = 1, 2, 4, 8, 16
# per-row int columns of the packed metadata, then 6 float columns (f32 bits)
_COLS = ("start", "q_len", "read_slot", "write_slot", "fresh", "logits_idx", "first_tok", "from_prev", "trow",
         "top_k", "seed", "step", "flags", "decode", "fold", "jrow", "ndraft", "assumed", "guess", "min_new")
_NUM_COLS = len(_COLS) + 6


def _columns(rows) -> dict:
    """``{name: column}`` views of a ``[R, _NUM_COLS]`` row block (numpy or traced)."""
    return {name: rows[:, k] for k, name in enumerate(_COLS)}


def _sampler_inputs(rows, table) -> SamplerInputs:
    """The sampler's per-row settings from a step's (traced) row block."""
    col = _columns(rows)
    fl = jax.lax.bitcast_convert_type(rows[:, len(_COLS):], jnp.float32)
    return SamplerInputs(temperature=fl[:, 0], top_k=col["top_k"], top_p=fl[:, 1], min_p=fl[:, 2],
                         repetition_penalty=fl[:, 3], frequency_penalty=fl[:, 4], presence_penalty=fl[:, 5],
                         seed=jax.lax.bitcast_convert_type(col["seed"], jnp.uint32), step=col["step"],
                         suppress=(col["flags"] & _SUPPRESS) != 0, table_rows=col["trow"], table=table,
                         bias=(col["flags"] & _BIAS) != 0)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where each part of a step's packed metadata sits in the flat ``i32`` array (static per
    token bucket): tokens ``[3, T]`` (ids, positions, rows), row columns ``[R, _NUM_COLS]``,
    page table ``[R, P]``, ``cu_q_lens`` ``[dp, R/dp + 1]``, snapshots ``[3, NS]`` (row,
    tokens, slot; ``NS / dp`` per DP group, in the group's block); with speculative decoding
    (``n`` verify positions a row) the token of each position to sample ``[R, n]`` (-1: none)."""

    T: int
    R: int
    P: int
    dp: int
    NS: int
    n: int = 1

    @property
    def parts(self):
        spec = (("lidx", (self.R, self.n)),) if self.n > 1 else ()
        return (("tok", (3, self.T)), ("rows", (self.R, _NUM_COLS)), ("table", (self.R, self.P)),
                ("cu", (self.dp, self.R // self.dp + 1)), ("snap", (3, self.NS))) + spec

    @property
    def size(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.parts)

    def split(self, flat):
        """``{name: view}`` of a numpy or traced flat array."""
        out, o = {}, 0
        for name, shape in self.parts:
            n = int(np.prod(shape))
            out[name] = flat[o:o + n].reshape(shape)
            o += n
        return out


@dataclasses.dataclass
class HostSample:
    """A step's sampled tokens and logprobs on the host, in plan row order."""

    tokens: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    id_logprobs: np.ndarray  # [rows, MAX_TOKEN_IDS_LOGPROB]: each row's token_ids_logprob ids' log-probs
    accepted: np.ndarray | None = None  # speculative: drafts accepted per row (tokens etc. are [rows, n])
    drafts: np.ndarray | None = None  # DSpark: each row's next block, proposed on the device [rows, block]


@dataclasses.dataclass
class InFlight:
    """A launched step: its rows, its step number and its device outputs. ``index[i]`` is
    where plan row ``i``'s sampled token sits in ``tokens`` (the step's row axis) — what the
    next step reads through ``from_prev``."""

    step: int
    rows: list
    out: object  # SampleOutput on the device
    tokens: jax.Array  # i32[R]: sampled token of each row of the step
    index: np.ndarray
    runner: "Runner"
    _host: HostSample | None = None

    def result(self) -> HostSample:
        """Block until the step is done; the sampled tokens / logprobs on the host."""
        if self._host is None:
            t = time.perf_counter()
            got = jax.device_get(self.out)
            self.runner.wait_s += time.perf_counter() - t
            got, accepted, drafts = (got + (None,))[:3] if isinstance(got, tuple) else (got, None, None)
            self._host = HostSample(**{name: np.asarray(getattr(got, name))[self.index]
                                       for name in ("tokens", "logprob", "top_ids", "top_logprobs",
                                                                    "id_logprobs")},
                                    accepted=None if accepted is None else np.asarray(accepted)[self.index],
                                    drafts=None if drafts is None else np.asarray(drafts)[self.index])
        return self._host


class Runner:
    def __init__(self, model, cache_mgr, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 max_logprobs: int = 20, par=None, bucket_growth: int = 8, dispatch=None, abstract: bool = False,
                 num_speculative_tokens: int = 0, draft=None):
        """``abstract``: the cache manager's device cache is ``ShapeDtypeStruct``s (compiling for
        another platform, ``aot_build``): the runner's own arrays (token table, zero tokens) are
        too, on the cache's devices, and nothing is placed or run.

        ``num_speculative_tokens`` (``k``): decode rows may carry up to ``k`` drafts
        (``docs/speculative.md``). The runner then keeps the KDA journal (an entry per running
        request, ``model.k3.journal_shapes``) beside the cache and donates it to each step;
        a step samples every verify position (``R * (k + 1)`` logits) and accepts on the
        device (``server/spec/accept.py``).

        ``draft`` (a ``model.dspark.DSparkDraft``; ``server/spec/dspark_drafting.py``): every
        step runs the speculative program, which also returns the target's taps, and a draft
        program after the sampling writes the step's context rows into the pool's draft layers
        and proposes each row's next block (``HostSample.drafts``)."""
        from .dispatch import LocalDispatch

        self.model = model
        self.cache_mgr = cache_mgr
        self.programs = programs = cache_mgr.programs  # one count for the engine's programs
        self.page_size = cache_mgr.capacity_plan.page_size
        self.par = par
        self.dp = dp = par.dp if par is not None else 1
        self.group_rows = cdiv(max_num_seqs, dp)  # rows per DP group
        self.R = R = dp * self.group_rows  # the most rows a step has (its sampled tokens are kept at this size)
        # tokens per DP group: a group may carry the whole budget
        self.token_buckets = token_buckets(max_num_batched_tokens, self.group_rows, bucket_growth)
        self.page_width = cdiv(max_model_len, self.page_size)
        self.num_slots = cache_mgr.capacity_plan.num_slots
        self.buckets_used: set[int] = set()  # token buckets launched
        self.max_logprobs = max_logprobs
        self._compiled: dict = {}  # (token bucket, speculative) -> AOT-compiled step (warm-up)
        self._compiled_sample: dict = {}  # row count -> AOT-compiled sampling (warm-up)
        self.warm_fixed = 0  # programs warm-up compiled besides the steps and sampling
        self.launch_s = 0.0  # host time building inputs and dispatching
        self.wait_s = 0.0  # host time blocked waiting for step results
        self.num_steps = 0
        self.spec_steps = 0  # steps run on the speculative program (a speculating engine's others run the plain one)
        self._step_tokens: dict[int, jax.Array] = {}  # step number -> its sampled tokens (the last two)
        self.vocab_size = V = model.config.vocab_size
        self.spec_k = k = int(num_speculative_tokens)
        self.n_pos = k + 1  # verify positions of a decode row
        self.journal = None
        self._journal_row: dict[str, int] = {}
        self.draft = draft
        self._taps = None
        if draft is not None:
            if not k:
                raise ValueError("a draft model needs num_speculative_tokens >= 1")
            self._draft_graph, self._draft_params = nnx.split(draft)
            if abstract:  # placed like the cache's replicated arrays: whole on every device
                from jax.sharding import NamedSharding, PartitionSpec

                where = (NamedSharding(par.mesh, PartitionSpec()) if par is not None
                         else jax.tree.leaves(cache_mgr.device_cache)[0].sharding)
                self._draft_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where),
                                                  self._draft_params)
            elif par is not None:  # the draft's weights whole on every device (of every process)
                from jax.sharding import NamedSharding, PartitionSpec

                whole = NamedSharding(par.mesh, PartitionSpec())
                self._draft_params = jax.tree.map(
                    lambda a: jax.make_array_from_callback(a.shape, whole, lambda i, a=np.asarray(a): a[i]),
                    self._draft_params)
            self._taps = (tuple(draft.cfg.target_layer_ids), draft.cfg.aux_hidden_stream)
            self._draft_layer0 = len(model.config.mla_layers)
            self._draft_fns: dict = {}  # token bucket -> jitted draft program
        if k:
            from ...model.k3 import journal_shapes

            # under attention DP the journal's entries are split over the groups like the slots
            # (``StepParallel.journal_shardings``): group g's requests take entries in block g
            self._journal_per_group = per_group = cdiv(cache_mgr.capacity_plan.max_concurrent_slots, dp)
            entries = dp * per_group
            self._journal_free = [list(range((g + 1) * per_group - 1, g * per_group - 1, -1)) for g in range(dp)]
            shapes = journal_shapes(model.config, entries, k, model.dtype)
            H = model.config.kda_num_heads
            where = (par.journal_shardings(H) if par is not None
                     else (jax.tree.leaves(cache_mgr.device_cache)[0].sharding,) * len(shapes))
            if abstract:
                self.journal = tuple(jax.ShapeDtypeStruct(sh, d, sharding=w) for (sh, d), w in zip(shapes, where))
            elif par is not None:
                self.journal = tuple(jax.jit(functools.partial(jnp.zeros, sh, d), out_shardings=w)()
                                     for (sh, d), w in zip(shapes, where))
            else:
                self.journal = tuple(jnp.zeros(sh, d) for sh, d in shapes)
        # token table: row 0 for rows that use none, then one per request that can run at once
        # (a request slot: under attention DP dp * ceil(max_num_seqs / dp), not max_num_seqs)
        rows = cache_mgr.capacity_plan.max_concurrent_slots
        self.abstract = abstract
        block_w = draft.cfg.block_size if draft is not None else max(k, 1)  # a DSpark step's proposed block
        keep = {}  # on a mesh the table stays replicated, call after call
        if par is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            keep = {"out_shardings": NamedSharding(par.mesh, PartitionSpec())}
        if abstract:  # placed like the cache (replicated on a mesh)
            where = keep.get("out_shardings") or jax.tree.leaves(cache_mgr.device_cache)[0].sharding
            self._zero_prev = jax.ShapeDtypeStruct((R,), jnp.int32, sharding=where)
            self._zero_block = jax.ShapeDtypeStruct((R, block_w), jnp.int32, sharding=where)
            self.table = jax.ShapeDtypeStruct((rows + 1, table_width(V)), jnp.int32, sharding=where)
        else:
            # a speculative step's previous-step inputs when that step had none: no tokens, no
            # accepted drafts (the zeros of ``_zero_prev``), no proposed block
            self._zero_prev = jnp.zeros(R, jnp.int32)
            self._zero_block = jnp.zeros((R, block_w), jnp.int32)
            self.table = jnp.zeros((rows + 1, table_width(V)), jnp.int32)
            if keep:
                self.table = jax.device_put(self.table, keep["out_shardings"])
                self._zero_prev = jax.device_put(self._zero_prev, keep["out_shardings"])
                self._zero_block = jax.device_put(self._zero_block, keep["out_shardings"])
        # the step's metadata goes in replicated on a mesh: left to the partitioner, XLA:TPU
        # split the row columns across devices (one row index per shard) and its
        # reduce-scatter legalizer then failed (a RET_CHECK; v7-32-prefill at 4 rows)
        self._meta_sharding = keep.get("out_shardings")
        self._bitmask_where = where if abstract else keep.get("out_shardings")
        self.bitmask_words = -(-V // 32)
        self._all_allowed: dict = {}  # rows -> the bitmask of a step without grammars (all ones)
        self._table_row: dict[str, int] = {}
        self._table_free = list(range(rows, 0, -1))
        self._set_row = programs.jit(lambda table, i, row: table.at[i].set(row), "table_row", donate_argnums=(0,),
                                     **keep)
        self.table_inits = 0  # rows built on the host (admissions and re-admissions that need one)
        self._fns: dict = {}  # token bucket -> jitted step
        # the layers as straight-line code instead of one scan (the same layer code): set by
        # ``aot_build`` to measure per-layer costs (XLA:TPU's cost analysis counts a loop body once)
        self.unroll_layers = False
        graphdef = model.graphdef

        def fn(params, cache, meta, prev, journal=None, prev_acc=None, prev_block=None, *, lay: _Layout):
            m = lay.split(meta)
            rows = m["rows"]
            col = _columns(rows)
            ids, pos, tok_row = m["tok"][0], m["tok"][1], m["tok"][2]
            # decode rows whose input is the previous step's sample (still on the device)
            has_prev = col["from_prev"] >= 0
            fp = jnp.maximum(col["from_prev"], 0)
            ids = ids.at[jnp.where(has_prev, col["first_tok"], lay.T)].set(prev[fp], mode="drop")
            if journal is not None:  # rows after an in-flight verify row: their start, fold, drafts
                rows, ids, pos = follow_rows(rows, ids, pos, tok_row, prev[fp], prev_acc[fp], prev_block[fp], lay,
                                             _COLS, _DEV_DRAFTS)
                col = _columns(rows)
            snap = m["snap"]
            fb = FlatBatch(ids=ids, pos=pos, tok_row=tok_row, cu_q_lens=m["cu"].reshape(-1), start_pos=col["start"],
                           q_lens=col["q_len"], read_slot=col["read_slot"], write_slot=col["write_slot"],
                           fresh=col["fresh"] != 0, page_table=m["table"], logits_idx=col["logits_idx"],
                           snap_row=snap[0], snap_len=snap[1], snap_slot=snap[2], decode=col["decode"] != 0)
            if journal is not None:  # speculative: every verify position is sampled
                fb = dataclasses.replace(fb, logits_idx=m["lidx"], fold_len=col["fold"], jrow=col["jrow"])
                got = nnx.merge(graphdef, params).step(fb, cache, par=par, unroll=self.unroll_layers,
                                                       journal=journal, taps=self._taps)
                logits, cache, journal = got[:3]
                taps = got[3:]  # DSpark: the target's hidden states at the draft's layers
                # the sampler's view of the drafts: each row's tokens 1 .. k, and the suppression per position
                # (by the rows' global first tokens: under attention DP ``cu_q_lens`` counts within a group)
                at = jnp.minimum(col["first_tok"][:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :], lay.T - 1)
                supp = ((col["flags"] & _SUPP_IDS) != 0)[:, None] & (
                    col["step"][:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :] < col["min_new"][:, None])
                spec = jnp.concatenate([ids[at], supp.astype(jnp.int32)], axis=1)
                if par is not None:
                    cache = par.pin_cache(cache)
                return (logits, cache, rows, spec, journal, jnp.stack([ids, pos, tok_row])) + taps
            logits, cache = nnx.merge(graphdef, params).step(fb, cache, par=par, unroll=self.unroll_layers)
            if par is not None:  # the cache goes out in the layout it came in (warm-up's AOT programs fix it)
                cache = par.pin_cache(cache)
            return logits, cache, rows

        def sample_body(logits, rows, table, bitmask):
            col = _columns(rows)
            out = sample(logits, _sampler_inputs(rows, table), max_logprobs, bitmask=bitmask)
            table = record_tokens(table, col["trow"], out.tokens, (col["flags"] & _RECORD) != 0)
            n = rows.shape[0]
            tokens = out.tokens if n == R else jnp.zeros(R, jnp.int32).at[:n].set(out.tokens)
            return out, tokens, table

        def sample_spec(logits, rows, spec, table, bitmask, *, use_table: bool):
            """Sampling of a speculative step: every verify position of every row (``[R * n]``
            logits), each with plain decoding's sampler row at that token
            (``spec_positions.verify_sampler_inputs``); the drafts kept while they equal the
            samples (``spec.accept.accepted_lengths``); the emitted tokens counted into the
            token table. Returns (outputs ``[R, n, ...]``, accepted ``[R]``), the last emitted
            token of each row (``[R]``, the next step's ``prev``), the table.

            On a mesh it runs whole on every device like :func:`sample_fn`: every output is
            replicated, as the next step's AOT program expects its ``prev`` / ``prev_acc``
            (left to the partitioner they came out split over ``"dp"`` under attention DP, and
            a warmed-up engine's next step refused them) and as each process reads them."""
            body = functools.partial(spec_body, use_table=use_table)
            if par is None:
                return body(logits, rows, spec, table, bitmask)
            from jax.sharding import PartitionSpec as P

            return jax.shard_map(body, mesh=par.mesh, in_specs=(P(), P(), P(), P(), P()), out_specs=P(),
                                 check_vma=False)(logits, rows, spec, table, bitmask)

        def spec_body(logits, rows, spec, table, bitmask, *, use_table: bool):
            from ..spec.accept import accepted_lengths
            from .spec_positions import verify_sampler_inputs

            n = k + 1
            col = _columns(rows)
            inp = _sampler_inputs(rows, table)
            drafts, supp = spec[:, :k], spec[:, k:] != 0
            num_drafts = jnp.where(col["decode"] != 0, col["ndraft"], 0)
            vin = verify_sampler_inputs(inp, drafts, num_drafts, supp, use_table=use_table)
            # a constrained row carries no drafts: its mask holds at its first position
            out = sample(logits, vin, max_logprobs, bitmask=jnp.repeat(bitmask, n, axis=0))
            Rn = rows.shape[0]
            out = jax.tree.map(lambda a: a.reshape((Rn, n) + a.shape[1:]), out)
            acc = accepted_lengths(out.tokens, drafts, num_drafts)
            record = (col["flags"] & _RECORD) != 0
            for j in range(n):  # the emitted tokens: positions 0 .. accepted
                table = record_tokens(table, col["trow"], out.tokens[:, j], record & (j <= acc))
            last = jnp.take_along_axis(out.tokens, acc[:, None], axis=1)[:, 0]
            pad = lambda a: a if Rn == R else jnp.zeros(R, jnp.int32).at[:Rn].set(a)  # noqa: E731
            return (out, acc), pad(last), table, pad(acc)

        def sample_fn(logits, rows, table, bitmask):
            """Sampling for a step's rows (``[R, _NUM_COLS]`` of its metadata): a program of its
            own, keyed by the row count only, so the token buckets do not each compile it.

            On a mesh it runs whole on every device (a replicated ``shard_map``: the logits
            are gathered once): every output — the token table, the tokens fed back as the
            next call's ``prev``, the sampled tokens and logprobs — is replicated, so each
            process reads its own copy, and XLA's partitioner never sees the sampler's
            top-k (jax 0.10.2 fails a check in its TopkDecomposer on a partitioned top-k
            under the sampler's optimization barrier)."""
            if par is None:
                return sample_body(logits, rows, table, bitmask)
            from jax.sharding import PartitionSpec as P

            return jax.shard_map(sample_body, mesh=par.mesh, in_specs=(P(), P(), P(), P()), out_specs=P(),
                                 check_vma=False)(logits, rows, table, bitmask)

        self._step_fn = fn

        def draft_fn(dparams, params, cache, meta, tok, rows, taps, acc, last, *, lay: _Layout):
            """The DSpark program of a step (``spec.dspark_drafting.draft_block``) on the step's
            tokens and rows as it ran them (``tok``, ``rows``: starts and positions corrected);
            each row's block comes back ``[R, block_size]`` (the next step's ``prev_block``)."""
            from ..spec.dspark_drafting import draft_block

            m = lay.split(meta)
            fl = jax.lax.bitcast_convert_type(rows[:, len(_COLS):], jnp.float32)
            block, cache = draft_block(nnx.merge(self._draft_graph, dparams), nnx.merge(graphdef, params), cache,
                                       tok, _columns(rows), m["table"], fl, acc, last, taps, self._draft_layer0,
                                       model.config.kernels, par=par)
            Rn = block.shape[0]
            block = jnp.zeros((R, block.shape[1]), jnp.int32).at[:Rn].set(block.astype(jnp.int32))
            if par is not None:  # out as it came in: the cache in its layout, the block replicated (a ``prev_block``)
                from jax.sharding import NamedSharding, PartitionSpec

                cache = par.pin_cache(cache)
                block = jax.lax.with_sharding_constraint(block, NamedSharding(par.mesh, PartitionSpec()))
            return block, cache

        self._draft_body = draft_fn
        self._sample_jit = programs.jit(sample_fn, "sample", donate_argnums=(2,))
        self._sample_spec_jit = {u: programs.jit(functools.partial(sample_spec, use_table=u), "sample",
                                                 donate_argnums=(3,)) for u in (False, True)} if k else {}
        self.dispatch = dispatch if dispatch is not None else LocalDispatch()
        self.dispatch.register("step", self._run_step)
        self.dispatch.register("table_row", self._write_table_row)
        # the all-ones bitmask of every row count, made here, on this thread, in this order: under
        # multi-host a device_put to a global sharding is a collective, which warm-up's compile
        # threads would issue in a different order on each process (gloo: "collective mismatch")
        for R in sorted({self.layout(T).R for T in self.token_buckets}):
            self.bitmask_arg(R)

    def layout(self, T: int, spec: bool = False) -> _Layout:
        """The packed metadata of a step in bucket ``T``; ``spec``: the speculative program's
        (every verify position of a row sampled)."""
        Rg = self.rows_for(T)
        return _Layout(T=T * self.dp, R=self.dp * Rg, P=self.page_width, dp=self.dp, NS=self.dp * Rg,
                       n=self.n_pos if spec else 1)

    def rows_for(self, T: int) -> int:
        """Rows per DP group of a step in token bucket ``T``: every row has a token, so no
        more than ``T`` (and no more than ``max_num_seqs``); small steps carry no idle rows."""
        return min(self.group_rows, T)

    def snap_capacity(self, rows) -> int:
        """Prefix snapshot entries per DP group the step of ``rows`` can write."""
        return self.rows_for(self._bucket(max(self._group_tokens(rows))))

    def _group_tokens(self, rows) -> list[int]:
        per_group = [0] * self.dp
        for r in rows:
            per_group[self.cache_mgr.group_of(r.req.rid) if self.dp > 1 else 0] += r.num_tokens
        return per_group

    def _bucket(self, n: int) -> int:
        for b in self.token_buckets:
            if n <= b:
                return b
        raise ValueError(f"{n} tokens exceed the largest bucket {self.token_buckets[-1]}")

    def launch(self, rows, prev: InFlight | None = None, snaps=()) -> InFlight:
        """Dispatch one step for ``rows`` (ScheduledRow-like: req, start, num_tokens) and return
        at once. Tokens a row needs that are still on the device must come from ``prev``.
        ``snaps``: ``(row, tokens, slot)`` — write row's KDA state after that many of its
        tokens of this step to the slot (prefix snapshots; at most :meth:`snap_capacity` per
        DP group). A request with a ``read_slot`` (a prefix hit) reads its state from there
        this once."""
        t = time.perf_counter()
        groups = [self.cache_mgr.group_of(r.req.rid) for r in rows] if self.dp > 1 else [0] * len(rows)
        # decode rows first within each group, then prefill chunks (plan order otherwise)
        order = sorted(range(len(rows)), key=lambda i: (groups[i], rows[i].num_tokens > 1))
        Tg = self._bucket(max(self._group_tokens(rows)))
        self.buckets_used.add(Tg)
        # a speculating engine runs a step on its speculative program only when a row carries
        # drafts or has accepted drafts to fold; otherwise the plain program does the same work
        # for fewer logits, no journal and plain sampling
        # (or, with async scheduling, follows an in-flight verify row: its start and fold are the
        # device's to correct)
        spec = self.n_pos > 1 and (self.draft is not None or any(
            getattr(r, "drafts", ()) or getattr(r, "assumed", 0) or (getattr(r, "decode", False) and r.req.spec_fold)
            for r in rows))
        lay = self.layout(Tg, spec)
        meta = np.zeros(lay.size, np.int32)
        m = lay.split(meta)
        tok, rcols, table, cu = m["tok"], m["rows"], m["table"], m["cu"]
        col = _columns(rcols)
        fl = rcols[:, len(_COLS):].view(np.float32)
        Rg = lay.R // self.dp
        tok[2] = -1  # padding tokens belong to no row
        col["logits_idx"][:] = col["from_prev"][:] = col["jrow"][:] = col["guess"][:] = -1
        if spec:
            m["lidx"][:] = -1
        col["write_slot"][:] = self.num_slots  # rows without tokens write nothing
        for g in range(self.dp):
            col["read_slot"][g * Rg:(g + 1) * Rg] = self.cache_mgr.scratch_slot(g)
        col["fresh"][:] = 1
        fl[:, 1] = fl[:, 3] = 1.0  # top_p, repetition_penalty
        m["snap"][0] = -1
        m["snap"][2] = self.num_slots
        index = np.zeros(len(rows), np.int64)
        used_rows, used_tok = [0] * self.dp, [0] * self.dp
        for i in order:
            r, g = rows[i], groups[i]
            req = r.req
            lr, t0 = used_rows[g], used_tok[g]
            ri, ti = g * Rg + lr, g * Tg + t0  # global row / first token
            n = r.num_tokens
            drafts = getattr(r, "drafts", ())
            base = n - len(drafts)  # the row's own tokens; the drafts follow them
            if drafts and (not spec or len(drafts) > self.spec_k or not r.decode):
                raise ValueError(f"{req.rid}: {len(drafts)} drafts on a row that cannot carry them")
            used_rows[g], used_tok[g] = lr + 1, t0 + n
            cu[g, lr + 1:] = t0 + n
            index[i] = ri
            known = req.num_known
            assumed = getattr(r, "assumed", 0)
            if r.start + base > known:  # the input token is the previous step's sample
                # (after an in-flight verify row: where its drafts would end, all accepted)
                if (base != 1 or r.start != known + assumed or prev is None or req.sample_row is None
                        or req.sample_row[0] != prev.step or (assumed and not spec)):
                    raise RuntimeError(f"{req.rid}: input token {r.start} is not available from the previous step")
                col["from_prev"][ri] = req.sample_row[1]
                col["assumed"][ri], col["guess"][ri] = assumed, getattr(r, "guess", -1)
                tok[0, ti + base:ti + n] = drafts
            elif assumed:
                raise RuntimeError(f"{req.rid}: a row after an in-flight verify row must take its input from it")
            else:
                tok[0, ti:ti + base] = req.token_slice(r.start, r.start + base)
                tok[0, ti + base:ti + n] = drafts
            tok[1, ti:ti + n] = np.arange(r.start, r.start + n)
            tok[2, ti:ti + n] = lr
            slot = self.cache_mgr.slot_of(req.rid)
            col["start"][ri], col["q_len"][ri] = r.start, n
            col["read_slot"][ri] = col["write_slot"][ri] = slot
            if req.read_slot is not None:
                col["read_slot"][ri] = req.read_slot
                req.read_slot = None
            col["fresh"][ri] = r.start == 0
            col["first_tok"][ri], col["logits_idx"][ri] = ti, ti + n - 1
            col["step"][ri] = req.num_generated
            col["decode"][ri] = bool(getattr(r, "decode", False))
            col["ndraft"][ri], col["min_new"][ri] = len(drafts), req.params.min_new_tokens
            table[ri] = self.cache_mgr.page_table_row(req.rid, self.page_width)
            p = req.params
            supp_ids = bool(self._suppress_ids(p))
            sup = supp_ids and req.num_generated < p.min_new_tokens
            if spec:  # every verify position of a decode row is sampled; a prefill row's last token
                npos = n if col["decode"][ri] else 1
                m["lidx"][ri, :npos] = np.arange(ti + n - npos, ti + n)
                if col["decode"][ri]:
                    col["jrow"][ri] = self._journal_entry(req.rid, groups[i])
                    col["fold"][ri], req.spec_fold = req.spec_fold, 0  # last step's accepted drafts
                elif req.spec_fold:
                    raise RuntimeError(f"{req.rid}: accepted drafts left unfolded before a prefill row")
            trow = self._table_row.get(req.rid)
            if trow is None and (sup or uses_penalties(p) or p.logit_bias or p.token_ids_logprob):
                trow = self._init_row(req)
            if trow is not None:  # once a request has a row, every token it samples is counted
                col["trow"][ri] = trow
                col["flags"][ri] = ((_SUPPRESS if sup else 0) | (_RECORD if getattr(r, "samples", True) else 0)
                                    | (_SUPP_IDS if supp_ids else 0) | (_BIAS if p.logit_bias else 0))
            if getattr(r, "device_drafts", False):
                if col["from_prev"][ri] < 0:
                    raise RuntimeError(f"{req.rid}: device drafts on a row that does not follow the previous step")
                col["flags"][ri] |= _DEV_DRAFTS
        snap, NSg = m["snap"], Rg
        per = [0] * self.dp
        for i, n_tok, slot in snaps:
            g = groups[i]
            if per[g] >= NSg:
                raise ValueError(f"more than {NSg} snapshots for DP group {g} in one step")
            e = g * NSg + per[g]
            per[g] += 1
            snap[:, e] = (index[i] - g * Rg, n_tok, slot)
        f, k_, s_ = row_settings([r.req.params for r in rows], [r.req.seed for r in rows], len(rows))
        fl[index] = f.T
        col["top_k"][index], col["seed"][index] = k_, s_.view(np.int32)
        use_table = bool(spec and (col["trow"] > 0).any())
        bitmask = self._grammar_bitmask(rows, index, lay.R)
        step, out, tokens = self.dispatch("step", Tg, meta, prev.step if prev is not None else -1, use_table, spec,
                                          bitmask)
        self.launch_s += time.perf_counter() - t
        return InFlight(step, list(rows), out, tokens, index, self)

    def _run_step(self, T: int, meta: np.ndarray, prev_step: int, use_table: bool = False, spec: bool = False,
                  bitmask: np.ndarray | None = None):
        """Launch the step program of bucket ``T`` on packed metadata ``meta`` and its sampling
        (the dispatched operation "step"); ``prev_step``: the step whose sampled tokens feed
        this one's ``from_prev`` rows (-1: none); ``spec``: the speculative program (with the
        journal); ``use_table`` (speculative steps): some row reads the token table, so each
        verify position gets its own table row; ``bitmask``: ``int32[rows, ceil(V / 32)]``, the
        ids each row may sample (grammars; None: all). Returns (step number, outputs, tokens)."""
        self.buckets_used.add(T)
        R = self.layout(T).R
        bm = self.bitmask_arg(R) if bitmask is None else jax.device_put(bitmask, self._bitmask_where)
        if prev_step < 0:
            prev_tokens, prev_acc, prev_block = self._zero_prev, None, None
        elif prev_step in self._step_tokens:
            prev_tokens, prev_acc, prev_block = self._step_tokens[prev_step]
        else:
            raise RuntimeError(f"step {prev_step}'s tokens are gone (only {sorted(self._step_tokens)} are kept)")
        fn = self._compiled.get((T, spec)) or self._jit(T, spec)
        acc = block = None
        if spec:
            meta_dev = jax.device_put(meta, self._meta_sharding)
            logits, self.cache_mgr.device_cache, rows_dev, drafts, self.journal, tok_dev, *taps = fn(
                self.model.params, self.cache_mgr.device_cache, meta_dev, prev_tokens, self.journal,
                self._zero_prev if prev_acc is None else prev_acc, self._zero_block if prev_block is None else prev_block)
            out, tokens, self.table, acc = self._spec_sampler(R, use_table)(logits, rows_dev, drafts, self.table, bm)
            if self.draft is not None:  # the next blocks, proposed after this step's tokens
                block, self.cache_mgr.device_cache = self._draft_jit(T)(
                    self._draft_params, self.model.params, self.cache_mgr.device_cache, meta_dev, tok_dev, rows_dev,
                    taps[0], out[1], tokens)
                out = (*out, block)
        else:
            logits, self.cache_mgr.device_cache, rows_dev = fn(
                self.model.params, self.cache_mgr.device_cache, jax.device_put(meta, self._meta_sharding),
                prev_tokens)
            out, tokens, self.table = self._sampler(R)(logits, rows_dev, self.table, bm)
        self.num_steps += 1
        self.spec_steps += bool(spec)
        # what the next step's rows that follow this one's read: the last emitted tokens and,
        # of a speculative step, the drafts accepted and the blocks proposed
        self._step_tokens[self.num_steps] = (tokens, acc, block)
        self._step_tokens.pop(self.num_steps - 2, None)
        return self.num_steps, out, tokens

    def _grammar_bitmask(self, rows, index, R: int) -> np.ndarray | None:
        """The step's bitmask when some row samples under a grammar (``server/structured``):
        each such row's allowed ids from its matcher, every other row all ones; None when no
        row has a grammar (the step then uses :meth:`bitmask_arg`'s resident array). A
        grammar's matcher must have seen every token of its request, so those requests are
        never planned while their last token is in flight (the engine steps synchronously)."""
        bitmask = None
        for i, r in enumerate(rows):
            g = getattr(r.req, "grammar", None)
            if g is None or not getattr(r, "samples", True):
                continue
            if r.req.pending or getattr(r, "drafts", ()):
                raise RuntimeError(f"{r.req.rid}: a grammar row planned with tokens in flight or drafts")
            if bitmask is None:
                bitmask = np.full((R, self.bitmask_words), -1, np.int32)
            g.fill(bitmask, int(index[i]))
        return bitmask

    def bitmask_arg(self, R: int):
        """The bitmask of a step of ``R`` rows none of which has a grammar: every id allowed (kept
        on the device; an abstract engine's is a ``ShapeDtypeStruct``)."""
        got = self._all_allowed.get(R)
        if got is None:
            shape = (R, self.bitmask_words)
            if self.abstract:
                got = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self._bitmask_where)
            else:
                got = jax.device_put(np.full(shape, -1, np.int32), self._bitmask_where)
            self._all_allowed[R] = got
        return got

    def _write_table_row(self, i: int, row: np.ndarray) -> None:
        """Token table row ``i`` := ``row`` (the dispatched operation "table_row")."""
        self.table = self._set_row(self.table, np.int32(i), row)

    def _jit(self, T: int, spec: bool = False):
        """The step program of bucket ``T`` (``spec``: the speculative one, which takes and
        returns the journal)."""
        f = self._fns.get((T, spec))
        if f is None:
            f = self._fns[(T, spec)] = self.programs.jit(functools.partial(self._step_fn, lay=self.layout(T, spec)),
                                                         "step", donate_argnums=(1, 4) if spec else (1,))
        return f

    def _draft_jit(self, T: int):
        """The DSpark program of bucket ``T`` (the cache donated)."""
        f = self._draft_fns.get(T)
        if f is None:
            f = self._draft_fns[T] = self.programs.jit(functools.partial(self._draft_body, lay=self.layout(T, True)),
                                                       "draft", donate_argnums=(2,))
        return f

    def _spec_sampler(self, R: int, use_table: bool):
        """The speculative sampling program for steps of ``R`` rows (compiled at warm-up)."""
        return self._compiled_sample.get((R, use_table)) or self._sample_spec_jit[use_table]

    def _journal_entry(self, rid, group: int = 0) -> int:
        """``rid``'s entry in the KDA journal, given at its first decode row under speculation
        (in its attention-DP group's block of entries)."""
        e = self._journal_row.get(rid)
        if e is None:
            free = self._journal_free[group]
            if not free:
                raise RuntimeError(f"KDA journal full (more decoding requests than request slots in group {group})")
            e = self._journal_row[rid] = free.pop()
        return e

    def _sampler(self, R: int):
        """The sampling program for steps of ``R`` rows (compiled at warm-up)."""
        return self._compiled_sample.get(R) or self._sample_jit

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
            raise RuntimeError("token table full (more running requests than request slots)")
        i = self._table_free.pop()
        p = req.params
        row = token_table_row(req.prompt, req.output, self._suppress_ids(p), self.vocab_size, p.logit_bias,
                              p.token_ids_logprob)
        self.dispatch("table_row", i, row)
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
        e = self._journal_row.pop(rid, None)
        if e is not None:
            self._journal_free[e // self._journal_per_group].append(e)

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
            p = req.params
            want = token_table_row(req.prompt, req.output, self._suppress_ids(p), self.vocab_size, p.logit_bias,
                                   p.token_ids_logprob)
            bad = np.flatnonzero(got[i] != want)
            assert not bad.size, f"{rid}: token table row {i} differs at ids {bad[:8].tolist()}"

    def shape_buckets(self) -> list[int]:
        """Every token bucket a step can take (one step program each)."""
        return list(self.token_buckets)

    @property
    def num_compiles(self) -> int:
        """Programs compiled so far: every jitted function of the engine (``programs``)."""
        return self.programs.count

    def programs_for(self, buckets) -> int:
        """Programs of an engine whose steps used ``buckets``: a step program per bucket, a
        sampling program per distinct row count, and the small programs warm-up compiled
        (``warm_fixed``: cache copies, reads and loads, the token-table row)."""
        buckets = list(buckets)
        # a speculating engine: the plain and the speculative program (DSpark: the speculative one)
        per = 1 if self.journal is None or self.draft is not None else 2
        samplers = len({self.layout(T).R for T in buckets}) * (
            1 if self.journal is None else 2 if self.draft is not None else 3)
        drafts = len(buckets) if self.draft is not None else 0  # DSpark: a draft program per bucket
        return per * len(buckets) + samplers + drafts + self.warm_fixed

    def warm_table_row(self) -> None:
        """Compile the token-table row write (one program: the row is always ``[V + EXTRA_COLS]``) by
        writing row 0 (the rows that use no table) with what it holds: zeros."""
        self._write_table_row(0, token_table_row([], [], [], self.vocab_size))

    def _padding_args(self, T: int, spec: bool = False) -> tuple:
        lay = self.layout(T, spec)
        meta = np.zeros(lay.size, np.int32)
        m = lay.split(meta)
        m["tok"][2] = -1
        rows = m["rows"]
        rows[:, _COLS.index("logits_idx")] = rows[:, _COLS.index("from_prev")] = -1
        rows[:, _COLS.index("write_slot")] = self.num_slots
        m["snap"][0], m["snap"][2] = -1, self.num_slots
        rows[:, _COLS.index("jrow")] = -1
        if spec:
            m["lidx"][:] = -1
        journal = (self.journal, self._zero_prev, self._zero_block) if spec else ()
        if self.abstract:  # placed as ``_run_step`` places it: replicated on a mesh
            return (jax.ShapeDtypeStruct(meta.shape, meta.dtype, sharding=self._meta_sharding), self._zero_prev,
                    *journal)
        return (jax.device_put(meta, self._meta_sharding), self._zero_prev, *journal)

    def warmup(self, workers: int | None = None) -> int:
        """Compile every token bucket's step and each row count's sampling ahead of time;
        returns compiles. Tracing and lowering (Python, under the GIL) run on this thread while
        XLA compiles the previous program on ``workers`` threads (XLA releases the GIL). XLA's
        CPU compiler already keeps about 1.7 cores busy with one program, so the default is one
        compile thread below 8 host cores.

        The compiled executables are kept and called directly by ``launch``; a program that
        was not compiled here would fall back to ``jax.jit`` (and count as a compile)."""
        import concurrent.futures as cf
        import os

        before = self.num_compiles
        # a speculating engine has two programs per bucket: the plain one and the speculative one
        # (a DSpark engine only the speculative one: every step writes the draft's context)
        kinds = ((True,) if self.draft is not None else (False, True)) if self.journal is not None else (False,)
        shapes = [(T, sp) for T in self.shape_buckets() for sp in kinds if (T, sp) not in self._compiled]
        cpus = os.cpu_count() or 1
        workers = workers or (1 if cpus < 8 else min(8, cpus // 4))
        with cf.ThreadPoolExecutor(workers, thread_name_prefix="k3-compile") as ex:
            futures, sfutures = {}, {}
            for T, sp in shapes:
                lowered = self._jit(T, sp).lower(self.model.params, self.cache_mgr.device_cache,
                                                 *self._padding_args(T, sp))
                futures[(T, sp)] = ex.submit(lowered.compile)
                R = self.layout(T).R
                if sp:
                    for u in (False, True):
                        if (R, u) not in self._compiled_sample and (R, u) not in sfutures:
                            def spec_sampler(step=futures[(T, sp)], u=u, R=R):
                                logits, _, rows, spec = step.result().out_info[:4]
                                return self._sample_spec_jit[u].lower(logits, rows, spec, self.table,
                                                                      self.bitmask_arg(R)).compile()

                            sfutures[(R, u)] = ex.submit(spec_sampler)
                elif R not in self._compiled_sample and R not in sfutures:
                    # lowered against the compiled step's outputs (logits, rows): their shapes
                    # and the shardings XLA chose; the step's compile was submitted first
                    def sampler(step=futures[(T, sp)], R=R):
                        logits, _, rows = step.result().out_info
                        return self._sample_jit.lower(logits, rows, self.table, self.bitmask_arg(R)).compile()

                    sfutures[R] = ex.submit(sampler)
            for key, fut in futures.items():
                self._compiled[key] = fut.result()
            for R, fut in sfutures.items():
                self._compiled_sample[R] = fut.result()
        # every process of a multi-host deployment has compiled: meet before the first
        # collectives, whose setup gives a slower process only 30 s (``wait_for_processes``)
        wait_for_processes("warmup-compiled")
        # run each program once (first-run allocations), with the cache and table flowing through
        for T, sp in shapes:
            if sp:
                meta, prev, journal, pacc, pblock = self._padding_args(T, sp)
                logits, self.cache_mgr.device_cache, rows, spec, self.journal, tok, *taps = self._compiled[(T, sp)](
                    self.model.params, self.cache_mgr.device_cache, meta, prev, journal, pacc, pblock)
                for u in (False, True):
                    R = self.layout(T).R
                    out, last, self.table, _ = self._spec_sampler(R, u)(logits, rows, spec, self.table,
                                                                        self.bitmask_arg(R))
                if self.draft is not None:  # compiled here, on its first call
                    block, self.cache_mgr.device_cache = self._draft_jit(T)(
                        self._draft_params, self.model.params, self.cache_mgr.device_cache, meta, tok, rows, taps[0],
                        out[1], last)
                    jax.block_until_ready(block)
                jax.block_until_ready(out)
                continue
            logits, self.cache_mgr.device_cache, rows = self._compiled[(T, sp)](
                self.model.params, self.cache_mgr.device_cache, *self._padding_args(T, sp))
            R = self.layout(T).R
            out, _, self.table = self._sampler(R)(logits, rows, self.table, self.bitmask_arg(R))
            jax.block_until_ready(out)
        return self.num_compiles - before
