"""DSpark as the engine's drafter: its context KV in the target's pages, its block proposed on
the device right after each step's sampling.

Where things live:

* **Context KV.** The draft's per-layer latent rows sit in the target's MLA pool, as
  ``draft_kv_layers`` extra layers after the target's own (``K3Config.draft_kv_layers``,
  ``model/cache.py``): the same page ids, the same page table, the same page budget (the
  capacity plan's bytes per page include them), the same prefix cache and preemption rules. A
  speculating DSpark engine runs every step on its speculative program, which also returns
  the target's hidden states at ``target_layer_ids`` (``KimiLM.step(taps=...)``); the draft
  program writes the context rows of *every* token of the step at its position, as MLA writes
  its own rows: positions past what was accepted hold rejected drafts' rows until they are
  overwritten, and nothing reads them (a row reads its first ``anchor_pos`` positions).
* **Proposal.** In the same program, each row that sampled a token proposes the next block:
  the anchor is the last token it emitted (the bonus or correction token of a verify row, the
  first token of a prefill that finished its prompt), at ``anchor_pos = start + committed
  inputs`` (a verify row: ``1 + accepted``); the block attends to the row's context through
  the target's paged MLA attention (``DSparkDraft.propose_paged``), and the Markov head samples
  it with plain decoding's keys (``DSparkDraft.sample_block``: greedy rows greedy, seeded rows
  with the key of the token each position predicts). The block's tokens come back with the
  step's sampled tokens; :class:`DSparkEngineDrafter` hands them to the scheduler as the next
  step's drafts of that request — only if the request's host sequence is still the one they
  were proposed after.

Drafts never change what is emitted (verification keeps only tokens plain decoding would
emit), so a wrong or stale proposal costs acceptance, never correctness.

P/D: the context rows are pool layers, so a handoff ships them with the pages; both sides
must run the same draft (the cache layout's fingerprint counts the draft's layers, and a
plain side and a DSpark side refuse each other at bootstrap).

Under a recipe the taps come back with whole rows, the draft's weights are whole on every
device, and its context rows are written and read per rank like the target's MLA rows
(``par`` below). ``k3serve compile`` builds the draft abstractly (:func:`abstract_draft`: its
config only, ``"k3"`` for the released draft's shapes) and compiles a draft program per bucket.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


class DSparkEngineDrafter:
    """The host side: the last block the device proposed for each request, valid while the
    request's sequence is the one it was proposed after. ``on_device``: a row whose input is
    still on the device (async scheduling) takes the previous step's block there instead."""

    on_device = True

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens
        self._blocks: dict[str, tuple[int, list[int]]] = {}  # rid -> (sequence length, drafts)
        self.offered = 0  # blocks the device proposed (tests, stats)

    def offer(self, req, tokens) -> None:
        """The device's block for ``req``, proposed after its current sequence."""
        self._blocks[req.rid] = (req.num_known, [int(t) for t in tokens[:self.k]])
        self.offered += 1

    def propose(self, req, max_tokens: int, after=()) -> list[int]:
        if after:  # the block after an in-flight row is on the device (the scheduler takes it there)
            return []
        got = self._blocks.pop(req.rid, None)
        if got is None or got[0] != req.num_known:
            return []
        return got[1][:max(0, min(max_tokens, self.k))]

    def finish(self, req, keep: bool = True) -> None:
        self._blocks.pop(req.rid, None)


def check_pairing(target_cfg, draft_cfg, k: int) -> None:
    """Refuse a draft whose context rows or block do not fit the engine (``ValueError``)."""
    if k > draft_cfg.block_size:
        raise ValueError(f"num_speculative_tokens={k} exceeds the DSpark draft's block_size={draft_cfg.block_size} "
                         "(a step proposes one block)")
    if draft_cfg.latent_width > target_cfg.mla_pool_width:
        raise ValueError(f"the DSpark draft's latent rows ({draft_cfg.kv_lora_rank} + {draft_cfg.qk_rope_head_dim}) "
                         f"do not fit the target's MLA pool rows ({target_cfg.mla_pool_width} wide), which hold them")


def load_draft(path, target_cfg, dtype, k: int):
    """The draft at ``path`` (``checkpoints.dspark_checkpoint.load_dspark``), checked against the
    target and ``k``."""
    from ...checkpoints.dspark_checkpoint import load_dspark

    draft = load_dspark(path, dtype=dtype, target_cfg=target_cfg)
    check_pairing(target_cfg, draft.cfg, k)
    return draft


def abstract_draft(path, target_cfg, dtype, k: int):
    """The draft's parameters as ``ShapeDtypeStruct``s (``k3serve compile``: no weights read):
    its config from ``path`` (a draft directory's config.json, or ``"k3"`` for
    ``model.dspark_config.k3_dspark_config``), checked against the target and ``k``."""
    import os

    from flax import nnx

    from ...model.dspark import DSparkDraft
    from ...model.dspark_config import DSparkConfig, k3_dspark_config

    if str(path) == "k3":
        cfg = k3_dspark_config()
    else:
        cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        cfg = DSparkConfig.from_json_file(cfg_path)
    cfg.check_against(target_cfg)
    check_pairing(target_cfg, cfg, k)
    return nnx.eval_shape(lambda: DSparkDraft(cfg, dtype))


def with_draft_pool(model, draft):
    """A shallow copy of ``model`` whose config gives the MLA pool the draft's layers."""
    import copy

    model = copy.copy(model)
    model.config = dataclasses.replace(model.config, draft_kv_layers=draft.cfg.num_hidden_layers)
    return model


def draft_block(draft, target, cache, tok, rows_col, table, fl, acc, last, taps, layer0: int, backend: str,
                par=None):
    """The draft program's body (traced; ``server.engine.runner``): write the step's context
    rows, then propose and sample each row's next block. ``tok [3, T]`` (ids, positions, rows),
    ``rows_col`` the step's row columns by name, ``table [R, P]``, ``fl [R, 6]`` the float
    settings (temperature first), ``acc [R]`` drafts accepted, ``last [R]`` each row's last
    emitted token, ``taps [T, n * D]``. Returns ``(tokens [R, block_size] int32, cache)``.
    ``par``: under a recipe, the context rows are written and read per rank like the target's
    MLA rows (``StepParallel.mla_write_flat`` / ``mla_write_attend_flat``)."""
    from ...model.dspark import SampleKeys

    pool = draft.write_context(taps, tok[1], tok[2], table, cache.mla_kv, layer0, par=par)
    col = rows_col
    R = table.shape[0]
    decode = col["decode"] != 0
    anchor_pos = col["start"] + jnp.where(decode, 1, col["q_len"]) + acc  # a decode row: its input, then accepted
    ctx_lens = jnp.where(col["q_len"] > 0, anchor_pos, 0)  # every row proposes; the host keeps those that sampled
    anchor = last[:R]
    base = draft.propose_paged(anchor, anchor_pos, ctx_lens, table, pool, layer0, target.embed_tokens[...],
                               target.lm_head.weight[...], backend=backend, par=par)
    keys = SampleKeys(seed=jax.lax.bitcast_convert_type(col["seed"], jnp.uint32), step=col["step"] + acc + 1,
                      temperature=fl[:, 0])
    toks, _ = draft.sample_block(base, anchor, keys)
    return toks, dataclasses.replace(cache, mla_kv=pool)

