"""The device mesh of a recipe and where each parameter and cache array lives on it.

One mesh, three named axes (all ``Auto``: XLA's partitioner places the collectives):

    ("dp", "ep", "tp")  with shape  (dp, ep / dp, tp)

Axis groups the ops use:

* ``EXPERTS = ("dp", "ep")`` — the ``ep`` expert groups span every attention DP group (the
  MoE always spans the whole mesh); expert matmuls are split over ``"tp"`` inside a group;
* ``ATTN = ("ep", "tp")`` — the ``devices / dp`` ranks of one attention group: KDA heads and
  MLA query heads split over it; the DP groups are the ``"dp"`` slices;
* ``ALL = ("dp", "ep", "tp")`` — vocab-parallel embedding and LM head.

Parameter placement (the same one ``sharding.memory`` plans with), on weights stored
``[out, in]``: attention projections that produce heads (q/k/v/g/b, ``f_b``, ``q_b``,
``kv_b``) split their output rows over ``ATTN``, the output projection its input columns;
low-rank and latent projections shared by all heads (``q_a``, ``kv_a``, ``f_a``) are
replicated; shared experts, the dense MLP and the latent down/up projections around the
routed experts are tensor-parallel over ``ATTN`` (column then row); routed experts split the
expert axis over ``EXPERTS`` and their output rows over ``"tp"``; embedding and LM head split
the vocabulary over ``ALL``; norms, router, biases and AttnRes queries are replicated. A dim
that does not divide stays whole (replicated), so every recipe that validates can run.

Only ``model/config`` is imported (the sharding floor): the functions take paths and shapes.
"""
from __future__ import annotations

import numpy as np

from .recipe import Recipe, RecipeError

AXES = ("dp", "ep", "tp")
EXPERTS = ("dp", "ep")
ATTN = ("ep", "tp")
ALL = AXES


def build_mesh(recipe: Recipe, devices=None):
    """A mesh with Auto axes ``("dp", "ep", "tp")`` over ``devices`` (default: all)."""
    import jax
    from jax.sharding import AxisType, Mesh

    devices = list(jax.devices() if devices is None else devices)
    recipe.validate(num_devices=len(devices))  # includes the layout checks (dp | ep; dcp, sp on whole axes)
    shape = (recipe.dp, recipe.ep // recipe.dp, recipe.tp)
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES, axis_types=(AxisType.Auto,) * 3)


def _sub_axes(recipe: Recipe, size: int, what: str) -> tuple[str, ...]:
    """The mesh axes inside one attention group whose product is ``size``."""
    group_ep = recipe.ep // recipe.dp
    options = {1: (), recipe.tp: ("tp",), group_ep: ("ep",), recipe.attn_group: ("ep", "tp")}
    if size not in options:
        raise RecipeError(f"{what}={size} must be 1, tp={recipe.tp}, ep/dp={group_ep} or the attention group "
                          f"{recipe.attn_group} in this mesh layout (recipe {recipe})")
    return options[size]


def dcp_axes(recipe: Recipe) -> tuple[str, ...]:
    """Mesh axes a sequence's MLA pages are dealt over (decode context parallelism)."""
    return _sub_axes(recipe, recipe.dcp, "dcp")


def sp_axes(recipe: Recipe) -> tuple[str, ...]:
    """Mesh axes the rows of a step are split over between layers (sequence parallelism)."""
    return _sub_axes(recipe, recipe.sp, "sp")


def _size(mesh_shape: dict, axes) -> int:
    axes = (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh_shape[a] for a in axes]))


_HEAD_OUT = ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "f_b_proj", "q_b_proj", "kv_b_proj")


def param_spec(path: str, shape: tuple[int, ...], mesh_shape: dict) -> tuple:
    """PartitionSpec entries for the parameter at ``path`` (dot-joined NNX path). Parameters of
    the scanned layers (``attn.*``, ``ffn.*``, stacked ``[sublayers of a type, ...]``) keep their
    layer axis whole and place the rest as the unstacked parameter."""
    if path.startswith(("attn.", "ffn.")):
        return (None,) + param_spec(path[path.index("."):], shape[1:], mesh_shape)
    spec: list = [None] * len(shape)

    def put(dim: int, axes) -> None:
        if -len(shape) <= dim < len(shape) and shape[dim] % _size(mesh_shape, axes) == 0:
            spec[dim] = axes

    leaf = path.rsplit(".", 2)
    name = leaf[-2] if leaf[-1] == "weight" and len(leaf) > 1 else leaf[-1]
    if ".experts." in path and "shared_experts" not in path:
        put(0, EXPERTS)
        put(1, "tp")
    elif ".self_attn." in path:
        if len(shape) == 2 and name in _HEAD_OUT:
            put(0, ATTN)
        elif len(shape) == 2 and name == "o_proj":
            put(1, ATTN)
    elif "shared_experts." in path or ".mlp." in path or "routed_expert_" in path:
        if len(shape) == 2:
            if name in ("gate_proj", "up_proj", "routed_expert_down_proj"):
                put(0, ATTN)  # column parallel
            elif name in ("down_proj", "routed_expert_up_proj"):
                put(1, ATTN)  # row parallel
    elif path.startswith(("embed_tokens", "lm_head")):
        put(0, ALL)
    return tuple(spec)


def _path_str(keypath) -> str:
    parts = []
    for k in keypath:
        v = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
        if v in ("value", "raw_value"):
            continue
        parts.append(str(v))
    return ".".join(parts)


def shard_params(params, mesh):
    """Place an NNX parameter state on ``mesh`` by :func:`param_spec` (a new state).

    Leaves already on their target sharding (loaded with :func:`placement_for`) are kept as
    they are, not moved again."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mshape = dict(mesh.shape)

    def place(keypath, leaf):
        spec = param_spec(_path_str(keypath), tuple(leaf.shape), mshape)
        target = NamedSharding(mesh, PartitionSpec(*spec))
        if getattr(leaf, "sharding", None) == target:
            return leaf
        return jax.device_put(leaf, target)

    return jax.tree_util.tree_map_with_path(place, params)


def placement_for(mesh):
    """``placement(param_path, shape) -> NamedSharding`` by :func:`param_spec`, for loading
    parameters straight into their shards (``load_pretrained(..., placement=...)``): the
    same shardings :func:`shard_params` gives, so a model loaded this way is not moved again."""
    from jax.sharding import NamedSharding, PartitionSpec

    mshape = dict(mesh.shape)

    def placement(path: str, shape: tuple[int, ...]):
        return NamedSharding(mesh, PartitionSpec(*param_spec(path, tuple(shape), mshape)))

    return placement
