"""The Kimi K3 / Kimi Linear causal LM: embedding, decoder stack, final norm, lm_head.

Residual structure. Kimi Linear uses plain pre-norm residual adds. K3 replaces them with
Block Attention Residuals: a bank of snapshots (taken at layers 0, b, 2b, ... *before* the
attention sublayer) plus the current block's prefix sum; each sublayer input is a softmax
mix over depth of those sources; the prefix sum restarts from the attention output after a
snapshot; the final output is one more mix (model-level weights) before the final norm.
The bank holds only per-token values, so nothing of it crosses tokens or steps.

``__call__`` is a pure step: (batch, cache) -> (logits, new cache[, intermediates]).
Prefill chunks (T > 1) use the chunked KDA form, single-token decode the recurrent form.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .cache import Cache, StepBatch
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

    def ffn(self, x, aux, par=None):
        if self.is_moe:
            return self.block_sparse_moe(x, aux, par)
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
        """One step: ``(logits, new_cache)`` (plus a record with ``capture``).

        Logits are ``[B, T, vocab]`` for every position, or, with ``logits_at`` (int ``[B]``, a
        position per row: the token to sample from), ``[B, 1, vocab]`` for those positions only:
        the final norm and LM head then run on ``B`` tokens instead of ``B·T``."""
        cfg = self.cfg
        ids = batch.input_ids
        B, T = ids.shape
        t = jnp.arange(T, dtype=jnp.int32)
        positions = batch.start_pos[:, None] + t[None, :]
        valid = t[None, :] < batch.seq_lens[:, None]
        kv_lens = batch.start_pos + batch.seq_lens
        slots = batch.slot_ids
        # a row starting at position 0 begins from an empty KDA state and conv window,
        # whatever its slot held before (slots are reused without a separate reset)
        fresh = batch.start_pos == 0

        kda_state, kda_conv, mla_kv = cache.kda_state, cache.kda_conv, cache.mla_kv
        kda_idx = {l: j for j, l in enumerate(cfg.kda_layers)}
        mla_idx = {l: j for j, l in enumerate(cfg.mla_layers)}
        rec = {} if capture else None
        layer_aux = []

        # The residual stream (prefix sums, AttnRes bank) is kept in fp32 whatever the
        # weight dtype; sublayers read it normalised and cast to the compute dtype.
        # KDA rows are gathered once for all layers and scattered back once at the end: a
        # per-layer scatter into the pool makes XLA copy the whole pool per layer
        take = (lambda pool: pool[:, slots]) if par is None else (lambda pool: par.take_slots(pool, slots))
        if kda_idx:
            conv_rows = jnp.where(fresh[None, :, None, None], 0.0, take(kda_conv))
            state_rows = jnp.where(fresh[None, :, None, None, None], 0.0, take(kda_state))
        conv_out, state_out = [], []

        # under a recipe, ``par`` (sharding.parallel.StepParallel) runs the ops that need
        # collectives; scatter/gather mark where sequence parallelism splits the rows
        scatter = (lambda v: v) if par is None else par.sp_scatter
        gather = (lambda v: v) if par is None else par.sp_gather
        h = scatter(jnp.take(self.embed_tokens[...], ids, axis=0).astype(jnp.float32))
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
                out, new_conv, new_state = layer.self_attn(a_in, conv_rows[j], state_rows[j], valid, batch.seq_lens, aux)
                conv_out.append(new_conv)
                state_out.append(new_state)
            else:
                j = mla_idx[l]
                # the whole pool goes in with the layer index, so the row scatter and the page
                # gather touch only the pages named, never a copy of the layer's pool
                out, mla_kv, rows = layer.self_attn(a_in, mla_kv, j, batch.page_table, positions, valid, kv_lens,
                                                    par=par)
                if aux is not None:
                    aux["mla_rows"] = rows
            out = scatter(out)
            if cfg.uses_attn_res:
                p = out if p is None else p + out
                y = attn_res(bank, p, layer.mlp_res, eps)
            else:
                p = x + out
                y = p
            f = scatter(layer.ffn(gather(layer.post_attention_layernorm(y).astype(cdt)), aux, par))
            p = p + f
            if aux is not None:
                aux.update(attn_in=x, attn_out=out, mlp_in=y, mlp_out=f, prefix_sum=p, num_blocks=len(bank))
                layer_aux.append(aux)

        if kda_idx:
            put = (lambda pool, v: pool.at[:, slots].set(v)) if par is None else \
                (lambda pool, v: par.put_slots(pool, slots, v))
            kda_conv = put(kda_conv, jnp.stack(conv_out))
            kda_state = put(kda_state, jnp.stack(state_out))
        if logits_at is not None and not capture:  # only the positions that are sampled
            rows = jnp.arange(B)
            bank = [v[rows, logits_at][:, None] for v in bank]
            p = p[rows, logits_at][:, None]
        out = attn_res(bank, p, self.output_attn_res, eps) if cfg.uses_attn_res else p
        normed = gather(self.norm(out).astype(cdt))
        logits = jnp.einsum("btd,vd->btv", normed, self.lm_head.weight[...].astype(normed.dtype),
                            preferred_element_type=jnp.float32)
        new_cache = Cache(kda_state=kda_state, kda_conv=kda_conv, mla_kv=mla_kv)
        if not capture:
            return logits, new_cache
        rec.update(layers=layer_aux, attnres_out=out, final_norm_out=normed,
                   block_residual=jnp.stack(bank, axis=-2) if bank else None)
        return logits, new_cache, rec
