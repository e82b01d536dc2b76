"""Checkpoint names -> model parameters (Hugging Face K3 and Kimi Linear layouts).

Loading streams tensor by tensor: each tensor is read, checked, converted and placed, then
dropped. Routed experts arrive one expert at a time and are gathered into their stacked
parameter ``[E, ...]`` (a buffer of the final size; never a second copy of the model).
MXFP4 experts stay packed unless ``dequantize_experts`` is asked for, in which case each
expert is decoded into the dense stack as soon as both its bytes and its scales are in.

With a ``placement`` callable ``(param_path, shape) -> Sharding | None`` a parameter that gets
a sharding is created slice by slice (``jax.make_array_from_callback``): each device receives
only its own slice of the host tensor, converted to the parameter dtype per slice; nothing
puts a whole sharded parameter on one device. Expert stacks are still gathered on the host
first and placed the same way once every expert is in. ``param_path`` is the dot-joined NNX
path of the parameter (``ffn.1.experts.w1_packed``), the same string
``sharding.mesh`` derives from ``nnx.split(module)[1]``.

Layer parameters are stacked per sublayer type (``model.layer_plan``), ``[sublayers of the type,
...]``: checkpoint layer ``l``'s attention tensors fill its row of its attention type's stack,
its FFN tensors its row of its FFN type's stack. A stack starts as zeros on its
sharding and each layer's tensor is written into its row in place (a donated update), so
the host never holds more than one layer's tensor (one layer's expert stack) at a time.

Unknown, missing and mis-shaped tensors are errors that name the tensor.
"""
from __future__ import annotations

import functools
import re
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np
from flax import nnx

from ..kernels.mxfp4 import GROUP_SIZE, unpack_mxfp4_np
from .layer_plan import part_of

# Tensors a K3 release carries that the text model does not read.
_IGNORED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")


class CheckpointError(ValueError):
    pass


def _strip(name: str) -> str | None:
    n = name
    if n.startswith("language_model."):
        n = n[len("language_model."):]
    if n.startswith(_IGNORED_PREFIXES):
        return None
    if n.startswith("layers.") or n.startswith("embed_tokens.") or n in ("norm.weight",) or n.startswith("output_attn_res"):
        n = "model." + n
    return n


# transformers >= 5 saves a dense layer's MLP (layers < first_k_dense_replace, or off the MoE
# frequency) as ``block_sparse_moe.{gate,up,down}_proj``: its Kimi Linear save-time renaming maps
# ``.mlp.`` to ``.block_sparse_moe.`` on every layer. The original release writes ``mlp.*``.
_SAVED_DENSE_MLP = re.compile(r"^(model\.layers\.(\d+)\.)block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")


def _canonical(name: str, cfg) -> str:
    """One spelling per tensor: a dense layer's ``block_sparse_moe.*_proj`` becomes ``mlp.*_proj``."""
    m = _SAVED_DENSE_MLP.match(name)
    if m and int(m.group(2)) < cfg.num_hidden_layers and not cfg.is_moe_layer(int(m.group(2))):
        return f"{m.group(1)}mlp.{m.group(3)}"
    return name


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")


class _Target:
    """Where a checkpoint tensor goes: a Param, optionally one expert row of a stack."""

    def __init__(self, var: nnx.Variable, path: str, expert: int | None = None,
                 convert: Callable[[np.ndarray], np.ndarray] | None = None, expect: tuple | None = None,
                 group: int | None = None):
        self.var, self.path, self.expert, self.convert, self.expect = var, path, expert, convert, expect
        self.group = group  # row of a layer-stacked parameter (``model.layer_plan``), None if not stacked


def _resolve(model, cfg, name: str, dequant: bool) -> _Target | str | None:
    """Map a stripped name to a target; ``(layer, stack path)`` for MXFP4 parts when dequantizing."""
    if name == "model.embed_tokens.weight":
        return _Target(model.embed_tokens, "embed_tokens")
    if name == "lm_head.weight":
        return _Target(model.lm_head.weight, "lm_head.weight")
    if name == "model.norm.weight":
        return _Target(model.norm.weight, "norm.weight")
    m = re.match(r"^model\.output_attn_res_(proj|norm)\.weight$", name)
    if m and cfg.uses_attn_res:
        return _Target(getattr(model.output_attn_res, m.group(1)), f"output_attn_res.{m.group(1)}")
    m = _LAYER.match(name)
    if not m:
        return None
    li, rest = int(m.group(1)), m.group(2)
    if li >= cfg.num_hidden_layers:
        return None
    try:
        part = part_of(rest)
    except KeyError:
        return None
    layer, group, base = model.sublayer(li, part)
    T = lambda *a, **k: _Target(*a, group=group, **k)  # noqa: E731
    m2 = re.match(r"^(self_attention_res|mlp_res)_(proj|norm)\.weight$", rest)
    if m2:
        if not cfg.uses_attn_res:
            return None
        return T(getattr(getattr(layer, m2.group(1)), m2.group(2)), f"{base}.{m2.group(1)}.{m2.group(2)}")
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        mod = rest.split(".")[0]
        return T(getattr(layer, mod).weight, f"{base}.{mod}.weight")
    if rest.startswith("self_attn."):
        attn = layer.self_attn
        sub = rest[len("self_attn."):]
        if layer.kind == "kda":
            H, dk = cfg.kda_num_heads, cfg.kda_head_dim
            if sub == "A_log":
                def narrow(a, H=H, dk=dk):
                    # per-head decay rates: [H] or Kimi Linear's [1, 1, H, 1]; the K3 release
                    # pads them to [head_dim] with zeros. Anything else is mis-shaped.
                    a = np.asarray(a, np.float32)
                    if a.size == H and sum(d != 1 for d in a.shape) <= 1:
                        return a.reshape(H)
                    if a.ndim == 1 and a.shape[0] == dk and dk >= H:
                        return a[:H]
                    raise CheckpointError(f"has shape {list(a.shape)}, expected [{H}], [1, 1, {H}, 1] "
                                          f"or [{dk}] (padded to head_dim)")
                return T(attn.A_log, f"{base}.self_attn.A_log", convert=narrow, expect=None)
            m3 = re.match(r"^([qkv])_conv1d\.weight$", sub)
            if m3:
                P, W = H * dk, cfg.conv_kernel_size
                return T(getattr(attn, f"{m3.group(1)}_conv1d"), f"{base}.self_attn.{m3.group(1)}_conv1d",
                               convert=lambda a: np.asarray(a).reshape(a.shape[0], a.shape[-1]), expect=(P, 1, W))
            if sub in ("dt_bias",):
                return T(attn.dt_bias, f"{base}.self_attn.dt_bias", convert=lambda a: np.asarray(a).reshape(-1),
                               expect=None)
            if sub == "o_norm.weight":
                return T(attn.o_norm, f"{base}.self_attn.o_norm")
        mod = sub.rsplit(".", 1)
        if len(mod) == 2 and mod[1] == "weight" and hasattr(attn, mod[0]):
            obj = getattr(attn, mod[0])
            if isinstance(obj, nnx.Module) and hasattr(obj, "weight"):
                return T(obj.weight, f"{base}.self_attn.{mod[0]}.weight")
        return None
    if rest.startswith("mlp.") and not layer.is_moe:
        mod = rest[len("mlp."):].rsplit(".", 1)
        if mod[0] in ("gate_proj", "up_proj", "down_proj") and mod[1] == "weight":
            return T(getattr(layer.mlp, mod[0]).weight, f"{base}.mlp.{mod[0]}.weight")
        return None
    if rest.startswith("block_sparse_moe.") and layer.is_moe:
        moe = layer.block_sparse_moe
        m4 = _EXPERT.match(rest)
        if m4:
            e, w, kind = int(m4.group(1)), m4.group(2), m4.group(3)
            if e >= cfg.num_experts:
                return None
            ex = moe.experts
            if kind == "weight":
                if ex.mxfp4:
                    return None
                return T(getattr(ex, w), f"{base}.experts.{w}", expert=e)
            if not ex.mxfp4:
                return (li, f"{base}.experts.{w}") if dequant else None
            part = "packed" if kind == "weight_packed" else "scale"
            return T(getattr(ex, f"{w}_{part}"), f"{base}.experts.{w}_{part}", expert=e)
        sub = rest[len("block_sparse_moe."):]
        if sub == "gate.weight":
            return T(moe.gate.weight, f"{base}.gate.weight")
        if sub == "gate.e_score_correction_bias":
            return T(moe.gate.e_score_correction_bias, f"{base}.gate.e_score_correction_bias")
        if sub == "routed_expert_norm.weight" and hasattr(moe, "routed_expert_norm"):
            return T(moe.routed_expert_norm.weight, f"{base}.routed_expert_norm.weight")
        mod = sub.rsplit(".", 1)
        if mod[0] in ("routed_expert_down_proj", "routed_expert_up_proj") and hasattr(moe, mod[0]):
            return T(getattr(moe, mod[0]).weight, f"{base}.{mod[0]}.weight")
        if mod[0].startswith("shared_experts.") and hasattr(moe, "shared_experts"):
            p = mod[0].split(".", 1)[1]
            if p in ("gate_proj", "up_proj", "down_proj"):
                return T(getattr(moe.shared_experts, p).weight, f"{base}.shared_experts.{p}.weight")
        return None
    return None


def expected_tensor_names(cfg) -> list[str]:
    """Every tensor a checkpoint of ``cfg`` must hold (names without the K3 prefix)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    if cfg.uses_attn_res:
        names += ["model.output_attn_res_proj.weight", "model.output_attn_res_norm.weight"]
    for i, kind in enumerate(cfg.layer_types):
        b = f"model.layers.{i}."
        names += [b + "input_layernorm.weight", b + "post_attention_layernorm.weight"]
        if cfg.uses_attn_res:
            names += [b + f"{s}_{p}.weight" for s in ("self_attention_res", "mlp_res") for p in ("proj", "norm")]
        a = b + "self_attn."
        if kind == "kda":
            names += [a + f"{x}_proj.weight" for x in "qkv"] + [a + f"{x}_conv1d.weight" for x in "qkv"]
            names += [a + "f_a_proj.weight", a + "f_b_proj.weight", a + "b_proj.weight", a + "A_log",
                      a + "dt_bias", a + "o_norm.weight", a + "o_proj.weight"]
            names += [a + "g_proj.weight"] if cfg.full_rank_output_gate else [a + "g_a_proj.weight", a + "g_b_proj.weight"]
        else:
            if cfg.q_lora_rank is None:
                names += [a + "q_proj.weight"]
            else:
                names += [a + "q_a_proj.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight"]
            names += [a + "kv_a_proj_with_mqa.weight", a + "kv_a_layernorm.weight", a + "kv_b_proj.weight",
                      a + "o_proj.weight"]
            if cfg.mla_output_gate:
                names += [a + "g_proj.weight"]
        if cfg.is_moe_layer(i):
            m = b + "block_sparse_moe."
            names += [m + "gate.weight", m + "gate.e_score_correction_bias"]
            if cfg.num_shared_experts:
                names += [m + f"shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
            if cfg.latent_moe:
                names += [m + "routed_expert_down_proj.weight", m + "routed_expert_up_proj.weight"]
                if cfg.latent_moe_use_norm:
                    names += [m + "routed_expert_norm.weight"]
            parts = ("weight_packed", "weight_scale") if cfg.experts_mxfp4 else ("weight",)
            names += [m + f"experts.{e}.{w}.{p}" for e in range(cfg.num_experts) for w in ("w1", "w2", "w3") for p in parts]
        else:
            names += [b + f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    return names


def _all_params(model) -> dict[str, nnx.Variable]:
    out = {}
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            out[".".join(str(p) for p in path)] = var
    return out


@functools.partial(jax.jit, donate_argnums=0)
def _set_row(stack, row, g):
    return jax.lax.dynamic_update_index_in_dim(stack, row.astype(stack.dtype), g, 0)


def _zeros(shape: tuple, dtype, sharding) -> jax.Array:
    """Zeros on ``sharding`` (default: the default device), made on the host shard by shard:
    no program to compile per stack shape."""
    if sharding is None:
        return jax.device_put(np.zeros(shape, dtype))
    block = tuple(sharding.shard_shape(tuple(shape)))
    return jax.make_array_from_callback(tuple(shape), sharding, lambda idx: np.zeros(block, dtype), dtype=dtype)


def _row_sharding(sharding):
    """The sharding of one row of a layer-stacked parameter placed on ``sharding``."""
    from jax.sharding import NamedSharding, PartitionSpec

    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
    return sharding


class _Stack:
    """Tensors stacked on a new leading axis — a layer's routed experts ``[E, ...]``, a
    stack's layers ``[G, ...]`` — left unread: indexing reads only the parts and slices
    asked for (one device's shard)."""

    def __init__(self, parts: list):
        self.parts = parts

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        rest = tuple(index[1:])
        return np.stack([np.asarray(self.parts[i][rest] if rest else self.parts[i])
                         for i in range(len(self.parts))[index[0] if index else slice(None)]])


def _unread(arr) -> bool:
    """``arr`` is checkpoint data not read yet (a lazy tensor, or a stack of them)."""
    if isinstance(arr, _Stack):
        return all(_unread(p) for p in arr.parts)
    return getattr(arr, "unread", False)  # checkpoints.safetensors_io.LazyTensor


def _placed(host: np.ndarray, shape: tuple, dtype, sharding) -> jax.Array:
    """``host`` as a global array on ``sharding``, built from per-device slices only. A
    slice that several local devices hold (a replicated axis) is read once."""
    read: dict = {}

    def slice_of(index):
        key = tuple((i.start, i.stop, i.step) if isinstance(i, slice) else i for i in index)
        if key not in read:
            read[key] = np.asarray(host[index]).astype(dtype)
        return read[key]

    return jax.make_array_from_callback(shape, sharding, slice_of, dtype=dtype)


def load_weights(model, cfg, tensors: Iterable[tuple[str, Callable[[], np.ndarray], tuple]], *,
                 ckpt_cfg=None, dequantize_experts: bool = False, source: str = "checkpoint",
                 placement: Callable[[str, tuple], "jax.sharding.Sharding | None"] | None = None,
                 sink: Callable | None = None) -> None:
    """Fill ``model``'s parameters from ``(name, read_fn, shape)`` triples, one at a time.

    ``model`` may be abstract (``nnx.eval_shape``): every parameter is replaced. ``ckpt_cfg``
    describes the checkpoint when it differs from the model's (dequantize-at-load).
    ``placement(param_path, shape)`` may name a sharding per parameter (see the module doc);
    ``None`` from it, or no ``placement``, puts the parameter whole on the default device.

    ``sink(param_path, row, host, shape, dtype)``, if given, receives each converted parameter
    (``row`` None) or row of a layer-stacked parameter (``host`` is then that row, ``shape`` the
    whole stack's) instead of the model: what ``checkpoints.preshard`` writes out. ``host`` may
    be unread checkpoint data (index it, or ``np.asarray``). The model is left abstract, a
    tied LM head is not sent (it is the embedding), and every parameter must still arrive.
    """
    E = cfg.num_experts
    staged: dict[tuple, tuple[np.ndarray, list]] = {}  # (id(var), group) -> (expert stack buffer, filled flags)
    rows_filled: dict[int, tuple] = {}  # id(var) of a layer-stacked parameter -> (rows, sharding, deferred)
    pending_mx: dict[tuple[str, int], dict] = {}  # dequant-at-load: (stack path, e) -> parts
    done: set[int] = set()
    params = _all_params(model)
    by_id = {id(v): k for k, v in params.items()}

    asked: dict[int, object] = {}  # id(var) -> its sharding: placement is asked once per parameter

    def sharding_of(var, shape: tuple):
        if placement is None:
            return None
        if id(var) not in asked:
            asked[id(var)] = placement(by_id[id(var)], shape)
        return asked[id(var)]

    sunk: dict[int, set] = {}  # with a sink: id(var) of a stacked parameter -> rows sent

    def put(var, arr: np.ndarray, shape: tuple, dtype, group: int | None):
        """``arr`` becomes the parameter (``group`` None) or its row ``group`` of a stack."""
        if sink is not None:
            sink(by_id[id(var)], group, arr, shape, dtype)
            rows = sunk.setdefault(id(var), set())
            rows.add(group)
            if group is None or len(rows) == shape[0]:
                done.add(id(var))
            return
        if group is None:
            sharding = sharding_of(var, shape)
            var.set_value(jnp.asarray(np.asarray(arr).astype(dtype)) if sharding is None
                          else _placed(arr, shape, dtype, sharding))
            done.add(id(var))
            return
        if id(var) not in rows_filled:
            sharding = sharding_of(var, shape)
            # placed rows still unread (checkpoint slices) wait for the whole stack, which is then
            # placed at once, each device reading its slices of every row; anything else starts
            # as zeros on the stack's sharding and is written row by row
            deferred = sharding is not None and _unread(arr)
            rows_filled[id(var)] = ([None] * shape[0], sharding, deferred)
            if not deferred:
                var.set_value(_zeros(shape, dtype, sharding))
        rows, sharding, deferred = rows_filled[id(var)]
        if deferred:
            rows[group] = arr
        else:
            row_sharding = None if sharding is None else _row_sharding(sharding)
            row = jnp.asarray(np.asarray(arr).astype(dtype)) if row_sharding is None else \
                _placed(arr, shape[1:], dtype, row_sharding)
            var.set_value(_set_row(var.get_value(), row, np.int32(group)))
            rows[group] = True
        if all(r is not None for r in rows):
            if deferred:
                var.set_value(_placed(_Stack(rows), shape, dtype, sharding))
            done.add(id(var))
            del rows_filled[id(var)]

    def place(tgt: _Target, arr: np.ndarray, name: str):
        var = tgt.var
        cur = var.get_value()
        shape, dtype = tuple(cur.shape), cur.dtype
        part = shape if tgt.group is None else shape[1:]  # what one layer's tensor fills
        if tgt.expert is None:
            if arr.shape != part:
                raise CheckpointError(f"{source}: tensor {name!r} has shape {list(arr.shape)}, expected {list(part)}")
            put(var, arr, shape, dtype, tgt.group)
            return
        row_shape = part[1:]
        if tuple(arr.shape) != row_shape:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {list(arr.shape)}, expected {list(row_shape)}")
        key = (id(var), tgt.group)
        if key not in staged:  # placed: the experts stay unread until each device takes its slices
            lazy = placement is not None and sharding_of(var, shape) is not None
            staged[key] = ([None] * E if lazy else np.zeros(part, dtype), [False] * E)
        buf, filled = staged[key]
        if isinstance(buf, list):
            buf[tgt.expert] = arr
        else:
            buf[tgt.expert] = np.asarray(arr).astype(dtype)
        filled[tgt.expert] = True
        if all(filled):
            put(var, _Stack(buf) if isinstance(buf, list) else buf, shape, dtype, tgt.group)
            del staged[key]

    seen_stripped = {}
    for raw_name, read, shape in tensors:
        name = _strip(raw_name)
        if name is None:
            continue
        name = _canonical(name, cfg)
        tgt = _resolve(model, cfg, name, dequantize_experts)
        if tgt is None:
            raise CheckpointError(f"{source}: unexpected tensor {raw_name!r} (shape {list(shape)}) for this config")
        if name in seen_stripped:  # the same tensor twice, e.g. with and without "language_model.",
            # or a dense MLP under both mlp. and block_sparse_moe.
            raise CheckpointError(f"{source}: duplicate tensor {raw_name!r} (same as {seen_stripped[name]!r})")
        seen_stripped[name] = raw_name
        if isinstance(tgt, tuple):  # MXFP4 part, dequantized at load: (layer, stack path)
            m = _EXPERT.match(name.split(".", 3)[3])
            e, w, kind = int(m.group(1)), m.group(2), m.group(3)
            layer, group, _ = model.sublayer(tgt[0], "ffn")
            tgt = tgt[1]
            dense_var = getattr(layer.block_sparse_moe.experts, w)
            n_rows, k = tuple(dense_var.get_value().shape[-2:])
            want = (n_rows, k // 2) if kind == "weight_packed" else (n_rows, k // GROUP_SIZE)
            if tuple(shape) != want:
                raise CheckpointError(f"{source}: tensor {raw_name!r} has shape {list(shape)}, expected {list(want)}")
            key = (tgt, e)
            parts = pending_mx.setdefault(key, {})
            parts[kind] = np.asarray(read())
            if len(parts) == 2:
                pair = raw_name.rsplit(".", 1)[0] + ".{weight_packed,weight_scale}"
                try:
                    dense = unpack_mxfp4_np(parts["weight_packed"], parts["weight_scale"])
                except ValueError as err:
                    raise CheckpointError(f"{source}: tensors {pair!r}: {err}") from None
                place(_Target(dense_var, tgt, expert=e, group=group), dense, pair)
                del pending_mx[key]
            continue
        if tgt.expect is not None and tuple(shape) != tuple(tgt.expect):
            raise CheckpointError(f"{source}: tensor {raw_name!r} has shape {list(shape)}, expected {list(tgt.expect)}")
        arr = read()  # with a placement, a LazyTensor: each device reads only its slice
        if tgt.convert is not None:
            try:
                arr = tgt.convert(np.asarray(arr))
            except CheckpointError as err:
                raise CheckpointError(f"{source}: tensor {raw_name!r} {err}") from None
        place(tgt, arr, raw_name)

    prefix = "language_model." if cfg.family == "kimi_k3" else ""
    absent = [prefix + n for n in expected_tensor_names(ckpt_cfg or cfg) if n not in seen_stripped]
    if absent:
        more = f" (and {len(absent) - 10} more)" if len(absent) > 10 else ""
        raise CheckpointError(f"{source}: missing tensors: {', '.join(absent[:10])}{more}")
    if cfg.tie_word_embeddings and "lm_head.weight" not in seen_stripped and sink is not None:
        done.add(id(model.lm_head.weight))
    elif cfg.tie_word_embeddings and "lm_head.weight" not in seen_stripped:
        emb = model.embed_tokens.get_value()
        sharding = sharding_of(model.lm_head.weight, tuple(emb.shape))
        if sharding is not None and emb.sharding != sharding:  # device to device, slice by slice
            emb = jax.device_put(emb, sharding)
        model.lm_head.weight.set_value(emb)
        done.add(id(model.lm_head.weight))
    missing = sorted(by_id[i] for i in set(by_id) - done)
    if missing or pending_mx:
        detail = []
        for (i, g), (buf, filled) in staged.items():
            miss = [e for e, f in enumerate(filled) if not f]
            at = "" if g is None else f" group {g}"
            detail.append(f"{by_id[i]}{at} (experts {miss[:8]}{'...' if len(miss) > 8 else ''})")
        detail += [f"{k[0]} expert {k[1]} (only {sorted(v)})" for k, v in pending_mx.items()]
        plain = [m for m in missing if not any(m in d for d in detail)]
        raise CheckpointError(f"{source}: missing tensors for parameters: " + ", ".join(plain + detail))
