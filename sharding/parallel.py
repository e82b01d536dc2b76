"""The parallel step: what the model calls, under a recipe, for the ops that need collectives.

``model/`` never names a mesh axis. The runner hands the model a :class:`StepParallel`
(``par``); where the model has a ``par`` it asks it for

* ``mla_write_flat`` / ``mla_attend_flat`` — write this step's latent rows into the paged MLA
  pool, then attend (two calls, so the write stays outside the layer scan's ``lax.switch``),
  with **decode context parallelism** and **attention DP**: inside a ``shard_map`` over the
  whole mesh every rank holds one block of the pool's pages (the page dim is split over
  ``("dp",) + dcp_axes``); the engine's allocator deals page k of a sequence of DP group g to
  block ``g * dcp + (k + o) mod dcp`` (``o``: the sequence's starting rank, chosen for
  balance; it is read back from the block of the sequence's first page), so a rank writes
  only the rows whose page is in its block and attends over its own columns of the page
  table (pages ``(r - o) mod dcp``, then every ``dcp``-th), returning
  partial output and log-sum-exp per head; the partials are merged exactly over the DCP
  ranks (the LSEs all-gathered, then one ``psum`` of the reweighted outputs). Query heads
  are split over the attention axes DCP does not use (all heads on every rank at full DCP:
  the all-gather of the query); tokens and rows are split over ``"dp"`` (each DP group's
  block of the flattened step only sees its own pages and slots);
* ``kda_core`` — the ragged KDA conv and recurrence per DP group;
* ``take_slots`` / ``put_slots`` — the KDA state and conv rows of the step's slots, by DP
  group (each group's slots live on its own devices; heads stay split over the group);
* ``expert_ffn`` — the routed experts with explicit EP dispatch/combine (``sharding.ep``);
* ``sp_scatter`` / ``sp_gather`` — sequence parallelism for the token-wise ops between
  layers: the sublayer output is constrained to tokens split over ``sp_axes`` (XLA turns the
  row-parallel output projection's sum into a reduce-scatter) and the normalised input of the
  next projection back to whole tokens (an all-gather) — only on steps with at least
  ``sp_min_rows`` tokens whose count divides by the SP size.

With a Pallas kernel backend (``K3Config.kernels``) the model asks instead for
``mla_write_attend_flat`` (the MLA kernel's write and attention per rank, DCP partials merged
by their LSE), ``kda_layer_on_pools`` (the KDA kernels on each rank's slots and heads of the
pools, in place) and ``expert_ffn(..., backend=...)`` (the MXFP4 grouped-matmul kernel per EP
rank, ``sharding.ep``): docs/sharding.md, "Pallas kernels under a recipe".

Everything else in the step runs under XLA's Auto partitioner with the parameter placement of
``sharding.mesh``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .mesh import ATTN, dcp_axes, sp_axes
from .recipe import Recipe


def merge_dcp_partials(out, lse, dcp_ax):
    """The exact merge of the DCP ranks' attention partials (inside a ``shard_map``): each rank's
    ``out [T, H, L]`` (normalised over its own keys) and ``lse [T, H]`` (``-inf`` where it saw
    no key). The small LSEs are all-gathered, so every rank knows each rank's weight
    ``exp(lse_r - M) / sum_r exp(lse_r - M)``; one ``psum`` of the weighted outputs is the
    result. Returns ``(out, lse)`` merged (``lse`` ``-inf`` where no rank saw a key).

    Why this form (``k3serve compile``, a decode step of the full K3 under ``v7-32-decode``):
    the earlier merge summed the numerator with the weight as a 513th column (one
    ``[T, H, 513]`` collective, padded to 640 lanes on TPU) and divided after it: a concat, a
    slice and a divide pass over the whole ``[T, H, L]`` float32 array per MLA layer."""
    every = jax.lax.all_gather(lse, dcp_ax)  # [dcp, T, H]
    M = jnp.max(every, axis=0)
    M = jnp.where(jnp.isfinite(M), M, 0.0)
    den = jnp.sum(jnp.exp(every - M), axis=0)
    seen = den > 0
    scale = jnp.where(seen, jnp.exp(lse - M) / jnp.where(seen, den, 1.0), 0.0)
    out = jax.lax.psum(out * scale[..., None].astype(out.dtype), dcp_ax)
    return out, jnp.where(seen, M + jnp.log(jnp.where(seen, den, 1.0)), -jnp.inf)


def _flat_index(axes: tuple[str, ...], sizes: dict) -> jax.Array:
    """This rank's linear index over ``axes`` (row-major, as shard_map lays out blocks)."""
    idx = jnp.int32(0)
    for a in axes:
        idx = idx * sizes[a] + jax.lax.axis_index(a)
    return idx


class StepParallel:
    def __init__(self, recipe: Recipe, mesh, ep_dispatch: str | None = "auto"):
        self.recipe, self.mesh = recipe, mesh
        self.sizes = dict(mesh.shape)
        self.dp = recipe.dp
        self.dcp = recipe.dcp
        self.dcp_axes = dcp_axes(recipe)
        self.head_axes = tuple(a for a in ATTN if a not in self.dcp_axes)
        self.rows_axis = "dp" if recipe.dp > 1 else None
        self.page_axes = (("dp",) if recipe.dp > 1 else ()) + self.dcp_axes
        self.sp_axes = sp_axes(recipe)
        self.sp = recipe.sp
        self.sp_min_rows = recipe.sp_min_rows
        # explicit EP dispatch/combine: "ragged" (ragged_all_to_all), "padded" (all_to_all) or
        # "auto" (ragged on accelerators, padded on CPU); None leaves the routed experts to
        # XLA's Auto partitioner
        self.ep_impl = ep_dispatch if recipe.ep > 1 else None
        # False: the steps compiled have no KDA row of two tokens or more, so the KDA layers leave
        # their prefill path out (``kernels/kda_pools.py``; ``aot_build.decode_costs`` measures
        # the decode step so: the branch such a step takes)
        self.kda_prefill_rows = True

    # ------------------------------------------------------------------ specs
    def _ax(self, axes):
        return None if not axes else (axes if len(axes) > 1 else axes[0])

    def _slot_spec(self, pool, kda_heads: int | None = None) -> P:
        """The layout of a KDA pool ``[n, slots, ...]`` (or of rows taken from it): slots
        over ``"dp"``; with the heads split over the attention group ``ATTN`` (when they
        divide it, :meth:`conv_groups`) also the state's heads ``[n, slots, H, dk, dv]`` and
        the conv window's rows ``[n, slots, (W-1)*3H, dk]``, stored rank-major
        (``model.cache.conv_pool_rows``: each rank's block is its heads' windows) --
        the one rule of :meth:`cache_specs`, :meth:`take_slots` and :meth:`put_slots`, so the
        step returns the cache in the layout it was given. A conv pool needs ``kda_heads``."""
        if pool.ndim != 5:  # kda_conv [n, slots, (W-1)*3H, dk]
            if kda_heads is None:
                raise ValueError("the conv pool's layout depends on the KDA head count: pass kda_heads")
            return P(None, self.rows_axis, self._state_heads(kda_heads), None)
        return P(None, self.rows_axis, self._state_heads(pool.shape[2]), None, None)

    def _state_heads(self, kda_heads: int):
        return ATTN if kda_heads % self.recipe.attn_group == 0 else None

    def conv_groups(self, kda_heads: int) -> int:
        """The rank blocks of the conv pool's rows (``model.cache.conv_pool_rows``), 1 when whole."""
        return self.recipe.attn_group if self._state_heads(kda_heads) is not None else 1

    def cache_specs(self, kda_heads: int) -> dict:
        h = self._state_heads(kda_heads)
        return {"kda_state": P(None, self.rows_axis, h, None, None),
                "kda_conv": P(None, self.rows_axis, h, None),
                "mla_kv": P(None, self._ax(self.page_axes), None, None)}

    def journal_shardings(self, kda_heads: int) -> tuple:
        """NamedSharding of each part of the speculative KDA journal (``model.k3.journal_shapes``:
        keys, decays, deltas ``[nK, J, d, H, dk]``, pre-conv rows ``[nK, J, d, 3P]`` in q|k|v
        order): split over the KDA heads like the state when the state is."""
        h = self._state_heads(kda_heads)
        per_head = NamedSharding(self.mesh, P(None, self.rows_axis, None, h, None))
        return per_head, per_head, per_head, NamedSharding(self.mesh, P(None, self.rows_axis, None, h))

    def cache_shardings(self, kda_heads: int) -> dict:
        """NamedSharding of each cache array (``kda_state``, ``kda_conv``, ``mla_kv``)."""
        return {k: NamedSharding(self.mesh, v) for k, v in self.cache_specs(kda_heads).items()}

    def pin_cache(self, cache):
        """``cache`` (a ``model.cache.Cache``, inside a jitted step) constrained to
        :meth:`cache_shardings`: the cache a step returns has exactly the layout it was
        allocated with, so it can go straight into the next ahead-of-time compiled step
        (whose input shardings are fixed) and the donated buffers are reused."""
        sh = self.cache_shardings(cache.kda_state.shape[2])
        return dataclasses.replace(cache, **{k: jax.lax.with_sharding_constraint(getattr(cache, k), v)
                                             for k, v in sh.items()})

    # ------------------------------------------------------------------ MLA with DCP / DP
    def _mla_specs(self):
        q_spec = P(self.rows_axis, self._ax(self.head_axes), None)
        return q_spec, P(self.rows_axis), P(None, self._ax(self.page_axes), None, None)

    def _local_table(self, table, ppr):
        """This rank's page ids in ``table`` (``-1``: a page in another rank's block)."""
        base = _flat_index(self.page_axes, self.sizes) * ppr if self.page_axes else jnp.int32(0)
        return jnp.where((table - base >= 0) & (table - base < ppr), table - base, -1)

    def mla_write_flat(self, rows, kv_pool, layer, fb):
        """Write the step's latent ``rows`` [T, W] into layer ``layer`` of the pool; each rank
        writes only the rows whose page lives in its block. Returns the pool."""
        from ..kernels.mla_ragged import write_kv_rows
        from ..model.step import local_rows

        _, r_spec, pool_spec = self._mla_specs()

        def local(new_rows, pool, table, tok_row, pos, layer):
            tok_row = local_rows(tok_row, table.shape[0])
            return write_kv_rows(pool, new_rows, self._local_table(table, pool.shape[1]), tok_row, pos, layer=layer)

        fn = jax.shard_map(local, mesh=self.mesh, in_specs=(r_spec, pool_spec, r_spec, r_spec, r_spec, P()),
                           out_specs=pool_spec, check_vma=False)
        return fn(rows, kv_pool, fb.page_table, fb.tok_row, fb.pos, jnp.asarray(layer, jnp.int32))

    def mla_attend_flat(self, q_lat, q_rope, kv_pool, layer, fb, scale: float, latent_dim: int):
        """Attend over layer ``layer`` of the pool (the step's rows already written by
        :meth:`mla_write_flat`); returns out_lat [T, H, latent]."""
        from ..kernels.mla_ragged import mla_ragged_attention
        from ..model.step import local_rows

        dcp, sizes, dcp_ax = self.dcp, self.sizes, self.dcp_axes
        q_spec, r_spec, pool_spec = self._mla_specs()

        def local(q_lat, q_rope, pool, table, tok_row, pos, kv_lens, cu, q_lens, layer):
            tok_row = local_rows(tok_row, q_lens.shape[0])
            ppr = pool.shape[1]  # pages in this rank's block
            local_table = self._local_table(table, ppr)
            # attend over this rank's columns of the page table: pages r, r + dcp, ...
            if dcp > 1:
                r = _flat_index(dcp_ax, sizes)
                J = -(-table.shape[1] // dcp)
                first_rank = (table[:, 0] // ppr) % dcp  # each row's starting rank o
                ords = (r - first_rank)[:, None] % dcp + dcp * jnp.arange(J, dtype=jnp.int32)[None, :]  # [R, J]
                cols = jnp.take_along_axis(local_table, jnp.clip(ords, 0, table.shape[1] - 1), axis=1)
                cols = jnp.where(ords < table.shape[1], cols, -1)
            else:
                ords, cols = None, local_table
            out, lse = mla_ragged_attention(q_lat, q_rope, pool, cols, tok_row, pos, kv_lens, cu, q_lens, scale,
                                            latent_dim, layer=layer, page_ordinals=ords, return_lse=True)
            if dcp > 1:  # exact merge of the ranks' partials
                out, _ = merge_dcp_partials(out, lse, dcp_ax)
            return out

        fn = jax.shard_map(local, mesh=self.mesh,
                           in_specs=(q_spec, q_spec, pool_spec, r_spec, r_spec, r_spec, r_spec, r_spec, r_spec, P()),
                           out_specs=q_spec, check_vma=False)
        return fn(q_lat, q_rope, kv_pool, fb.page_table, fb.tok_row, fb.pos, fb.kv_lens, fb.cu_q_lens, fb.q_lens,
                  jnp.asarray(layer, jnp.int32))

    # ------------------------------------------------------------------ KDA core by DP group
    def kda_core(self, core, raw, conv_w, g, beta, conv_rows, state_rows, tok_row, cu, q_lens, start_pos, snap_row,
                 snap_len, decode=None):
        """``core`` (``model.kda._flat_core``) per DP group: each group's tokens, rows and
        snapshot entries in their own block (``model.step``), so the ragged loops run on one
        group's layout. Without DP the step's partitioner places it (speculative rows too:
        ``decode``, the row kinds)."""
        args = (raw, conv_w, g, beta, conv_rows, state_rows, tok_row, cu, q_lens, start_pos, snap_row, snap_len)
        if self.dp == 1:
            return core(*args, decode)
        d = P("dp")
        specs = (d, P(), d, d, d, d, d, d, d, d, d, d)
        # with drafts the core also returns the journal rows (keys, decays, deltas, pre-conv rows)
        outs = (d,) * (4 if decode is None else 8)
        if decode is not None:
            args, specs = args + (decode,), specs + (d,)
        return jax.shard_map(core, mesh=self.mesh, in_specs=specs, out_specs=(d, outs), check_vma=False)(*args)

    # ------------------------------------------------------------------ Pallas kernels per rank
    def _dcp_columns(self, table, local_table, ppr):
        """This DCP rank's columns of the page table (pages ``(r - o) mod dcp``, then every
        ``dcp``-th; ``o`` each row's starting rank) and their page ordinals ``[R, J]``."""
        dcp = self.dcp
        r = _flat_index(self.dcp_axes, self.sizes)
        J = -(-table.shape[1] // dcp)
        first_rank = (table[:, 0] // ppr) % dcp
        ords = (r - first_rank)[:, None] % dcp + dcp * jnp.arange(J, dtype=jnp.int32)[None, :]
        cols = jnp.take_along_axis(local_table, jnp.clip(ords, 0, table.shape[1] - 1), axis=1)
        return jnp.where(ords < table.shape[1], cols, -1), ords

    def mla_write_attend_flat(self, q_lat, q_rope, rows, kv_pool, layer, fb, tok_row, q_lens, scale: float,
                              latent_dim: int, backend: str, return_lse: bool = False):
        """The fused MLA layer of a Pallas backend (``ops.mla_write_attend``) per rank: write
        the step's ``rows`` [T, W] into this rank's block of the pool and attend, returning
        ``(out_lat [T, H, latent], pool)``. ``tok_row`` / ``q_lens``: the step's, masked by the
        caller (a layer scan's non-MLA layer writes and attends nothing).

        Without DCP one kernel call writes and attends over the rank's pages (the page table
        mapped to its block, other blocks' pages ``-1``: never written, never read). With DCP
        the write and the attention take different columns of the table (the write goes by
        position, the attention only over this rank's columns, so it visits ``1/dcp`` of the
        context), so there are two calls: the write (the mapped table, no query rows: only the
        rank owning a row's page writes it), then the attention over the rank's columns with
        their ordinals; the partials are merged exactly with their LSE, as
        :meth:`mla_attend_flat`.

        ``rows`` None writes nothing; ``return_lse`` also returns the merged log-sum-exp
        ``[T, H]`` (``-inf`` where a query sees no key), second: the DSpark draft's context
        attention (``model.dspark.DSparkAttention.attend_paged``) merges it with its block's
        own keys."""
        from ..kernels import ops
        from ..model.step import local_rows

        dcp, dcp_ax = self.dcp, self.dcp_axes
        q_spec, r_spec, pool_spec = self._mla_specs()

        def local(q_lat, q_rope, rows, pool, table, tok_row, pos, kv_lens, cu, q_lens, layer):
            tok_row = local_rows(tok_row, q_lens.shape[0])
            ppr = pool.shape[1]
            local_table = self._local_table(table, ppr)
            call = functools.partial(ops.mla_write_attend, scale=scale, latent_dim=latent_dim, backend=backend)
            if dcp == 1:
                return call(q_lat, q_rope, rows, pool, layer, local_table, tok_row, pos, kv_lens, cu, q_lens,
                            return_lse=return_lse)
            if rows is not None:  # the write alone (no query rows: nothing attends), one head's queries for the shapes
                _, pool = call(q_lat[:, :1], q_rope[:, :1], rows, pool, layer, local_table, tok_row, pos, kv_lens, cu,
                               jnp.zeros_like(q_lens), cost_rows=0)
            cols, ords = self._dcp_columns(table, local_table, ppr)
            out, lse, pool = call(q_lat, q_rope, None, pool, layer, cols, tok_row, pos, kv_lens, cu, q_lens,
                                  page_ordinals=ords, return_lse=True)
            out, lse = merge_dcp_partials(out, lse, dcp_ax)
            return (out, lse, pool) if return_lse else (out, pool)

        out_specs = (q_spec, P(*q_spec[:2]), pool_spec) if return_lse else (q_spec, pool_spec)
        fn = jax.shard_map(local, mesh=self.mesh,
                           in_specs=(q_spec, q_spec, r_spec, pool_spec, r_spec, r_spec, r_spec, r_spec, r_spec, r_spec,
                                     P()),
                           out_specs=out_specs, check_vma=False)
        return fn(q_lat, q_rope, rows, kv_pool, fb.page_table, tok_row, fb.pos, fb.kv_lens, fb.cu_q_lens, q_lens,
                  jnp.asarray(layer, jnp.int32))

    def _kda_split(self, kda_heads: int) -> bool:
        """Whether the KDA heads are split over the attention group (``_state_heads``)."""
        return self._state_heads(kda_heads) is not None and self.recipe.attn_group > 1

    def _group_slots(self, S: int, slot):
        """Global slot ids -> this DP group's block of ``S`` slots; others out of range (``S``)."""
        base = jax.lax.axis_index("dp") * S if self.dp > 1 else 0
        lid = slot - base
        return jnp.where((lid >= 0) & (lid < S), lid, S)

    def kda_layer_on_pools(self, qkv_raw, f, beta, gate_out, conv_w, A_log, dt_bias, o_norm, state_pool, conv_pool,
                           layer, fb, q_lens, *, lower_bound, eps, backend: str, journal=None):
        """``ops.kda_layer_on_pools`` (the KDA kernels on the pools in place) per rank: each DP
        group on its own slots (slot ids made local to the group's block; others' dropped), each
        rank of the group on its heads of the state pool (``_slot_spec``: heads over ``ATTN``)
        and its block of the conv pool's rows (stored rank-major: the block is the rank's
        heads' windows in the kernels' row layout, ``model.cache.conv_pool_rows``).
        ``qkv_raw``: [T, 3, P] (``KDA.project``). Returns ``(o [T, H, d], state_pool,
        conv_pool)`` in the pools' layouts.

        ``journal`` (speculative decoding; ``fb`` carries ``decode``, ``jrow``, ``fold_len``):
        each rank runs the record-mode kernel on its block of the journal (:meth:`journal_shardings`:
        its DP group's entries, its heads; the pre-conv rows of a rank are its heads' ``q | k |
        v``, so the journal's channels are rank-major, block j rank j's heads' ``q | k | v``,
        whenever the kernels keep it). Returns the journal fourth."""
        from ..kernels import ops
        from ..model.step import local_rows

        T, H = beta.shape
        Pw = f.shape[-1]
        W = conv_w.shape[-1]
        split = self._kda_split(H)
        h = ATTN if split else None
        ax = self.rows_axis
        st_spec = self._slot_spec(state_pool)
        cv_spec = P(None, ax, h, None)  # rows (g, t, part, h): a rank's block is its heads' windows
        d = P(ax)
        in_specs = (P(ax, None, h), P(ax, h), P(ax, h), P(ax, h), P(None, h, None), P(h), P(h), P(), st_spec, cv_spec,
                    P(), d, d, d, d, d, d, d, d, d, d, P())
        j_specs = ()
        if journal is not None:
            j_specs = tuple(sh.spec for sh in self.journal_shardings(H))
            in_specs = in_specs + (j_specs, d, d, d)

        def local(qkv3, f, beta, gate_out, conv_w3, A_log, dt_bias, o_norm, state, conv, layer, tok_row, cu, q_lens,
                  start_pos, read_slot, write_slot, fresh, snap_row, snap_len, snap_slot, any_pre, *spec):
            R, S = q_lens.shape[0], state.shape[1]
            base = jax.lax.axis_index("dp") * S if self.dp > 1 else 0
            Tl, Pl = f.shape
            kw = {}
            if spec:  # the group's block of entries: its rows' entries made local to it
                jl, decode, jrow, fold_len = spec
                J = jl[0].shape[1]
                jbase = jax.lax.axis_index("dp") * J if self.dp > 1 else 0
                kw = dict(journal=jl, decode=decode, jrow=jnp.where(jrow >= 0, jrow - jbase, -1), fold_len=fold_len)
            return ops.kda_layer_on_pools(
                qkv3.reshape(Tl, 3 * Pl), f, beta, gate_out, conv_w3.reshape(3 * Pl, W), A_log, dt_bias, o_norm, state,
                conv, layer, local_rows(tok_row, R), cu, q_lens, start_pos, jnp.clip(read_slot - base, 0, S - 1),
                self._group_slots(S, write_slot), fresh, local_rows(snap_row, R), snap_len,
                self._group_slots(S, snap_slot), lower_bound=lower_bound, eps=eps, backend=backend,
                prefill_rows=self.kda_prefill_rows, any_prefill=any_pre, **kw)

        out_specs = (P(ax, h, None), st_spec, cv_spec) + ((j_specs,) if journal is not None else ())
        fn = jax.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
        extra = () if journal is None else (tuple(journal), fb.decode, fb.jrow, fb.fold_len)
        # whether some row of the whole step takes the prefill path: one branch on every device
        # (``kernels/kda_pools.py``), as the kernels' rows are defined there
        pre = q_lens >= 2
        if journal is not None:
            pre = pre & ~(fb.decode & (q_lens >= 1))
        return fn(qkv_raw, f, beta, gate_out, conv_w.reshape(3, Pw, W), A_log, dt_bias, o_norm,
                  state_pool, conv_pool, jnp.asarray(layer, jnp.int32), fb.tok_row, fb.cu_q_lens, q_lens,
                  fb.start_pos, fb.read_slot, fb.write_slot, fb.fresh, fb.snap_row, fb.snap_len, fb.snap_slot,
                  jnp.any(pre), *extra)

    # ------------------------------------------------------------------ KDA slots by DP group
    def take_slots(self, pool, slots, kda_heads: int | None = None):
        """``pool[:, slots]`` where each DP group's rows name only its own slots (the KDA
        state keeps its heads split over the group: :meth:`_slot_spec`). Per device, in the
        pool's own layout (also without DP). ``kda_heads``: for the conv pool."""
        return self._take_local(pool, slots, self._slot_spec(pool, kda_heads))

    def put_slots(self, pool, slots, rows, kda_heads: int | None = None):
        """``pool.at[:, slots].set(rows)``; slots out of range are dropped. Per device, in the
        pool's own layout: ``rows`` are brought to it (a few rows), never the pool to them.
        Left to XLA, a dp=1 step scattered into the replicated conv pool split over its
        channels and then all-gathered the whole pool (``tools/step_collectives.py``)."""
        return self._put_local(pool, slots, rows, self._slot_spec(pool, kda_heads))

    def take_entries(self, journal, entries):
        """Each row's journal entry, ``part[:, entries]`` per part of the speculative KDA
        journal (:meth:`journal_shardings`), per device: a DP group's rows name only its own
        block of entries."""
        return tuple(self._take_local(part, entries, sh.spec)
                     for part, sh in zip(journal, self.journal_shardings(journal[0].shape[3])))

    def put_entries(self, journal, entries, rows):
        """``part.at[:, entries].set(rows)`` per part of the journal, per device; entries out of
        range (``-1``, past the end) are dropped."""
        return tuple(self._put_local(part, entries, r, sh.spec)
                     for part, r, sh in zip(journal, rows, self.journal_shardings(journal[0].shape[3])))

    def _take_local(self, pool, slots, spec):
        """``pool[:, slots]`` per device in layout ``spec``: axis 1 (slots or journal entries)
        split over ``"dp"``, each group's rows naming its own block."""

        def local(pool, slots):
            base = jax.lax.axis_index("dp") * pool.shape[1] if self.dp > 1 else 0
            return pool[:, jnp.clip(slots - base, 0, pool.shape[1] - 1)]

        return jax.shard_map(local, mesh=self.mesh, in_specs=(spec, P(self.rows_axis)), out_specs=spec,
                             check_vma=False)(pool, slots)

    def _put_local(self, pool, slots, rows, spec):
        """``pool.at[:, slots].set(rows)`` per device in layout ``spec`` (out-of-block slots dropped)."""

        def local(pool, slots, rows):
            base = jax.lax.axis_index("dp") * pool.shape[1] if self.dp > 1 else 0
            lid = slots - base
            lid = jnp.where((lid >= 0) & (lid < pool.shape[1]), lid, pool.shape[1])
            return pool.at[:, lid].set(rows.astype(pool.dtype), mode="drop")

        return jax.shard_map(local, mesh=self.mesh, in_specs=(spec, P(self.rows_axis), spec), out_specs=spec,
                             check_vma=False)(pool, slots, rows)

    # ------------------------------------------------------------------ experts
    def expert_ffn(self, *args, backend: str = "reference", latent: bool = False, post=None, **kw):
        """The routed experts: explicit EP dispatch/combine (``sharding.ep``) when the recipe
        has EP, and always for a Pallas backend with MXFP4 experts (the grouped-matmul kernel
        runs per rank on its local experts inside the dispatch's ``shard_map``: a kernel left to
        the Auto partitioner would have its sharded weights gathered whole); otherwise the
        partitioner places ``ops.expert_ffn``. ``latent``: the input is the latent
        down-projection's output (:meth:`latent_down`'s layout); ``post``: ``(fn, args)``
        applied to the output (inside the exchange, where the rows are whole)."""
        from ..kernels import ops

        w1 = args[3]
        gmm = backend != "reference" and isinstance(w1, (tuple, list))
        if self.ep_impl is None and not gmm:
            out = ops.expert_ffn(*args, backend=backend, **kw)
            return out if post is None else post[0](out, *post[1])
        from .ep import expert_ffn_ep

        x_split = latent and self._latent_axes(args[0].shape[-1]) is not None
        return expert_ffn_ep(*args, mesh=self.mesh, impl=self.ep_impl or "auto", backend=backend, x_split=x_split,
                             post=post, **kw)

    # ------------------------------------------------------------------ latent MoE projections
    def _latent_axes(self, width: int):
        """``ATTN`` where the latent projections' latent dim is split over it (``param_spec``)."""
        return ATTN if width % self.recipe.attn_group == 0 else None

    def latent_down(self, z):
        """``z`` [T, latent], the output of the column-parallel latent down-projection, pinned
        to the weight's layout (latent over ``ATTN``: each device multiplies by its own rows
        of the weight); the expert dispatch gathers its tokens' rows from it itself
        (``expert_ffn(latent=True)``). Without the constraint XLA's partitioner computed the
        projection in the dispatch's token layout, which all-gathers the whole weight every
        MoE layer (measured: ``tools/step_collectives.py``)."""
        ax = self._latent_axes(z.shape[-1])
        if ax is None:
            return z
        return jax.lax.with_sharding_constraint(z, NamedSharding(self.mesh, P(self.rows_axis, ax)))

    def latent_up(self, r):
        """``r`` [T, latent], the experts' output (replicated), split over ``ATTN`` like the
        columns of the row-parallel latent up-projection that reads it (a local slice), so
        the projection sums partial products instead of gathering its weight."""
        ax = self._latent_axes(r.shape[-1])
        if ax is None:
            return r
        return jax.lax.with_sharding_constraint(r, NamedSharding(self.mesh, P(self.rows_axis, ax)))

    # ------------------------------------------------------------------ sequence parallelism
    def _sp_on(self, x) -> bool:
        B = x.shape[0]
        return self.sp > 1 and B >= self.sp_min_rows and B % (self.sp * self.dp) == 0

    def sp_scatter(self, x):
        """After an output projection: rows split over the SP ranks (a reduce-scatter)."""
        if not self._sp_on(x):
            return self.sp_pin(x)
        axes = (("dp",) if self.dp > 1 else ()) + self.sp_axes
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, P(self._ax(axes), *([None] * (x.ndim - 1)))))

    def sp_pin(self, x, rows=None):
        """The residual stream (``x`` [T, ...], or the AttnRes bank [N, T, ...] with ``rows``
        its [T, ...] partner) pinned whole -- rows split over DP only -- on a step SP leaves
        off. Unpinned, the partitioner split the residual's rows over the model axes anyway and
        gathered them back before each projection: two all-gathers a layer at decode sizes
        (``k3serve compile --only '^decode'``, docs/compile.md)."""
        T = (x if rows is None else rows).shape[0]
        if self.recipe.attn_group == 1 or T % self.dp or self._sp_on(x if rows is None else rows):
            return x
        lead = () if rows is None else (None,)
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, P(*lead, self.rows_axis, *([None] * (x.ndim - 1 - len(lead))))))

    def sp_gather(self, x):
        """Before the next projection: whole rows again (an all-gather)."""
        if not self._sp_on(x):
            return self.sp_pin(x)
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, P(self.rows_axis, *([None] * (x.ndim - 1)))))
