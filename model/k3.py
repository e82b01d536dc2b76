"""The Kimi K3 / Kimi Linear causal LM: embedding, decoder stack, final norm, lm_head.

Residual structure. Kimi Linear uses plain pre-norm residual adds. K3 replaces them with
Block Attention Residuals: a bank of snapshots (taken at layers 0, b, 2b, ... *before* the
attention sublayer) plus the current block's prefix sum; each sublayer input is a softmax
mix over depth of those sources; the prefix sum restarts from the attention output after a
snapshot; the final output is one more mix (model-level weights) before the final norm.
The bank holds only per-token values, so nothing of it crosses tokens or steps.

``step`` is a pure function of the flattened step (``model.step.FlatBatch``): (batch, cache)
-> (logits, new cache[, intermediates]); ``__call__`` runs it on a padded ``[B, T]`` batch.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from .cache import Cache, StepBatch
from .step import FlatBatch, flatten_padded, unflatten
from .kda import KDA
from .layers import AttnResWeights, GatedMLP, Linear, RMSNorm, attn_res, param
from .mla import MLA
from .moe import MoE


class DecoderLayer(nnx.Module):
    def __init__(self, cfg, idx: int, dtype):
        D = cfg.hidden_size
        self.kind = cfg.layer_types[idx]
        self.is_moe = cfg.is_moe_layer(idx)
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype, "embed")
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype, "embed")
        self.self_attn = KDA(cfg, dtype) if self.kind == "kda" else MLA(cfg, dtype)
        if self.is_moe:
            self.block_sparse_moe = MoE(cfg, dtype)
        else:
            self.mlp = GatedMLP(cfg, D, cfg.intermediate_size, dtype)
        if cfg.uses_attn_res:
            self.self_attention_res = AttnResWeights(D, dtype)
            self.mlp_res = AttnResWeights(D, dtype)

    def ffn(self, x, aux, par=None, valid=None):
        if self.is_moe:
            return self.block_sparse_moe(x, aux, par, valid=valid)
        return self.mlp(x)


class KimiLM(nnx.Module):
    def __init__(self, cfg, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        D = cfg.hidden_size
        self.embed_tokens = param((cfg.vocab_size, D), dtype, ("vocab", "embed"))
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype, "embed")
        if cfg.uses_attn_res:
            self.output_attn_res = AttnResWeights(D, dtype)
        self.lm_head = Linear(D, cfg.vocab_size, dtype, ("vocab", "embed"))

    def __call__(self, batch: StepBatch, cache: Cache, capture: bool = False, par=None, logits_at=None):
        """A padded ``[B, T]`` step (tests, goldens, ``KimiModel``): ``(logits, new_cache)`` plus a
        record with ``capture``. Runs the flattened :meth:`step` on the ``B * T`` token axis.

        Logits are ``[B, T, vocab]`` for every position, or, with ``logits_at`` (int ``[B]``, a
        position per row: the token to sample from), ``[B, 1, vocab]`` for those positions only."""
        fb, index = flatten_padded(batch, cache.num_slots, dp=1 if par is None else par.dp)
        if logits_at is not None and not capture:
            at = jnp.take_along_axis(index, logits_at[:, None], axis=1)[:, 0]
            fb = dataclasses.replace(fb, logits_idx=jnp.where(batch.seq_lens > 0, at, -1))
            logits, cache = self.step(fb, cache, par=par)
            return logits[:, None], cache
        out = self.step(fb, cache, capture=capture, par=par, all_logits=True)
        logits = unflatten(out[0], index)
        if not capture:
            return logits, out[1]
        rec = jax.tree.map(lambda v: unflatten(v, index) if getattr(v, "ndim", 0) else v, out[2])
        return logits, out[1], rec

    def step(self, fb: FlatBatch, cache: Cache, capture: bool = False, par=None, all_logits: bool = False):
        """One flattened step (:mod:`model.step`): ``(logits [R, vocab], new_cache)`` at each
        row's ``logits_idx`` (``[T, vocab]`` for every token with ``all_logits``), plus a
        per-token record with ``capture``."""
        cfg = self.cfg
        R = fb.num_rows
        valid = fb.valid
        kda_state, kda_conv, mla_kv = cache.kda_state, cache.kda_conv, cache.mla_kv
        kda_idx = {l: j for j, l in enumerate(cfg.kda_layers)}
        mla_idx = {l: j for j, l in enumerate(cfg.mla_layers)}
        rec = {} if capture else None
        layer_aux = []

        # The residual stream (prefix sums, AttnRes bank) is kept in fp32 whatever the
        # weight dtype; sublayers read it normalised and cast to the compute dtype.
        # KDA rows are gathered once for all layers (by read slot) and scattered back once at
        # the end (by write slot): a per-layer scatter into the pool makes XLA copy the whole
        # pool per layer
        take = (lambda pool, s: pool[:, s]) if par is None else par.take_slots
        if kda_idx:
            conv_rows = jnp.where(fb.fresh[None, :, None, None], 0.0, take(kda_conv, fb.read_slot))
            state_rows = jnp.where(fb.fresh[None, :, None, None, None], 0.0, take(kda_state, fb.read_slot))
        conv_out, state_out, snap_conv, snap_state = [], [], [], []

        # under a recipe, ``par`` (sharding.parallel.StepParallel) runs the ops that need
        # collectives; scatter/gather mark where sequence parallelism splits the tokens
        scatter = (lambda v: v) if par is None else par.sp_scatter
        gather = (lambda v: v) if par is None else par.sp_gather
        h = scatter(jnp.take(self.embed_tokens[...], fb.ids, axis=0).astype(jnp.float32))
        cdt = self.dtype
        if rec is not None:
            rec["embed"] = h
        bank: list = []
        p = h
        eps = cfg.rms_norm_eps
        bsz = cfg.attn_res_block_size
        for l, layer in enumerate(self.layers):
            aux = {} if capture else None
            if cfg.uses_attn_res:
                x = p if not bank else attn_res(bank, p, layer.self_attention_res, eps)
                if l % bsz == 0:
                    bank.append(p)
                    p = None
            else:
                x = p
            a_in = gather(layer.input_layernorm(x).astype(cdt))
            if layer.kind == "kda":
                j = kda_idx[l]
                out, new = layer.self_attn.flat(a_in, conv_rows[j], state_rows[j], fb, aux, par=par)
                for lst, v in zip((conv_out, state_out, snap_conv, snap_state), new):
                    lst.append(v)
            else:
                j = mla_idx[l]
                # the whole pool goes in with the layer index, so the row scatter and the page
                # gather touch only the pages named, never a copy of the layer's pool
                out, mla_kv, rows = layer.self_attn.flat(a_in, mla_kv, j, fb, par=par)
                if aux is not None:
                    aux["mla_rows"] = rows
            out = scatter(out)
            if cfg.uses_attn_res:
                p = out if p is None else p + out
                y = attn_res(bank, p, layer.mlp_res, eps)
            else:
                p = x + out
                y = p
            f = scatter(layer.ffn(gather(layer.post_attention_layernorm(y).astype(cdt)), aux, par, valid=valid))
            p = p + f
            if aux is not None:
                aux.update(attn_in=x, attn_out=out, mlp_in=y, mlp_out=f, prefix_sum=p, num_blocks=len(bank))
                layer_aux.append(aux)

        if kda_idx:
            put = (lambda pool, s, v: pool.at[:, s].set(v, mode="drop")) if par is None else par.put_slots
            kda_conv = put(put(kda_conv, fb.write_slot, jnp.stack(conv_out)), fb.snap_slot, jnp.stack(snap_conv))
            kda_state = put(put(kda_state, fb.write_slot, jnp.stack(state_out)), fb.snap_slot, jnp.stack(snap_state))
        if not all_logits and not capture:  # only the tokens that are sampled
            at = jnp.maximum(fb.logits_idx, 0)
            bank = [v[at] for v in bank]
            p = p[at]
        out = attn_res(bank, p, self.output_attn_res, eps) if cfg.uses_attn_res else p
        normed = gather(self.norm(out).astype(cdt))
        logits = jnp.einsum("td,vd->tv", normed, self.lm_head.weight[...].astype(normed.dtype),
                            preferred_element_type=jnp.float32)
        new_cache = Cache(kda_state=kda_state, kda_conv=kda_conv, mla_kv=mla_kv)
        if not capture:
            return logits, new_cache
        rec.update(layers=layer_aux, attnres_out=out, final_norm_out=normed,
                   block_residual=jnp.stack(bank, axis=-2) if bank else None)
        return logits, new_cache, rec
