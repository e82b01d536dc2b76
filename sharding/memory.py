"""Memory plan: bytes per device for a config under a recipe, and the concurrency it allows.

Inputs are plain data — the config, a :class:`Recipe`, and an inventory of parameters as
``(path, shape, itemsize)`` (the caller builds it from the abstract model, so ``sharding/``
stays below ``model/``). Each parameter is split as the load places it
(``sharding.mesh.param_spec``; a dimension that does not divide by its axes stays whole):

* routed experts (``...experts...``, MXFP4 packed bytes and scales): over all devices
  (``ep`` groups × ``tp`` slices);
* attention weights (``self_attn``): the head-indexed projections (and ``o_proj``'s input
  side) over the attention group (``devices / dp`` ranks: KDA heads and MLA query heads), one
  copy per attention DP group; the low-rank down-projections, conv weights and per-head
  vectors are replicated;
* shared experts, the latent down/up projections around the routed experts and the dense
  MLP: over the attention group (tensor-parallel like attention);
* embedding and LM head: vocab-parallel over all devices;
* the rest (norms, router, AttnRes queries, biases): replicated.

Per request, per device: the MLA latent cache is shared by all query heads, so with plain
attention TP every rank of the group keeps the whole cache of the group's sequences; DCP
deals a sequence's pages over ``dcp`` ranks, dividing it by ``dcp``. KDA recurrent + conv
state is split by head over the attention group. With prefix caching on, an engine also
keeps KDA snapshot slots (``Engine(prefix_snapshots=)``, default 2 × ``max_num_seqs``): each
is one request's KDA state, so the plan charges ``snapshots_per_request`` of them to every
request (2 by default, as ``k3serve serve``; 0 with caching off). Attention DP groups hold
disjoint requests, so the total concurrency is ``dp`` × what one group holds.
"""
from __future__ import annotations

import dataclasses
import math

from .recipe import Recipe

GB = 1e9


@dataclasses.dataclass
class MemoryPlan:
    recipe: str
    devices: int
    weights_per_device: float  # bytes
    kv_per_token_total: int  # bytes of MLA latent cache per token (all MLA layers)
    kv_per_token_per_device: float  # what one device holds per token of one of its sequences
    kda_state_per_request: int  # bytes, all KDA layers (state + conv window), whole request
    kda_state_per_request_per_device: float
    snapshots_per_request: float  # prefix-cache KDA snapshot slots charged to each request
    context_len: int
    hbm_per_device: float
    usable_fraction: float
    per_request_per_device: float  # bytes at context_len
    max_concurrent_requests: int  # over the whole mesh

    def rows(self) -> list[tuple[str, str]]:
        return [
            ("recipe", self.recipe),
            ("devices", str(self.devices)),
            ("weights / device", f"{self.weights_per_device / GB:.2f} GB"),
            ("MLA KV / token (all layers)", f"{self.kv_per_token_total:,} B"),
            ("MLA KV / token / device", f"{self.kv_per_token_per_device:,.0f} B"),
            ("KDA state / request", f"{self.kda_state_per_request / 2**20:,.1f} MiB"),
            ("KDA state / request / device", f"{self.kda_state_per_request_per_device / 2**20:,.2f} MiB"),
            ("KDA snapshots / request / device",
             f"{self.snapshots_per_request * self.kda_state_per_request_per_device / 2**20:,.2f} MiB"),
            (f"one request at {self.context_len:,} tokens / device",
             f"{self.per_request_per_device / GB:.3f} GB"),
            ("max concurrent requests", f"{self.max_concurrent_requests:,}"),
        ]


def shards(path: str, shape: tuple, recipe: Recipe) -> int:
    """Into how many parts the parameter is split across the mesh, by the placement rule the
    load uses (``sharding.mesh.param_spec``; a dimension that does not divide stays whole)."""
    from .mesh import param_spec

    mshape = {"dp": recipe.dp, "ep": recipe.ep // recipe.dp, "tp": recipe.tp}
    n = 1
    for axes in param_spec(path, tuple(shape), mshape):
        for a in () if axes is None else ((axes,) if isinstance(axes, str) else axes):
            n *= mshape[a]
    return n


def local_shape(path: str, shape: tuple, recipe: Recipe) -> tuple[int, ...]:
    """The shape of the block of the parameter one device holds (``sharding.mesh.param_spec``)."""
    from .mesh import param_spec

    mshape = {"dp": recipe.dp, "ep": recipe.ep // recipe.dp, "tp": recipe.tp}
    out = []
    for n, axes in zip(shape, param_spec(path, tuple(shape), mshape)):
        for a in () if axes is None else ((axes,) if isinstance(axes, str) else axes):
            n //= mshape[a]
        out.append(n)
    return tuple(out)


def retiled_per_device(inventory, recipe: Recipe) -> float:
    """Bytes per device of the 16-bit layer-stacked weights XLA:TPU re-tiles inside every step
    program when they are stored as 16-bit arrays: in the default ``(8, 128)`` tiling, read by
    the matmuls in ``(16, 128)``, converted whole before the layer loop into a temporary as
    large as the stack. Which stacks: rank >= 3, at least 16 rows and more than 128 columns per
    device — the ones libtpu 0.0.42.1 copies in K3's compiled steps (docs/compile.md, "The layer
    stacks, stored in the matmuls' tiling"). An engine on a TPU stores exactly these packed (``model.packed_rows``),
    and then nothing is re-tiled."""
    from ..model.packed_rows import packable_shape

    total = 0.0
    for path, shape, itemsize in inventory:
        local = local_shape(path, shape, recipe) if len(shape) >= 3 else shape
        if packable_shape(local, itemsize):
            total += math.prod(local) * itemsize
    return total


def step_activations_per_device(cfg, recipe: Recipe, tokens: int) -> float:
    """Bytes per device of a step's largest activations, ``tokens`` tokens per DP group (the
    engine's token buckets count per group): the residual
    stream and the AttnRes bank (fp32 ``[blocks + 2, rows, D]``) and one MoE layer's
    expert-exchange buffers at their worst case (every pair of every rank's tokens: the
    received rows ``[rows * k, latent]`` bf16, ``h`` ``[rows * k, I]`` bf16 after its gather
    over ``"tp"``, the outputs ``[rows * k, latent / tp]`` fp32). ``rows``: ``tokens``, split
    over ``sp`` on steps that use SP. A model of what dominates the compiler's
    temporaries on long steps (v7-32-prefill, 8,192 tokens: docs/choosing-a-recipe.md); small
    at decode sizes."""
    rows = tokens
    if recipe.sp > 1 and rows >= recipe.sp_min_rows:
        rows = -(-rows // recipe.sp)
    stream = (cfg.num_attn_res_blocks + 2) * rows * cfg.hidden_size * 4
    if not cfg.num_experts:
        return float(stream)
    pairs = rows * cfg.num_experts_per_token
    latent = cfg.expert_input_size
    exchange = pairs * (latent * 2 + cfg.moe_intermediate_size * 2 + latent // recipe.tp * 4)
    return float(stream + exchange)


def weights_per_device(inventory, recipe: Recipe) -> float:
    """Parameter bytes each device holds (every device holds the same under these rules)."""
    return float(sum(math.prod(shape) * itemsize / shards(path, shape, recipe) for path, shape, itemsize in inventory))


def plan_memory(cfg, recipe: Recipe, inventory, *, context_len: int = 131072, hbm_gb: float = 101.74,
                usable_fraction: float = 0.9, kv_itemsize: int = 2, state_itemsize: int = 4,
                snapshots_per_request: float = 2.0) -> MemoryPlan:
    """Bytes per device and the max concurrent requests at ``context_len`` tokens each, each
    request also paying ``snapshots_per_request`` prefix-cache KDA snapshot slots."""
    n_mla, n_kda = len(cfg.mla_layers), len(cfg.kda_layers)
    kv_token = n_mla * cfg.mla_pool_width * kv_itemsize  # rows stored padded to whole 128-lane vregs
    kv_token_dev = kv_token / recipe.dcp
    H, d = cfg.kda_num_heads, cfg.kda_head_dim
    kda_req = n_kda * (H * d * d + (cfg.conv_kernel_size - 1) * 3 * H * d) * state_itemsize
    kda_req_dev = kda_req / recipe.attn_group
    w_dev = weights_per_device(inventory, recipe)
    hbm = hbm_gb * GB
    if snapshots_per_request < 0:
        raise ValueError("snapshots_per_request must be >= 0")
    per_req = context_len * kv_token_dev + kda_req_dev * (1 + snapshots_per_request)
    free = hbm * usable_fraction - w_dev
    per_group = max(0, int(free // per_req)) if free > 0 else 0
    return MemoryPlan(recipe=recipe.name or str(recipe), devices=recipe.devices, weights_per_device=w_dev,
                      kv_per_token_total=kv_token, kv_per_token_per_device=kv_token_dev,
                      kda_state_per_request=kda_req, kda_state_per_request_per_device=kda_req_dev,
                      snapshots_per_request=snapshots_per_request,
                      context_len=context_len, hbm_per_device=hbm, usable_fraction=usable_fraction,
                      per_request_per_device=per_req, max_concurrent_requests=per_group * recipe.dp)


def param_inventory(cfg, dtype="bfloat16") -> list[tuple[str, tuple[int, ...], int]]:
    """``(path, shape, itemsize)`` of every parameter of ``cfg``'s model, from abstract shapes."""
    import jax.numpy as jnp
    from flax import nnx

    from ..model import KimiLM

    m = nnx.eval_shape(lambda: KimiLM(cfg, jnp.dtype(dtype)))
    out = []
    for path, v in nnx.to_flat_state(nnx.split(m)[1]):
        a = v.get_value()
        out.append((".".join(map(str, path)), tuple(a.shape), jnp.dtype(a.dtype).itemsize))
    return out
