"""A decode-step roofline: what one step of a recipe costs each device, and the throughput
that follows (``k3serve plan --concurrency``; docs/choosing-a-recipe.md).

A *device* is what JAX counts and what a recipe's sizes multiply to: on TPU v7 one
TensorCore, two to a chip (a 16-chip slice is 32 devices). Its HBM, bandwidth and FLOPs are
half the chip's; libtpu gives a device 94.75 GiB of HBM (a compile that needs more fails
"exceeds available HBM (94.75G)"), which is what the planner plans against.

For a config, a recipe, a context length and a concurrency ``B`` (requests decoding at once
over the whole mesh, ``B / dp`` per attention DP group), per device and per step:

* **HBM bytes read**: the device's shard of every non-routed weight (attention, shared experts,
  dense MLP, latent projections, norms, router; the LM head's vocab shard; the embedding only
  for the step's rows); the routed experts the step's tokens touch — with uniform routing a
  layer's expert is touched with probability ``1 − (1 − k/E)^T`` for ``T`` tokens, and the
  device reads its share (experts span all devices); the MLA latent cache of its group's requests
  over the context, divided by ``dcp``; the KDA state of its heads, read and written.
* **ICI bytes sent**: EP dispatch and combine (each token's routed input to ``k`` experts,
  ``tp`` slices each, and the outputs back; the share leaving the device); the two
  tensor-parallel all-reduces per layer (attention output, FFN output) of the group's tokens,
  as a ring (``2 (G − 1) / G`` of the bytes); the DCP merge of partial attention outputs
  (fp32 outputs, ``dcp − 1`` of ``dcp`` parts, and the other ranks' log-sum-exps).
* **FLOPs**: 2 per weight and token for the shard of the matmuls the device runs, the
  ``k`` routed experts per token (dequantized MXFP4 counted as dense), the MLA attention over
  the context (absorbed: scores and values in the latent space), the KDA state update.

The roofline is ``max(bytes / HBM bandwidth, ICI bytes / ICI bandwidth, FLOPs / peak)``: each
resource fully overlapped, perfect load balance. A decode step also waits on a chain of
small collectives, layer after layer, whose cost is latency, not bandwidth; the step adds
``collectives × collective_latency_s`` (5 µs by default: an assumption, no published figure)
to the roofline, counting the collectives the step as built runs (:func:`step_collectives`;
the compiled decode step has the same count). No host or launch overhead is counted. With
speculative decoding (``tokens_per_step`` computed per request, ``accepted`` emitted on
average) a request advances ``accepted`` tokens per step; a :class:`Draft` adds the drafter's
weights, cache reads and collectives to the step. Assumptions are the point of a
roofline; what it is for is ranking recipes, not promising a figure.
"""
from __future__ import annotations

import dataclasses
import math

from .memory import shards
from .recipe import Recipe


@dataclasses.dataclass(frozen=True)
class Device:
    """One JAX device's resources (a recipe's unit: on TPU v7 a TensorCore)."""
    name: str
    hbm_bytes_per_s: float
    ici_bytes_per_s: float  # what one device can send per second over its chip's ICI links
    flops_per_s: float  # dense bf16 matmul peak
    hbm_gb: float  # HBM the compiler lets a program use, in GB (1e9)
    collective_latency_s: float = 5e-6  # fixed cost of one collective (an assumption, not published)
    per_chip: int = 1  # devices on one chip


# TPU7x (Ironwood), per chip: two TensorCores, 2,307 TFLOPs bf16 (4,614 fp8) and 192 GiB of
# HBM (docs.cloud.google.com/tpu/docs/tpu7x, "System architecture" table); 7.37 TB/s of HBM
# bandwidth and 1.2 TB/s of bidirectional ICI bandwidth (Google's Ironwood announcement,
# April 2025; the same ICI figure as v5p's table), one direction half of it. A device is one
# TensorCore: half of each, and the HBM libtpu reports for it, 94.75 GiB (its error for a
# program that does not fit; the chip's 192 GiB less what the runtime keeps).
TPU7X_HBM_GIB = 94.75
TPU7X = Device("TPU v7 TensorCore", hbm_bytes_per_s=7.37e12 / 2, ici_bytes_per_s=0.6e12 / 2,
               flops_per_s=2307e12 / 2, hbm_gb=TPU7X_HBM_GIB * 2**30 / 1e9, per_chip=2)


@dataclasses.dataclass(frozen=True)
class Draft:
    """A speculative drafter run once per step: it proposes ``verify_tokens − 1`` tokens per
    request, the target verifies ``verify_tokens`` per request in the same step, and
    ``accepted`` tokens are emitted per request and step on average (accepted drafts plus the
    bonus token). The drafter's own cost is its weights (``params`` at 2 bytes, sharded over
    every device), its attention cache (``kv_bytes_per_token`` over the context, divided by
    ``dcp`` like the target's) and two collectives per layer."""
    name: str
    verify_tokens: int
    accepted: float
    params: float
    layers: int
    kv_bytes_per_token: float


# Kimi K3's DSpark draft (`Inferact/Kimi-K3-DSpark`, ../shared/design/pd-preshard-spec.md §3.4):
# ~3.56B bf16 parameters, 5 dense MLA layers caching 576 latent values per layer and token,
# a 7-token block (verify width 8). Accept length 2.68 is the published AIME26 figure (4.37 on
# GSM8K for short outputs, about 1.0 for long ones): an assumption, workload-dependent.
DSPARK = Draft("DSpark", verify_tokens=8, accepted=2.68, params=3.56e9, layers=5, kv_bytes_per_token=5 * 576 * 2)


@dataclasses.dataclass
class StepCost:
    recipe: str
    devices: int
    concurrency: int
    context_len: int
    hbm_bytes: dict  # per device, by part
    ici_bytes: dict
    flops: dict
    hbm_s: float
    ici_s: float
    flops_s: float
    collectives: int  # per step, each paying the device's collective latency
    latency_s: float
    step_s: float
    bound: str  # "HBM", "ICI" or "FLOPs"
    tok_s_per_user: float
    tok_s_total: float
    collective_parts: dict = dataclasses.field(default_factory=dict)  # step_collectives' parts


def _is_routed(path: str) -> bool:
    p = path.lower()
    return ("experts.w" in p or ".experts." in p) and "shared" not in p


def _dense_params(path: str, shape: tuple) -> int:
    """Weights a matmul multiplies by (an MXFP4 packed byte holds two; scales none)."""
    n = math.prod(shape)
    if path.endswith("_scale"):
        return 0
    return 2 * n if path.endswith("_packed") else n


_GATHER_WHOLE_BYTES = 1 << 20  # sharding.ep's: a latent input this small is gathered in one collective


def step_collectives(cfg, recipe: Recipe, *, tokens: int, act_itemsize: int = 2) -> dict:
    """The collectives one step of ``tokens`` rows (whole mesh) runs, by part, as the step is
    built (``model.k3``, ``sharding.parallel``, ``sharding.ep``) -- each one a wait on the
    slowest device, layer after layer:

    * ``TP reductions``: the attention output and the FFN output of every layer are summed over
      the attention group (two a layer when it has more than one device);
    * ``SP gathers``: with SP on for this step (``sp > 1``, at least ``sp_min_rows`` rows, a
      multiple of ``sp * dp``) each reduction is a reduce-scatter and the next projection's
      input an all-gather: two more a layer;
    * ``EP exchange`` (``ep > 1``), per MoE layer: the latent input's gather (one when the DP
      group's rows are at most 1 MiB, else one over ``"tp"`` and one over ``"ep"``), the sizes,
      the dispatch, the gather of ``h`` over ``"tp"`` (when the expert intermediate dim is
      split), the combine and the output gather;
    * ``DCP (MLA)`` (``dcp > 1``), per MLA layer: the query's two parts gathered over the
      group, the log-sum-exp max and the merged sum;
    * ``LM head``: the vocab-parallel logits' gather.

    ``k3serve compile --only '^decode'`` counts them in the compiled decode step and prints
    both (docs/compile.md, "Collectives of a decode step"; ``tests/test_compile_cli.py``
    checks them equal, layer kind by layer kind, on a small K3)."""
    n, G, dp = recipe.devices, recipe.attn_group, recipe.dp
    n_layers = cfg.num_hidden_layers
    n_moe = sum(1 for i in range(n_layers) if cfg.is_moe_layer(i))
    parts = {}
    if G > 1:
        parts["TP reductions"] = 2 * n_layers
        if recipe.sp > 1 and tokens >= recipe.sp_min_rows and tokens % (recipe.sp * dp) == 0:
            parts["SP gathers"] = 2 * n_layers
    if recipe.ep > 1 and n_moe:
        tp, ep = recipe.tp, recipe.ep
        if cfg.latent_moe and cfg.expert_input_size % G == 0:  # the input arrives split by columns
            rows = -(-tokens // dp)
            whole = -(-rows // ep) * ep * cfg.expert_input_size * act_itemsize
            x_in = 1 if tp > 1 and ep > 1 and whole <= _GATHER_WHOLE_BYTES else (tp > 1) + (ep > 1)
        else:
            x_in = 0  # whole rows in: each EP rank slices its own
        h_gather = 1 if tp > 1 and cfg.moe_intermediate_size % tp == 0 else 0
        parts["EP exchange"] = n_moe * (x_in + 3 + h_gather + 1)
    if recipe.dcp > 1 and cfg.mla_layers:
        parts["DCP (MLA)"] = 4 * len(cfg.mla_layers)
    if n > 1:
        parts["LM head"] = 1
    return parts


def step_cost(cfg, recipe: Recipe, inventory, *, context_len: int, concurrency: int, device: Device = TPU7X,
              kv_itemsize: int = 2, state_itemsize: int = 4, act_itemsize: int = 2, tokens_per_step: int = 1,
              accepted: float | None = None, draft: Draft | None = None) -> StepCost:
    """The roofline of one decode step (module doc). ``inventory``: ``memory.param_inventory``.
    ``draft`` sets ``tokens_per_step`` and ``accepted`` from the drafter and adds its cost."""
    if draft is not None:
        tokens_per_step, accepted = draft.verify_tokens, draft.accepted
    n, G, dp = recipe.devices, recipe.attn_group, recipe.dp
    B = concurrency
    T = B * tokens_per_step  # tokens computed per step, whole mesh
    Tg = T / dp  # per attention DP group
    D, V = cfg.hidden_size, cfg.vocab_size
    E, k = cfg.num_experts, cfg.num_experts_per_token
    n_mla, n_kda = len(cfg.mla_layers), len(cfg.kda_layers)
    n_layers = cfg.num_hidden_layers
    n_moe = sum(1 for i in range(n_layers) if cfg.is_moe_layer(i))

    hbm, ici, fl = {}, {}, {}
    routed_bytes = routed_params = dense_bytes = dense_params = 0.0
    for path, shape, itemsize in inventory:
        nbytes = math.prod(shape) * itemsize
        if _is_routed(path):
            routed_bytes += nbytes
            routed_params += _dense_params(path, shape)
        elif path.startswith("embed_tokens"):
            hbm["embedding rows"] = T * D * itemsize / n  # only the step's rows
        elif path.startswith("lm_head"):
            hbm["LM head"] = nbytes / n
            fl["LM head"] = 2 * D * V * T / n
        else:
            dense_bytes += nbytes / shards(path, shape, recipe)
            dense_params += _dense_params(path, shape) / shards(path, shape, recipe)
    hbm["non-routed weights"] = dense_bytes
    touched = 1.0 - (1.0 - k / E) ** T if E else 0.0
    hbm["routed experts"] = touched * routed_bytes / n
    kv_token = n_mla * cfg.mla_pool_width * kv_itemsize  # rows stored padded to whole 128-lane vregs
    hbm["MLA KV"] = (B / dp) * context_len * kv_token / recipe.dcp
    H, d = cfg.kda_num_heads, cfg.kda_head_dim
    kda_req = n_kda * (H * d * d + (cfg.conv_kernel_size - 1) * 3 * H * d) * state_itemsize
    hbm["KDA state"] = 2 * (B / dp) * kda_req / G  # read and written

    fl["non-routed matmuls"] = 2 * dense_params * Tg
    fl["routed experts"] = 2 * routed_params * (k / E) * T / n if E else 0.0
    Hm = cfg.mla_num_heads
    fl["MLA attention"] = Tg * n_mla * 2 * Hm * context_len * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim) / G
    fl["KDA"] = Tg * n_kda * 6 * H * d * d / G

    d_routed = getattr(cfg, "routed_expert_hidden_size", None) or D
    remote = 1.0 - 1.0 / recipe.ep
    ici["EP dispatch + combine"] = 2 * (T / n) * k * recipe.tp * d_routed * act_itemsize * remote * n_moe
    ring = 2 * (G - 1) / G
    # attention output and FFN output per layer; with SP a reduce-scatter + all-gather pair,
    # the same bytes
    ici["TP all-reduces"] = 2 * n_layers * ring * Tg * D * act_itemsize
    if recipe.dcp > 1:
        # the fp32 partial outputs reduced (``dcp - 1`` of ``dcp`` parts), the other ranks'
        # LSEs gathered (``parallel.merge_dcp_partials``)
        ici["DCP merge"] = n_mla * Tg * (Hm * recipe.dcp / G) * 4 * \
            ((recipe.dcp - 1) / recipe.dcp * cfg.kv_lora_rank + (recipe.dcp - 1))
    if draft is not None:
        hbm["draft weights"] = 2 * draft.params / n
        hbm["draft KV"] = (B / dp) * context_len * draft.kv_bytes_per_token / recipe.dcp
        fl["draft"] = 2 * draft.params * T / n
    hbm_s = sum(hbm.values()) / device.hbm_bytes_per_s
    ici_s = sum(ici.values()) / device.ici_bytes_per_s
    flops_s = sum(fl.values()) / device.flops_per_s
    parts = step_collectives(cfg, recipe, tokens=T, act_itemsize=act_itemsize)
    if draft is not None and n > 1:
        parts["draft"] = 2 * draft.layers + 1  # the drafter's layers and its proposals' gather
    collectives = sum(parts.values())
    latency = collectives * device.collective_latency_s
    roof = max(hbm_s, ici_s, flops_s)
    bound = {hbm_s: "HBM", ici_s: "ICI", flops_s: "FLOPs"}[roof]
    if latency > roof:
        bound = "latency"
    step = roof + latency
    per_user = (accepted if accepted is not None else tokens_per_step) / step if step > 0 else float("inf")
    return StepCost(recipe=recipe.name or str(recipe), devices=n, concurrency=B, context_len=context_len,
                    hbm_bytes=hbm, ici_bytes=ici, flops=fl, hbm_s=hbm_s, ici_s=ici_s, flops_s=flops_s,
                    collectives=collectives, latency_s=latency, step_s=step,
                    bound=bound, tok_s_per_user=per_user, tok_s_total=per_user * B, collective_parts=parts)


def recommend(cfg, recipes, inventory, *, context_len: int, concurrency: int, device: Device = TPU7X,
              usable_fraction: float = 0.9, snapshots_per_request: float = 2.0) -> list[dict]:
    """The recipes that hold ``concurrency`` requests of ``context_len`` tokens in HBM, ranked
    by total tok/s (then per-user tok/s); the ones that do not fit follow, marked."""
    from .memory import plan_memory

    rows = []
    for r in recipes:
        mem = plan_memory(cfg, r, inventory, context_len=context_len, hbm_gb=device.hbm_gb,
                          usable_fraction=usable_fraction, snapshots_per_request=snapshots_per_request)
        cost = step_cost(cfg, r, inventory, context_len=context_len, concurrency=concurrency, device=device)
        rows.append({"recipe": cost.recipe, "devices": r.devices, "fits": mem.max_concurrent_requests >= concurrency,
                     "max_concurrent": mem.max_concurrent_requests, "step_ms": cost.step_s * 1e3,
                     "bound": cost.bound, "tok_s_per_user": cost.tok_s_per_user, "tok_s_total": cost.tok_s_total})
    return sorted(rows, key=lambda x: (not x["fits"], -x["tok_s_total"], -x["tok_s_per_user"]))


def candidate_recipes(cfg, devices: int) -> list[Recipe]:
    """Every recipe over ``devices`` devices that ``cfg`` admits (sp = 1: sequence parallelism
    does not change a decode step's bytes here), with the presets of that size named."""
    from .recipe import PRESETS, RecipeError

    named = {str(p): p for p in PRESETS.values() if p.devices == devices and p.sp == 1}
    out = []
    for ep in range(1, devices + 1):
        if devices % ep:
            continue
        tp = devices // ep
        for dp in range(1, ep + 1):
            for dcp in range(1, devices // dp + 1):
                try:
                    r = Recipe(ep=ep, tp=tp, dp=dp, dcp=dcp).validate(cfg, num_devices=devices)
                except RecipeError:
                    continue
                out.append(named.get(str(r), r))
    return out
