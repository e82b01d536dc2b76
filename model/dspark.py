"""The DSpark draft model (K3's ``K3DSparkModel``): a small dense MLA stack that proposes a
whole block of tokens in one forward pass, conditioned on target hidden states, plus a
low-rank Markov head that makes the block's tokens depend on each other when sampled.

Data flow (batched over requests: a leading axis ``B`` everywhere)::

    target taps [B, T, n_taps * Dt]  (hidden states of target_layer_ids, concatenated in order)
      -> context_proj -> context_norm                       = context hidden c  [B, T, D]
      -> per draft layer l: [RMSNorm_l(c W_kva_l[:Lr]) | RoPE(c W_kva_l[Lr:], pos)]
                                                            = context KV [B, L, T, Lr + R]
    (:meth:`DSparkDraft.context_kv`; written once per committed token, cached by the caller)

    block = [anchor, mask, ..., mask] (block_size tokens) at positions anchor_pos + 0 .. S-1,
            embedded with the *target's* embed_tokens
      -> L x (pre-norm residual: x += MLA(norm(x)); x += MLP(norm(x)))
         MLA: DeepSeek-V3 style, q LoRA, RoPE (interleaved pairs, DeepSeek YaRN) on the 64
         "rope" dims, no output gate; every block query attends to all valid context rows of
         its request and to every block row (non-causal inside the block)
      -> final_norm -> the target's lm_head             = base logits [B, S, V]
    (:meth:`DSparkDraft.propose`)

    Markov head (vanilla): logits_i = base_i + markov_w2 @ markov_w1[prev], prev = the anchor
    for i = 0, then the token drawn at i - 1  (:meth:`DSparkDraft.sample_block`).

Choices where the sources are silent, and what they rest on:

* The context KV is projected from ``context_norm(context_proj(taps))`` directly, without the
  layer's ``input_layernorm`` (vLLM's fused ``context_kv_proj`` and tokenspeed's
  ``write_context_kv`` both do this).
* The mask positions embed the target's ``embed_tokens[mask_token_id]`` (vLLM: "DSpark masks
  via the vocab row"; its ``mask_embedding`` parameter is an unused placeholder). The id comes
  from the draft's config.json; there is no default.
* Positions: a context token keeps its own sequence position (its RoPE is applied when the
  row is written); the anchor — the last accepted token, whose target hidden state does not
  exist yet — sits at ``anchor_pos`` and mask ``i`` at ``anchor_pos + i``; block position
  ``i`` predicts the token at ``anchor_pos + i + 1``.
* RoPE rotates interleaved pairs ``(x[2j], x[2j+1])`` (vLLM builds the draft's rotary with
  ``is_neox_style=False``); the angle ``pos * inv_freq`` is computed in float32, as vLLM's
  float32 cos/sin cache is. Latent norms use ``rms_norm_eps`` (1e-5), not the target's 1e-6.
* Sampling (:class:`SampleKeys`): block position ``i`` of a request draws Gumbel noise from
  ``fold_in(key(seed), step + i)`` — the key plain decoding uses for the token that position
  predicts (``server.engine.sampler``), so draft and target verification share their noise
  (the coupling vLLM's DSpark gets by keying on the predecessor position). Acceptance stays
  the engine's "accept while the target's sample equals the draft" (``server.spec.accept``),
  which is exact whatever the draft; the coupling only raises the acceptance rate. No
  top-k/top-p on the draft side.

What is proven (``tests/test_dspark_model.py``, synthetic weights only): the JAX forward
equals an independent float64 numpy transcription of the math above (context projection,
per-layer context KV, YaRN RoPE, non-causal MLA in its expanded — not absorbed — form, MLP,
final norm, lm_head, the greedy Markov chain) to ~1e-5 relative; the context KV is the same
computed in chunks or at once; requests of different context lengths batched together equal
each alone; seeded sampling is a pure function of (seed, step, logits) and uses the engine's
keys. What is *not* proven: agreement with the released checkpoint or any other
implementation's outputs (no trained weights exist here), that the tap definition and the
chosen mask token match what the draft was trained with, and anything about acceptance rates.
The engine drafts with it (``server/spec/dspark_drafting.py``): its context KV lives in the
target's MLA pool (extra layers after the target's, the same pages), written by
:meth:`write_context` after every step, and :meth:`propose_paged` reads it there.
"""
from __future__ import annotations

import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .dspark_config import DSparkConfig
from .layers import F32, GatedMLP, Linear, RMSNorm, param

GREEDY_TEMPERATURE = 1e-5  # as server.engine.sampling_params: rows below it take the argmax
PRNG_IMPL = "threefry2x32"  # as server.engine.sampler: the same keys as plain decoding


# ---------------------------------------------------------------------------------- RoPE
def rope_inv_freq(cfg: DSparkConfig) -> np.ndarray:
    """Inverse frequencies ``[R/2]`` (float64, host constant): plain RoPE, or DeepSeek YaRN —
    the extrapolated (``theta^-2j/R``) and interpolated (``/ factor``) frequencies blended by
    a linear ramp over the dims whose wavelengths fall between ``beta_fast`` and ``beta_slow``
    rotations of ``original_max_position_embeddings``."""
    R, base = cfg.qk_rope_head_dim, cfg.rope_theta
    extrap = 1.0 / base ** (np.arange(0, R, 2, dtype=np.float64) / R)
    y = cfg.rope_scaling
    if y is None:
        return extrap

    def corr_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times
        return R * np.log(y.original_max_position_embeddings / (rotations * 2 * np.pi)) / (2 * np.log(base))

    low = max(int(np.floor(corr_dim(y.beta_fast))), 0)
    high = min(int(np.ceil(corr_dim(y.beta_slow))), R - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(R // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: extrapolate (high frequency), 0: interpolate
    return (extrap / y.factor) * (1.0 - keep) + extrap * keep


def apply_rope(x, positions, cfg: DSparkConfig):
    """Rotate interleaved pairs of ``x [B, T, (H,) R]`` by ``positions [B, T]``; float32 out."""
    inv = jnp.asarray(rope_inv_freq(cfg), F32)
    ang = positions.astype(F32)[..., None] * inv  # [B, T, R/2]
    m = cfg.rope_cos_sin_scale
    cos, sin = jnp.cos(ang) * m, jnp.sin(ang) * m
    if x.ndim == positions.ndim + 2:  # a heads axis
        cos, sin = cos[..., None, :], sin[..., None, :]
    xf = x.astype(F32)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.reshape(x.shape)


# ---------------------------------------------------------------------------------- layers
class DSparkAttention(nnx.Module):
    """DeepSeek-V3 MLA with RoPE and no output gate, non-causal over context + block."""

    def __init__(self, cfg: DSparkConfig, dtype):
        D, H, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.rms_norm_eps
        self.cfg = cfg
        self.q_a_proj = Linear(D, cfg.q_lora_rank, dtype, ("q_lora", "embed"))
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps, dtype, "q_lora")
        self.q_b_proj = Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, dtype, ("heads", "q_lora"))
        self.kv_a_proj_with_mqa = Linear(D, cfg.latent_width, dtype, ("kv_latent", "embed"))
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps, dtype, "kv_latent")
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype,
                                ("heads", "kv_latent"))
        self.o_proj = Linear(H * cfg.v_head_dim, D, dtype, ("embed", "heads"))

    def latent_rows(self, x, positions):
        """Cache rows of ``x [B, T, D]`` at ``positions [B, T]``: ``[RMSNorm(c) | RoPE(k_pe)]``
        ``[B, T, Lr + R]`` in ``x``'s dtype."""
        Lr = self.cfg.kv_lora_rank
        ckv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(ckv[..., :Lr])
        k_pe = apply_rope(ckv[..., Lr:], positions, self.cfg).astype(x.dtype)
        return jnp.concatenate([c, k_pe], axis=-1)

    def __call__(self, x, positions, ctx_rows, ctx_valid):
        """Block queries ``x [B, S, D]`` (normed layer input) at ``positions [B, S]`` over the
        request's context rows ``ctx_rows [B, C, W]`` (``ctx_valid [B, C]``) and the block's own
        rows; absorbed form (scores and values in latent space), float32 inside."""
        cfg = self.cfg
        B, S, _ = x.shape
        H, nope, R, dv, Lr = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                              cfg.v_head_dim, cfg.kv_lora_rank)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).reshape(B, S, H, nope + R)
        q_nope, q_pe = q[..., :nope].astype(F32), apply_rope(q[..., nope:], positions, cfg)
        rows = jnp.concatenate([ctx_rows.astype(x.dtype), self.latent_rows(x, positions)], axis=1).astype(F32)
        valid = jnp.concatenate([ctx_valid, jnp.ones((B, S), bool)], axis=1)  # [B, C + S]
        w = self.kv_b_proj.weight[...].astype(F32).reshape(H, nope + dv, Lr)
        q_lat = jnp.einsum("bshn,hnl->bshl", q_nope, w[:, :nope])
        c_all, pe_all = rows[..., :Lr], rows[..., Lr:]
        s = jnp.einsum("bshl,btl->bhst", q_lat, c_all) + jnp.einsum("bshr,btr->bhst", q_pe, pe_all)
        s = jnp.where(valid[:, None, None, :], s * cfg.softmax_scale, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        o_lat = jnp.einsum("bhst,btl->bshl", p, c_all)
        o = jnp.einsum("bshl,hvl->bshv", o_lat, w[:, nope:]).reshape(B, S, H * dv)
        return self.o_proj(o.astype(x.dtype))


    def attend_paged(self, x, positions, pool, layer, page_table, ctx_lens, backend: str = "reference", par=None):
        """:meth:`__call__` with the context rows in a paged pool: block queries ``x [R, S, D]``
        at ``positions [R, S]``; row ``r``'s context is its first ``ctx_lens[r]`` positions in
        layer ``layer`` of ``pool [layers, pages, page_size, W]`` through ``page_table [R, P]``
        (rows written by :meth:`DSparkDraft.write_context`; ``ctx_lens`` 0: no context). The
        context part runs as ragged paged MLA attention (``kernels.ops.mla_write_attend``, the
        target's kernel; every block query of a row sees the whole context), the block's own
        rows densely, and the two softmax partials merge by their log-sum-exp.

        ``par`` (a ``sharding.parallel.StepParallel``): under a recipe the context part runs per
        rank (``StepParallel.mla_write_attend_flat`` writing nothing: each DCP rank over its
        pages, merged exactly), the rows laid out as the step's (``R`` = dp groups of rows,
        group-local row ids)."""
        from ..kernels import ops

        cfg = self.cfg
        R, S, _ = x.shape
        H, nope, Rr, dv, Lr = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                               cfg.v_head_dim, cfg.kv_lora_rank)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).reshape(R, S, H, nope + Rr)
        q_nope, q_pe = q[..., :nope].astype(F32), apply_rope(q[..., nope:], positions, cfg)
        w = self.kv_b_proj.weight[...].astype(F32).reshape(H, nope + dv, Lr)
        q_lat = jnp.einsum("bshn,hnl->bshl", q_nope, w[:, :nope])
        # the context: R rows of S queries each, all at the row's last context position
        ctx_lens = jnp.asarray(ctx_lens, jnp.int32)
        rows = jnp.arange(R, dtype=jnp.int32)
        if par is None:
            out_c, lse_c, _ = ops.mla_write_attend(
                q_lat.reshape(R * S, H, Lr), q_pe.reshape(R * S, H, Rr), None, pool, layer, page_table,
                jnp.repeat(rows, S), jnp.repeat(ctx_lens - 1, S), ctx_lens, jnp.arange(R + 1, dtype=jnp.int32) * S,
                jnp.full((R,), S, jnp.int32), cfg.softmax_scale, Lr, backend=backend, return_lse=True)
        else:  # group-local rows, each group's query offsets from 0
            Rg = R // par.dp
            at = types.SimpleNamespace(page_table=page_table, pos=jnp.repeat(ctx_lens - 1, S), kv_lens=ctx_lens,
                                       cu_q_lens=jnp.tile(jnp.arange(Rg + 1, dtype=jnp.int32) * S, par.dp))
            out_c, lse_c, _ = par.mla_write_attend_flat(
                q_lat.reshape(R * S, H, Lr), q_pe.reshape(R * S, H, Rr), None, pool, layer, at,
                jnp.repeat(rows % Rg, S), jnp.full((R,), S, jnp.int32), cfg.softmax_scale, Lr, backend,
                return_lse=True)
        out_c, lse_c = out_c.reshape(R, S, H, Lr), lse_c.reshape(R, S, H)
        # the block's own rows (non-causal)
        blk = self.latent_rows(x, positions).astype(F32)
        c_b, pe_b = blk[..., :Lr], blk[..., Lr:]
        s = (jnp.einsum("bshl,btl->bsht", q_lat, c_b) + jnp.einsum("bshr,btr->bsht", q_pe, pe_b)) * cfg.softmax_scale
        lse_b = jax.nn.logsumexp(s, axis=-1)
        out_b = jnp.einsum("bsht,btl->bshl", jnp.exp(s - lse_b[..., None]), c_b)
        m = jnp.maximum(lse_c, lse_b)  # lse_b is finite: every query sees the block
        wc, wb = jnp.exp(lse_c - m), jnp.exp(lse_b - m)
        o_lat = (out_c * wc[..., None] + out_b * wb[..., None]) / (wc + wb)[..., None]
        o = jnp.einsum("bshl,hvl->bshv", o_lat, w[:, nope:]).reshape(R, S, H * dv)
        return self.o_proj(o.astype(x.dtype))


class DSparkLayer(nnx.Module):
    """Plain pre-norm residual decoder layer: no KDA, no MoE, no AttnRes."""

    def __init__(self, cfg: DSparkConfig, dtype):
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(D, eps, dtype, "embed")
        self.self_attn = DSparkAttention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(D, eps, dtype, "embed")
        self.mlp = GatedMLP(cfg, D, cfg.intermediate_size, dtype)

    def __call__(self, h, positions, ctx_rows, ctx_valid):
        h = h + self.self_attn(self.input_layernorm(h), positions, ctx_rows, ctx_valid)
        return h + self.mlp(self.post_attention_layernorm(h))

    def paged(self, h, positions, *pool_args, backend: str = "reference", par=None):
        """:meth:`__call__` with the context in a paged pool (``DSparkAttention.attend_paged``)."""
        h = h + self.self_attn.attend_paged(self.input_layernorm(h), positions, *pool_args, backend=backend, par=par)
        return h + self.mlp(self.post_attention_layernorm(h))


class SampleKeys(NamedTuple):
    """Per-request sampling inputs of :meth:`DSparkDraft.sample_block`: ``seed [B]``, ``step
    [B]`` (the sampler step of the token block position 0 predicts: tokens the request has
    generated so far) and ``temperature [B]`` (below ``GREEDY_TEMPERATURE``: greedy row)."""

    seed: jax.Array
    step: jax.Array
    temperature: jax.Array


# ---------------------------------------------------------------------------------- model
class DSparkDraft(nnx.Module):
    """The draft's parameters and its two entry points, :meth:`context_kv` and :meth:`propose`
    (see the module doc). Parameter names follow the checkpoint (``checkpoints.dspark_checkpoint``);
    ``embed_tokens`` and ``lm_head`` are the target's and are passed in as arrays."""

    def __init__(self, cfg: DSparkConfig, dtype=jnp.float32):
        D = cfg.hidden_size
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.context_proj = Linear(cfg.context_in_features, D, dtype, ("embed", "context_in"))
        self.context_norm = RMSNorm(D, cfg.rms_norm_eps, dtype, "embed")
        self.layers = nnx.List([DSparkLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(D, cfg.rms_norm_eps, dtype, "embed")
        self.markov_w1 = param((cfg.vocab_size, cfg.markov_rank), dtype, ("vocab", "markov"))
        self.markov_w2 = param((cfg.draft_vocab_size, cfg.markov_rank), dtype, ("vocab", "markov"))

    # -------------------------------------------------------------- context
    def context_hidden(self, taps):
        """``context_norm(context_proj(taps))``: ``taps [B, T, n_taps * Dt]`` (or ``[B, T, n_taps,
        Dt]``), the target's hidden states at ``target_layer_ids`` in that order."""
        cfg = self.cfg
        if taps.ndim == 4:
            taps = taps.reshape(taps.shape[:2] + (-1,))
        if taps.ndim != 3 or taps.shape[-1] != cfg.context_in_features:
            raise ValueError(f"DSpark taps have shape {tuple(taps.shape)}, expected [B, T, "
                             f"{cfg.num_target_layers} * {cfg.target_hidden_size}]")
        return self.context_norm(self.context_proj(taps.astype(self.dtype)))

    def context_kv(self, taps, positions):
        """Every draft layer's latent KV rows of the context tokens: ``[B, L, T, Lr + R]`` in the
        model dtype. Row-wise: chunks computed separately concatenate (axis 2) to the whole."""
        c = self.context_hidden(taps)
        return jnp.stack([layer.self_attn.latent_rows(c, positions) for layer in self.layers], axis=1)

    def write_context(self, taps, positions, tok_row, page_table, pool, layer0: int, par=None):
        """Write the context KV of a flattened step's tokens into the paged pool: ``taps [T,
        n_taps * Dt]`` at ``positions [T]``, token ``t`` of row ``tok_row[t]`` (outside ``[0, R)``:
        padding, dropped) through ``page_table [R, P]``; draft layer ``l`` goes to pool layer
        ``layer0 + l``, its rows zero-padded to the pool's width. Returns the pool. ``par``:
        under a recipe each rank writes the rows whose page lives in its block
        (``StepParallel.mla_write_flat``; ``tok_row`` group-local as in the step)."""
        from ..kernels.mla_ragged import write_kv_rows

        T, W = taps.shape[0], pool.shape[-1]
        rows = self.context_kv(taps[None], positions[None])[0]  # [L, T, Lr + R]
        pad = W - rows.shape[-1]
        if pad < 0:
            raise ValueError(f"the draft's context rows are {rows.shape[-1]} wide, the pool's {W}")
        for l in range(self.cfg.num_hidden_layers):
            r = jnp.pad(rows[l], ((0, 0), (0, pad))) if pad else rows[l]
            if par is None:
                pool = write_kv_rows(pool, r, page_table, tok_row, positions, layer=layer0 + l)
            else:
                at = types.SimpleNamespace(page_table=page_table, tok_row=tok_row, pos=positions)
                pool = par.mla_write_flat(r, pool, layer0 + l, at)
        return pool

    def propose_paged(self, anchor_tokens, anchor_positions, ctx_lens, page_table, pool, layer0: int,
                      embed_tokens, lm_head, backend: str = "reference", par=None):
        """:meth:`propose` with the context KV in a paged pool (:meth:`write_context`): base
        logits ``[R, block_size, V]`` float32; row ``r`` reads its first ``ctx_lens[r]``
        positions (0: a row that proposes nothing; its logits are computed and meaningless)."""
        positions = self.block_positions(anchor_positions)
        h = jnp.take(embed_tokens, self.block_tokens(anchor_tokens), axis=0).astype(self.dtype)
        for l, layer in enumerate(self.layers):
            h = layer.paged(h, positions, pool, layer0 + l, page_table, ctx_lens, backend=backend, par=par)
        h = self.final_norm(h)
        return jnp.einsum("bsd,vd->bsv", h.astype(F32), lm_head.astype(F32))

    # -------------------------------------------------------------- block
    def block_positions(self, anchor_positions):
        """``[B, S]``: ``anchor_pos + 0 .. block_size - 1``."""
        return anchor_positions.astype(jnp.int32)[:, None] + jnp.arange(self.cfg.block_size, dtype=jnp.int32)

    def block_tokens(self, anchor_tokens):
        """``[B, S]``: the anchor then ``block_size - 1`` mask tokens."""
        B, S = anchor_tokens.shape[0], self.cfg.block_size
        mask = jnp.full((B, S - 1), self.cfg.mask_token_id, jnp.int32)
        return jnp.concatenate([anchor_tokens.astype(jnp.int32)[:, None], mask], axis=1)

    def block_hidden(self, anchor_tokens, anchor_positions, ctx_kv, ctx_lens, embed_tokens):
        """The block's final-normed hidden states ``[B, S, D]``. ``ctx_kv [B, L, C, W]`` holds the
        requests' context rows (padded to ``C``), ``ctx_lens [B]`` how many are valid."""
        cfg = self.cfg
        L, W, D = cfg.num_hidden_layers, cfg.latent_width, cfg.hidden_size
        if ctx_kv.ndim != 4 or ctx_kv.shape[1] != L or ctx_kv.shape[3] != W:
            raise ValueError(f"DSpark context KV has shape {tuple(ctx_kv.shape)}, expected [B, {L}, C, {W}]")
        if tuple(embed_tokens.shape) != (cfg.vocab_size, D):
            raise ValueError(f"embed_tokens has shape {tuple(embed_tokens.shape)}, expected "
                             f"[{cfg.vocab_size}, {D}] (the target's)")
        positions = self.block_positions(anchor_positions)
        h = jnp.take(embed_tokens, self.block_tokens(anchor_tokens), axis=0).astype(self.dtype)
        valid = jnp.arange(ctx_kv.shape[2])[None, :] < jnp.asarray(ctx_lens)[:, None]
        for l, layer in enumerate(self.layers):
            h = layer(h, positions, ctx_kv[:, l], valid)
        return self.final_norm(h)

    def propose(self, anchor_tokens, anchor_positions, ctx_kv, ctx_lens, embed_tokens, lm_head):
        """The block's base logits ``[B, block_size, V]`` (float32) through the target's
        ``lm_head [V, D]``; position ``i`` predicts the token at ``anchor_pos + i + 1``."""
        cfg = self.cfg
        if tuple(lm_head.shape) != (cfg.draft_vocab_size, cfg.hidden_size):
            raise ValueError(f"lm_head has shape {tuple(lm_head.shape)}, expected "
                             f"[{cfg.draft_vocab_size}, {cfg.hidden_size}] (the target's)")
        h = self.block_hidden(anchor_tokens, anchor_positions, ctx_kv, ctx_lens, embed_tokens)
        return jnp.einsum("bsd,vd->bsv", h.astype(F32), lm_head.astype(F32))

    # -------------------------------------------------------------- Markov head
    def markov_bias(self, prev_tokens):
        """``markov_w2 @ markov_w1[prev]``: ``[B, V]`` float32 for ``prev_tokens [B]``."""
        e = jnp.take(self.markov_w1[...], prev_tokens, axis=0).astype(F32)
        return jnp.einsum("br,vr->bv", e, self.markov_w2[...].astype(F32))

    def sample_block(self, base_logits, anchor_tokens, key: SampleKeys | None = None):
        """Draw the block left to right with the Markov bias: ``(tokens [B, S] int32, logits
        [B, S, V] float32)``, the logits being ``base + bias(prev)`` (before temperature).
        ``key=None``: greedy; else per-row Gumbel-max with ``fold_in(key(seed), step + i)``."""
        S, V = base_logits.shape[1], base_logits.shape[2]
        w1, w2 = self.markov_w1[...].astype(F32), self.markov_w2[...].astype(F32)

        def one(prev, i):
            bias = jnp.einsum("br,vr->bv", jnp.take(w1, prev, axis=0), w2)
            logits = base_logits[:, i].astype(F32) + bias
            tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            if key is not None:
                greedy = key.temperature < GREEDY_TEMPERATURE
                x = logits / jnp.where(greedy, 1.0, key.temperature).astype(F32)[:, None]

                def noise(seed, step):
                    k = jax.random.fold_in(jax.random.key(seed, impl=PRNG_IMPL), step)
                    return jax.random.gumbel(k, (V,), F32)

                g = jax.vmap(noise)(key.seed.astype(jnp.uint32), (key.step + i).astype(jnp.uint32))
                tok = jnp.where(greedy, tok, jnp.argmax(x + g, axis=-1).astype(jnp.int32))
            return tok, (tok, logits)

        _, (toks, logits) = jax.lax.scan(one, anchor_tokens.astype(jnp.int32), jnp.arange(S))
        return toks.T, jnp.swapaxes(logits, 0, 1)
