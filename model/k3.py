"""The Kimi K3 / Kimi Linear causal LM: embedding, decoder stack, final norm, lm_head.

Residual structure. Kimi Linear uses plain pre-norm residual adds. K3 replaces them with
Block Attention Residuals: a bank of snapshots (taken at layers 0, b, 2b, ... *before* the
attention sublayer) plus the current block's prefix sum; each sublayer input is a softmax
mix over depth of those sources; the prefix sum restarts from the attention output after a
snapshot; the final output is one more mix (model-level weights) before the final norm.
The bank holds only per-token values, so nothing of it crosses tokens or steps. It is a
fixed array ``[num_blocks, T, D]`` plus a count, so every layer has the same shapes and the
stack runs as one ``lax.scan`` over the layers (``model.layer_plan``).

Parameters are stacked per sublayer type (``model.layer_plan``): ``attn[a]`` holds every
attention sublayer of type ``a`` (KDA, MLA), ``ffn[f]`` every FFN sublayer of type ``f`` (dense
MLP, MoE), ``[sublayers of the type, ...]``. ``sublayer(l, part)`` finds any layer's part;
checkpoint names stay ``model.layers.{l}.*`` (``weights.py``). A layer runs as the attention's
first half (``_layer_in``), the KDA-row, MLA-pool and AttnRes updates outside any switch, the
attention's second half (``_attn_out``) and the FFN (``_ffn``); the halves are switched per
attention type, the FFN per FFN type (docs/model.md, "The layer scan").

``step`` is a pure function of the flattened step (``model.step.FlatBatch``): (batch, cache)
-> (logits, new cache[, intermediates]); ``__call__`` runs it on a padded ``[B, T]`` batch.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..kernels import ops
from .cache import Cache, StepBatch, conv_pool_logical, conv_pool_rows
from .step import FlatBatch, flatten_padded, local_rows, unflatten
from .kda import KDA
from .layer_plan import part_of, plan_layers
from .layers import F32, AttnResWeights, GatedMLP, Linear, RMSNorm, attn_res_bank, param
from .mla import MLA, write_latent_rows
from .moe import MoE
from .packed_rows import is_packed, unpack_rows


class AttnBlock(nnx.Module):
    """A layer's attention sublayer: input norm, AttnRes weights, KDA or MLA."""

    def __init__(self, cfg, kind: str, dtype):
        D = cfg.hidden_size
        self.kind = kind
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype, "embed")
        self.self_attn = KDA(cfg, dtype) if kind == "kda" else MLA(cfg, dtype)
        if cfg.uses_attn_res:
            self.self_attention_res = AttnResWeights(D, dtype)


class FFNBlock(nnx.Module):
    """A layer's FFN sublayer: post-attention norm, AttnRes weights, a dense MLP or a MoE."""

    def __init__(self, cfg, is_moe: bool, dtype):
        D = cfg.hidden_size
        self.is_moe = is_moe
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype, "embed")
        if is_moe:
            self.block_sparse_moe = MoE(cfg, dtype)
        else:
            self.mlp = GatedMLP(cfg, D, cfg.intermediate_size, dtype)
        if cfg.uses_attn_res:
            self.mlp_res = AttnResWeights(D, dtype)

    def ffn(self, x, aux, par=None, valid=None, group=None):
        if self.is_moe:
            return self.block_sparse_moe(x, aux, par, valid=valid, group=group)
        return self.mlp(x)


def _stacked(module: nnx.Module, n: int) -> nnx.Module:
    """``module`` with every parameter given a leading axis of ``n`` (logical axis ``layers``)."""
    for _, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Param):
            v = var.get_value()
            var.set_value(jnp.zeros((n,) + tuple(v.shape), v.dtype))
            var.set_metadata("logical_axes", ("layers",) + tuple(var.get_metadata().get("logical_axes", ())))
    return module


_EXPERTS = nnx.PathContains("experts")  # routed experts (not "shared_experts")


@dataclasses.dataclass
class _Step:
    """What every layer of one step reads besides its own weights and the carry."""
    fb: FlatBatch
    par: object
    capture: bool
    eps: float
    attn_res: bool
    dtype: object
    drafts: int = 0  # speculative decode rows carry up to this many drafts (0: none)

    def scatter(self, v):
        return v if self.par is None else self.par.sp_scatter(v)

    def gather(self, v):
        return v if self.par is None else self.par.sp_gather(v)

    def pin(self, v, rows=None):
        return v if self.par is None else self.par.sp_pin(v, rows)


JOURNAL_KEYS = ("jk", "jeg", "jdelta", "jraw")  # the KDA journal's parts (``kernels/kda_spec.py``)


def journal_shapes(cfg, entries: int, drafts: int, dtype) -> tuple:
    """The speculative KDA journal of ``entries`` running requests with up to ``drafts`` drafts,
    ``((shape, dtype), ...)`` in :data:`JOURNAL_KEYS` order: per KDA layer, entry and draft the key,
    the decay ``e^g`` and the delta (``[H, d]`` fp32 each) and the pre-conv q|k|v row (``[3P]``,
    the model dtype: the conv window holds these values exactly)."""
    nK, H, d = len(cfg.kda_layers), cfg.kda_num_heads, cfg.kda_head_dim
    f = ((nK, entries, drafts, H, d), jnp.float32)
    return f, f, f, ((nK, entries, drafts, 3 * H * d), jnp.dtype(dtype))


def fold_journal(state_rows, conv_rows, journal, jrow, fold_len, par=None):
    """Commit each row's ``fold_len`` accepted drafts from its journal entry ``jrow`` into its
    state rows ``[nK, R, H, dk, dv]`` and conv rows ``[nK, R, W-1, 3P]`` (``kernels/kda_spec.py``:
    the same update as plain decoding, so the result equals it bit for bit). Under a recipe
    (``par``) each device reads its own entries (an attention-DP group's block)."""
    from ..kernels.kda_spec import conv_window_commit, kda_fold

    at = jnp.clip(jrow, 0, journal[0].shape[1] - 1)
    if par is None:
        jk, jeg, jdelta, jraw = (pool[:, at] for pool in journal)  # [nK, R, d, ...]
    else:
        jk, jeg, jdelta, jraw = par.take_entries(journal, at)
    a = jnp.broadcast_to(jnp.where(jrow >= 0, fold_len, 0), state_rows.shape[:2])
    state = kda_fold(state_rows, (jk, jeg, jdelta), a)
    conv = conv_window_commit(conv_rows, jraw, a)
    return state, conv


def _kda_inputs(layer: AttnBlock, a_in) -> tuple:
    """What a KDA layer's core on the pools reads (``ops.kda_layer_on_pools``): the per-token
    projections of its normalised input and its small core parameters."""
    return (*layer.self_attn.project(a_in), *layer.self_attn.core_params())


def _layer_in(layer: AttnBlock, st: dict, kda_rows, ctx: _Step, aux, kda_core: bool = True, want_x: bool = False):
    """First half of an attention sublayer, before the MLA pool write: the AttnRes mix (or
    the residual) and the input norm; a KDA layer's whole attention; an MLA layer's latent rows.

    ``st``: ``p`` (prefix sum / residual [T, D] fp32), ``bank`` and ``count`` (AttnRes), read
    only. Returns ``(t, lat, new)``: the attention output (KDA) or the normalised input (MLA);
    the latent rows to write (MLA) or ``None``; the KDA outputs (conv, state, snapshot conv,
    snapshot state) or ``None``. In the scan every big buffer (the MLA pool, the KDA rows of
    all layers) stays outside the ``lax.switch`` that runs this: a switch's outputs are new
    buffers, so a pool passed through it would be copied once per layer. ``want_x``: a fourth
    output, the pre-norm input ``x`` (the AttnRes mix this layer reads; a draft model's tap)."""
    p = ctx.pin(st["p"])
    x = attn_res_bank(ctx.pin(st["bank"], p), st["count"], p, layer.self_attention_res, ctx.eps) if ctx.attn_res else p
    x = ctx.pin(x)
    a_in = ctx.gather(layer.input_layernorm(x).astype(ctx.dtype))
    if aux is not None:
        aux["attn_in"] = x
    xs = (x,) if want_x else ()
    if layer.kind == "kda" and not kda_core:  # the core runs on the pools, outside the switch
        return (a_in, None, None) + xs
    if layer.kind == "kda":
        out, new = layer.self_attn.flat(a_in, kda_rows[0], kda_rows[1], ctx.fb, aux, par=ctx.par, drafts=ctx.drafts)
        return (ctx.scatter(out).astype(ctx.dtype), None, new) + xs
    return (a_in, layer.self_attn.latent_rows(a_in), None) + xs


def _attn_out(layer: AttnBlock, t, kv, mla_layer, ctx: _Step):
    """Second half of an attention sublayer, after the MLA pool write: an MLA layer's
    attention over the pool (``kv``, read only); a KDA layer's output ``t`` as it is."""
    if layer.kind == "kda":
        return t
    return ctx.scatter(layer.self_attn.attend(t, kv, mla_layer, ctx.fb, par=ctx.par)).astype(t.dtype)


def _ffn(layer: FFNBlock, out, st: dict, ctx: _Step, aux, group=None):
    """The FFN sublayer, after the AttnRes boundary update of ``st``: the residual or AttnRes
    mix of the attention output ``out``, the norm, the MLP or MoE. ``group``: in the scan, the
    layer's row of the routed-expert stacks, which the sublayer holds whole. Returns the new
    ``p``."""
    p, bank, count = ctx.pin(st["p"] + out), st.get("bank"), st.get("count")
    y = ctx.pin(attn_res_bank(ctx.pin(bank, p), count, p, layer.mlp_res, ctx.eps) if ctx.attn_res else p)
    f = ctx.scatter(layer.ffn(ctx.gather(layer.post_attention_layernorm(y).astype(ctx.dtype)), aux, ctx.par,
                              valid=ctx.fb.valid, group=group))
    p = ctx.pin(p + f)
    if aux is not None:
        aux.update(attn_out=out, mlp_in=y, mlp_out=f, prefix_sum=p)
        if ctx.attn_res:
            aux["num_blocks"] = count
    return p


def _boundary_update(st: dict, boundary, ctx: _Step) -> dict:
    """AttnRes: a layer that starts a block pushes the prefix sum into the bank and restarts
    it (``boundary`` static or traced). Without AttnRes nothing changes."""
    if not ctx.attn_res:
        return st
    p, bank, count = st["p"], st["bank"], st["count"]
    if isinstance(boundary, bool):
        if boundary:
            bank = jax.lax.dynamic_update_index_in_dim(bank, p, count, 0)
            count, p = count + 1, jnp.zeros_like(p)
    else:  # traced: write the slot either way (the old value when not a boundary)
        old = jax.lax.dynamic_index_in_dim(bank, count, 0, keepdims=False)
        bank = jax.lax.dynamic_update_index_in_dim(bank, jnp.where(boundary, p, old), count, 0)
        count = count + boundary.astype(count.dtype)
        p = jnp.where(boundary, 0.0, p)
    return dict(st, p=p, bank=bank, count=count)


class KimiLM(nnx.Module):
    def __init__(self, cfg, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.plan = plan = plan_layers(cfg)
        D = cfg.hidden_size
        self.embed_tokens = param((cfg.vocab_size, D), dtype, ("vocab", "embed"))
        self.attn = nnx.List([_stacked(AttnBlock(cfg, kind, dtype), len(plan.layers_of("attn", a)))
                              for a, kind in enumerate(plan.attn_types)])
        self.ffn = nnx.List([_stacked(FFNBlock(cfg, is_moe, dtype), len(plan.layers_of("ffn", f)))
                             for f, is_moe in enumerate(plan.ffn_types)])
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype, "embed")
        if cfg.uses_attn_res:
            self.output_attn_res = AttnResWeights(D, dtype)
        self.lm_head = Linear(D, cfg.vocab_size, dtype, ("vocab", "embed"))

    def sublayer(self, l: int, part: str) -> tuple[AttnBlock | FFNBlock, int, str]:
        """Layer ``l``'s ``part`` ("attn" or "ffn"): the stacked module holding it, its row in
        that stack and the stack's NNX path (``attn.{type}`` / ``ffn.{type}``)."""
        typ, row = self.plan.locate(l, part)
        return (self.attn if part == "attn" else self.ffn)[typ], row, f"{part}.{typ}"

    def layer_weight(self, l: int, name: str) -> jax.Array:
        """Layer ``l``'s parameter ``name`` (``self_attn.A_log``, ``mlp.up_proj.weight``, ...),
        unstacked."""
        mod, g, _ = self.sublayer(l, part_of(name))
        for part in name.split("."):
            mod = getattr(mod, part)
        v = mod.get_value()
        if isinstance(v, jax.ShapeDtypeStruct):  # an abstract model (nnx.eval_shape)
            return jax.ShapeDtypeStruct(v.shape[1:], v.dtype)
        return v[g]

    def __call__(self, batch: StepBatch, cache: Cache, capture: bool = False, par=None, logits_at=None,
                 unroll: bool = False):
        """A padded ``[B, T]`` step (tests, goldens, ``KimiModel``): ``(logits, new_cache)`` plus a
        record with ``capture``. Runs the flattened :meth:`step` on the ``B * T`` token axis.

        Logits are ``[B, T, vocab]`` for every position, or, with ``logits_at`` (int ``[B]``, a
        position per row: the token to sample from), ``[B, 1, vocab]`` for those positions only."""
        fb, index = flatten_padded(batch, cache.num_slots, dp=1 if par is None else par.dp)
        if logits_at is not None and not capture:
            at = jnp.take_along_axis(index, logits_at[:, None], axis=1)[:, 0]
            fb = dataclasses.replace(fb, logits_idx=jnp.where(batch.seq_lens > 0, at, -1))
            logits, cache = self.step(fb, cache, par=par, unroll=unroll)
            return logits[:, None], cache
        out = self.step(fb, cache, capture=capture, par=par, all_logits=True, unroll=unroll)
        logits = unflatten(out[0], index)
        if not capture:
            return logits, out[1]
        rec = jax.tree.map(lambda v: unflatten(v, index) if getattr(v, "ndim", 0) else v, out[2])
        return logits, out[1], rec

    def step(self, fb: FlatBatch, cache: Cache, capture: bool = False, par=None, all_logits: bool = False,
             unroll: bool = False, journal=None, taps: tuple | None = None):
        """One flattened step (:mod:`model.step`): ``(logits [R, vocab], new_cache)`` at each
        row's ``logits_idx`` (``[T, vocab]`` for every token with ``all_logits``), plus a
        per-token record with ``capture``. The layers run as one scan (``model.layer_plan``);
        ``unroll`` (implied by ``capture``, whose per-layer records differ by kind) runs the same
        layer code unrolled, one traced body per layer.

        ``journal`` (speculative decoding, :func:`journal_shapes`): the KDA journal of every
        running request. The step first folds each row's ``fb.fold_len`` accepted drafts into
        its state and conv window, then journals its decode rows' drafts in entry ``fb.jrow``;
        it returns ``(logits [R * n, vocab], new_cache, new_journal)``, logits at every entry of
        ``fb.logits_idx`` ``[R, n]``.

        ``taps`` (a draft model's conditioning, ``model/dspark.py``): ``(layer_ids, stream)``;
        one more output, the hidden states of those layers at every token, ``[T, len(ids) * D]``
        float32 in ``layer_ids`` order. ``stream`` ``"attn_res"``: what the next consumer reads
        (layer ``i + 1``'s AttnRes mix before its input norm; after the last layer the output
        mix), as SGLang captures it; ``"prefix"``: the residual stream after layer ``i`` (the
        block's prefix sum under AttnRes). Without AttnRes both are the residual stream."""
        cfg, plan = self.cfg, self.plan
        if taps is not None and capture:
            raise ValueError("target taps are not supported with capture")
        tap_ids, tap_stream = taps if taps is not None else ((), "prefix")
        tap_index = {l: j for j, l in enumerate(tap_ids)}
        n_taps = len(tap_ids)
        kda_idx = {l: j for j, l in enumerate(cfg.kda_layers)}
        mla_idx = {l: j for j, l in enumerate(cfg.mla_layers)}
        drafts = 0 if journal is None else journal[0].shape[2]
        ctx = _Step(fb, par, capture, cfg.rms_norm_eps, cfg.uses_attn_res, self.dtype, drafts)
        bsz = cfg.attn_res_block_size

        def boundary(l):
            return bool(cfg.uses_attn_res and l % bsz == 0)

        # KDA rows are gathered once for all layers (by read slot) and scattered back once at
        # the end (by write slot): a per-layer scatter into the pool makes XLA copy the whole
        # pool per layer
        H_kda = cfg.kda_num_heads
        take = (lambda pool, s: pool[:, s]) if par is None else functools.partial(par.take_slots, kda_heads=H_kda)
        # a Pallas backend runs each KDA layer's core on the pools in place, outside the
        # switches (``ops.kda_layer_on_pools``): nothing is gathered before the stack or
        # scattered after it. Under a recipe it runs per rank on the rank's slots and heads
        # (``StepParallel.kda_layer_on_pools``).
        # A speculative step runs its decode rows through the kernel's record mode
        # (``kernels/kda_spec_kernel.py``: the fold fused in, the journal carried through the scan
        # and updated in place); under a recipe each rank on its block of the journal
        # (``StepParallel.kda_layer_on_pools``)
        fused_kda = bool(kda_idx) and cfg.kernels != "reference" and ops.kda_kernels_fit(cfg.kda_head_dim, cfg.kernels)
        if kda_idx and not fused_kda:
            # the conv pool stores a window as rows of one head, rank-major when the heads are
            # split over ranks (``model.cache.conv_pool_rows``, ``StepParallel.conv_groups``);
            # the reference core reads [W-1, q | k | v]
            conv_groups = 1 if par is None else par.conv_groups(H_kda)
            conv_rows = jnp.where(fb.fresh[None, :, None, None], 0.0,
                                  conv_pool_logical(take(cache.kda_conv, fb.read_slot), conv_groups,
                                                    cfg.conv_kernel_size - 1, H_kda))
            state_rows = jnp.where(fb.fresh[None, :, None, None, None], 0.0, take(cache.kda_state, fb.read_slot))
            if journal is not None:  # last step's accepted drafts, committed as plain decoding would
                state_rows, conv_rows = fold_journal(state_rows, conv_rows, journal, fb.jrow, fb.fold_len, par)

        # The residual stream (prefix sums, AttnRes bank) is kept in fp32 whatever the
        # weight dtype; sublayers read it normalised and cast to the compute dtype.
        h = ctx.scatter(jnp.take(self.embed_tokens[...], fb.ids, axis=0).astype(F32))
        carry = {"p": h, "kv": cache.mla_kv}
        if cfg.uses_attn_res:
            carry["bank"] = jnp.zeros((cfg.num_attn_res_blocks,) + h.shape, F32)
            carry["count"] = jnp.int32(0)
        L = plan.num_layers
        if n_taps:
            if max(tap_ids) >= L:
                raise ValueError(f"target taps {list(tap_ids)} reach past the model's {L} layers")
            carry["taps"] = jnp.zeros((n_taps,) + h.shape, F32)
        # where layer l's tap is written: its input x taps layer l - 1 ("attn_res"), its output p layer l
        tap_in = np.array([tap_index.get(l - 1, n_taps) if tap_stream == "attn_res" else n_taps
                           for l in range(L)], np.int32)
        tap_out = np.array([tap_index.get(l, n_taps) if tap_stream != "attn_res" else n_taps
                            for l in range(L)], np.int32)
        kda_of = np.array([kda_idx.get(l, 0) for l in range(L)], np.int32)
        mla_of = np.array([mla_idx.get(l, 0) for l in range(L)], np.int32)
        if fused_kda:  # under a recipe each rank's block of the conv pool is its heads' q|k|v
            carry.update(state_pool=cache.kda_state, conv_pool=cache.kda_conv)
            if journal is not None:  # the whole journal, updated in place layer by layer
                carry.update(zip(JOURNAL_KEYS, journal))
        elif kda_idx:
            NS = fb.snap_slot.shape[0]
            carry.update(conv=conv_rows, state=state_rows,
                         snap_conv=jnp.zeros((len(kda_idx), NS) + conv_rows.shape[2:], F32),
                         snap_state=jnp.zeros((len(kda_idx), NS) + state_rows.shape[2:], F32))
            if drafts:  # this step's journal rows, shaped as the journal's entries
                for n, pool in zip(JOURNAL_KEYS, journal):
                    carry[n] = jnp.zeros((len(kda_idx), fb.num_rows) + pool.shape[2:], F32)
        # routed experts stay whole stacks indexed by row inside the expert op: a slice of
        # them is a copy of the layer's experts per layer (50 MB on the 105M checkpoint);
        # the other parameters are sliced per layer
        attn_parts = [nnx.split(blk) for blk in self.attn]
        ffn_parts = [nnx.split(blk, nnx.Not(_EXPERTS), _EXPERTS) for blk in self.ffn]
        # a layer stack stored packed (``model.packed_rows``: uint32 row pairs, the matmuls'
        # tiling on a TPU) is unpacked per layer: in the scan's body, in VMEM, where the
        # layer's slice is read
        rows_of = lambda tree, row: jax.tree.map(
            lambda a: unpack_rows(a[row], self.dtype) if is_packed(a) else a[row], tree)

        def attn_at(a, row) -> AttnBlock:
            g, s = attn_parts[a]
            return nnx.merge(g, rows_of(s, row))

        def ffn_at(f, row) -> FFNBlock:
            g, rest, experts = ffn_parts[f]
            return nnx.merge(g, rows_of(rest, row), experts)
        st_keys = ("p", "bank", "count") if cfg.uses_attn_res else ("p",)
        n_kda, n_mla = len(kda_idx), len(mla_idx)
        kv_width, kv_dtype = cache.mla_kv.shape[-1], cache.mla_kv.dtype
        T = fb.ids.shape[0]

        kda_keys = ("conv", "state", "snap_conv", "snap_state") + (JOURNAL_KEYS if drafts else ())
        kda_shapes = [carry[n].shape[1:] for n in kda_keys] if n_kda and not fused_kda else []
        if fused_kda:  # what a KDA layer's first half hands the core: shapes for the other branches
            kda_a = plan.attn_types.index("kda")
            kin_shapes = jax.eval_shape(
                lambda: _kda_inputs(attn_at(kda_a, 0), jnp.zeros((T, cfg.hidden_size), self.dtype)))

        # a Pallas backend writes the MLA rows and attends in one kernel, outside the switches
        # (the pool aliased in place); the MLA branch then also returns the layer's queries.
        # Under a recipe it runs per rank on the rank's pages, DCP partials merged by their LSE
        # (``StepParallel.mla_write_attend_flat``).
        fused_mla = bool(n_mla) and cfg.kernels != "reference"
        H_mla, Lr, Rr = cfg.mla_num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim

        def half_in(a, st, conv, state, row, aux=None, pad=False):
            """Static attention type ``a``: ``(t, lat, new, q, x)``; with ``pad`` every output is
            present (zeros where the type has none), as the switch's branches must agree. ``x``
            (the layer's pre-norm input) only when a layer's input is tapped, else ``None``."""
            layer = attn_at(a, row)
            t, lat, new, *x = _layer_in(layer, st, (conv, state), ctx, aux, kda_core=not fused_kda,
                                        want_x=bool(n_taps) and tap_stream == "attn_res")
            x = x[0] if x else None
            q = layer.self_attn.queries(t) if fused_mla and layer.kind == "mla" else None
            if pad and fused_mla and q is None:
                q = (jnp.zeros((T, H_mla, Lr), F32), jnp.zeros((T, H_mla, Rr), t.dtype))
            if pad and n_mla and lat is None:
                lat = jnp.zeros((T, kv_width), kv_dtype)
            if fused_kda:  # the KDA inputs ride in ``new``
                new = _kda_inputs(layer, t) if layer.kind == "kda" else (
                    tuple(jnp.zeros(s.shape, s.dtype) for s in kin_shapes) if pad else None)
                return t, (None if lat is None else lat.astype(kv_dtype)), new, q, x
            if pad and n_kda and new is None:
                new = tuple(jnp.zeros(shape, F32) for shape in kda_shapes)
            return t, (None if lat is None else lat.astype(kv_dtype)), (None if new is None else tuple(
                v.astype(F32) for v in new)), q, x

        def attn_out(a, t, kv, row, mla_j, out_lat=None, o_kda=None):
            layer = attn_at(a, row)
            if out_lat is not None and layer.kind == "mla":  # attended by the fused kernel
                return ctx.scatter(layer.self_attn.project_out(t, out_lat)).astype(t.dtype)
            if o_kda is not None and layer.kind == "kda":  # the core ran on the pools
                return ctx.scatter(layer.self_attn.o_proj(o_kda.reshape(T, -1).astype(t.dtype))).astype(t.dtype)
            return _attn_out(layer, t, kv, mla_j, ctx)

        def ffn(f, out, st, row, aux=None):
            return _ffn(ffn_at(f, row), out, st, ctx, aux, group=row)

        attn_is_kda = np.array([kind == "kda" for kind in plan.attn_types])
        n_attn, n_ffn = len(plan.attn_types), len(plan.ffn_types)

        def branch(fn, n, i, *args):
            """``fn(i, *args)``: ``i`` static (unrolled) or traced (a switch over ``n`` types)."""
            if isinstance(i, int):
                return fn(i, *args)
            return jax.lax.switch(i, [functools.partial(fn, j) for j in range(n)], *args)

        def put_tap(carry, j, v):
            """Tap slot ``j`` := ``v`` (``j == n_taps``: no tap; static or traced)."""
            if not n_taps or (isinstance(j, (int, np.integer)) and j >= n_taps):
                return carry
            return dict(carry, taps=carry["taps"].at[j].set(v.astype(F32), mode="drop"))

        def layer_step(carry, a, a_row, f, f_row, flag, kda_j, mla_j, aux=None, tin=None, tout=None):
            """One layer: types and rows static (unrolled) or traced (scan)."""
            static = isinstance(a, int)
            is_kda = bool(attn_is_kda[a]) if static else jnp.asarray(attn_is_kda)[a]
            is_mla = not is_kda if static else ~is_kda
            st = {n: carry[n] for n in st_keys}
            conv = state = None
            if n_kda and not fused_kda:
                conv, state = carry["conv"][kda_j], carry["state"][kda_j]
            if static:
                t, lat, new, q, x = half_in(a, st, conv, state, a_row, aux)
            else:
                t, lat, new, q, x = branch(functools.partial(half_in, pad=True), n_attn, a, st, conv, state, a_row)
            carry = dict(carry)
            if x is not None:
                carry = put_tap(carry, tin, x)
            o_kda = None
            if fused_kda and (is_kda is not False):  # a non-KDA layer's rows have no tokens
                q_lens = fb.q_lens if is_kda is True else jnp.where(is_kda, fb.q_lens, 0)
                kw = dict(lower_bound=cfg.gate_lower_bound, eps=cfg.rms_norm_eps, backend=cfg.kernels)
                if ctx.par is not None:  # per rank; with the journal, each rank's block of it
                    jl = None if journal is None else tuple(carry[n] for n in JOURNAL_KEYS)
                    out = ctx.par.kda_layer_on_pools(*new, carry["state_pool"], carry["conv_pool"], kda_j, fb, q_lens,
                                                     journal=jl, **kw)
                    o_kda, carry["state_pool"], carry["conv_pool"] = out[:3]
                    if journal is not None:
                        carry.update(zip(JOURNAL_KEYS, out[3]))
                else:
                    if journal is not None:
                        kw.update(journal=tuple(carry[n] for n in JOURNAL_KEYS), decode=fb.decode, jrow=fb.jrow,
                                  fold_len=fb.fold_len)
                    out = ops.kda_layer_on_pools(
                        new[0].reshape(T, -1), *new[1:], carry["state_pool"], carry["conv_pool"], kda_j,
                        local_rows(fb.tok_row, fb.num_rows),
                        fb.cu_q_lens, q_lens, fb.start_pos, fb.read_slot, fb.write_slot, fb.fresh,
                        local_rows(fb.snap_row, fb.num_rows), fb.snap_len, fb.snap_slot, **kw)
                    o_kda, carry["state_pool"], carry["conv_pool"] = out[:3]
                    if journal is not None:
                        carry.update(zip(JOURNAL_KEYS, out[3]))
            elif n_kda and (is_kda is not False):  # a non-KDA layer's zeros go to a dropped index
                at = kda_j if is_kda is True else jnp.where(is_kda, kda_j, n_kda)
                for n, v in zip(kda_keys, new):
                    carry[n] = carry[n].at[at].set(v, mode="drop")
            out_lat = None
            if n_mla and (is_mla is not False):  # a non-MLA layer writes no rows
                wfb = fb if is_mla is True else dataclasses.replace(fb, tok_row=jnp.where(is_mla, fb.tok_row, -1))
                if fused_mla and ctx.par is not None:  # per rank, on the rank's pages
                    q_lens = fb.q_lens if is_mla is True else jnp.where(is_mla, fb.q_lens, 0)
                    out_lat, carry["kv"] = ctx.par.mla_write_attend_flat(
                        *q, lat, carry["kv"], mla_j, fb, wfb.tok_row, q_lens, cfg.qk_head_dim ** -0.5, Lr,
                        backend=cfg.kernels)
                elif fused_mla:  # and attends nowhere: its rows have no tokens
                    q_lens = fb.q_lens if is_mla is True else jnp.where(is_mla, fb.q_lens, 0)
                    out_lat, carry["kv"] = ops.mla_write_attend(
                        *q, lat, carry["kv"], mla_j, fb.page_table, local_rows(wfb.tok_row, fb.num_rows), fb.pos,
                        fb.kv_lens, fb.cu_q_lens, q_lens, cfg.qk_head_dim ** -0.5, Lr, backend=cfg.kernels)
                else:
                    carry["kv"] = write_latent_rows(lat, carry["kv"], mla_j, wfb, par=ctx.par)
                if aux is not None:
                    aux["mla_rows"] = lat
            st = _boundary_update(st, flag, ctx)
            out = branch(attn_out, n_attn, a, t, None if fused_mla else carry["kv"], a_row, mla_j, out_lat, o_kda)
            p = ffn(f, out, st, f_row, aux) if static else branch(ffn, n_ffn, f, out, st, f_row)
            carry.update(st, p=p)
            return put_tap(carry, tout, p)

        records: list = []
        if capture or unroll:
            for l in range(L):
                aux = {} if capture else None
                carry = layer_step(carry, *plan.locate(l, "attn"), *plan.locate(l, "ffn"), boundary(l),
                                   int(kda_of[l]), int(mla_of[l]), aux, int(tap_in[l]), int(tap_out[l]))
                if aux is not None:
                    records.append(aux)
        else:
            xs = {"a": np.array(plan.attn_of, np.int32), "a_row": np.array(plan.attn_row, np.int32),
                  "f": np.array(plan.ffn_of, np.int32), "f_row": np.array(plan.ffn_row, np.int32),
                  "flag": np.array([boundary(l) for l in range(L)]), "kda": kda_of, "mla": mla_of,
                  "tin": tap_in, "tout": tap_out}
            carry, _ = jax.lax.scan(lambda c, x: (layer_step(c, x["a"], x["a_row"], x["f"], x["f_row"], x["flag"],
                                                             x["kda"], x["mla"], None, x["tin"], x["tout"]), None),
                                    carry, xs)

        kda_state, kda_conv = cache.kda_state, cache.kda_conv
        if fused_kda:
            kda_state, kda_conv = carry["state_pool"], carry["conv_pool"]
            if journal is not None:
                journal = tuple(carry[n] for n in JOURNAL_KEYS)
        elif kda_idx:
            conv_out, state_out, snap_conv, snap_state = (carry[n] for n in kda_keys[:4])
            conv_out, snap_conv = (conv_pool_rows(v, conv_groups, cfg.kda_head_dim) for v in (conv_out, snap_conv))
            put = ((lambda pool, s, v: pool.at[:, s].set(v, mode="drop")) if par is None else
                   functools.partial(par.put_slots, kda_heads=H_kda))
            kda_conv = put(put(kda_conv, fb.write_slot, conv_out), fb.snap_slot, snap_conv)
            kda_state = put(put(kda_state, fb.write_slot, state_out), fb.snap_slot, snap_state)
            if drafts:  # entry J: rows without one (the scatter drops it)
                at = jnp.where(fb.jrow >= 0, fb.jrow, journal[0].shape[1])
                if par is None:
                    journal = tuple(pool.at[:, at].set(carry[n].astype(pool.dtype), mode="drop")
                                    for pool, n in zip(journal, JOURNAL_KEYS))
                else:  # per device, in the layout it came in (the AOT programs fix it)
                    journal = par.put_entries(journal, at, tuple(carry[n] for n in JOURNAL_KEYS))
        p, bank = carry["p"], carry.get("bank")
        tapped = None
        if n_taps:
            tap_all = carry["taps"]
            if tap_stream == "attn_res" and (L - 1) in tap_index:  # the last layer's consumer: the output mix
                last = attn_res_bank(bank, carry["count"], p, self.output_attn_res, ctx.eps) if cfg.uses_attn_res else p
                tap_all = tap_all.at[tap_index[L - 1]].set(last.astype(F32))
            tapped = ctx.gather(jnp.moveaxis(tap_all, 0, 1).reshape(p.shape[0], -1))  # whole rows (split over DP)
        if not all_logits and not capture:  # only the tokens that are sampled
            at = jnp.maximum(fb.logits_idx.reshape(-1), 0)
            p = p[at]
            # block by block: XLA:TPU fused the one [blocks, T, D] gather with a relayout that ran
            # out of scoped VMEM at 2 blocks (a 13-layer K3 at 64 rows; docs/compile.md)
            bank = None if bank is None else jnp.stack([bank[b][at] for b in range(bank.shape[0])])
        out = attn_res_bank(bank, carry["count"], p, self.output_attn_res, ctx.eps) if cfg.uses_attn_res else p
        normed = ctx.gather(self.norm(out).astype(self.dtype))
        logits = jnp.einsum("td,vd->tv", normed, self.lm_head.weight[...].astype(normed.dtype),
                            preferred_element_type=jnp.float32)
        new_cache = Cache(kda_state=kda_state, kda_conv=kda_conv, mla_kv=carry["kv"])
        extra = () if tapped is None else (tapped,)
        if journal is not None and not capture:
            return (logits, new_cache, journal) + extra
        if not capture:
            return (logits, new_cache) + extra
        rec = {"embed": h, "layers": records, "attnres_out": out, "final_norm_out": normed,
               "block_residual": None if bank is None else jnp.moveaxis(bank, 0, -2)}
        return logits, new_cache, rec
