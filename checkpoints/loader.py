"""Load a checkpoint into a ``KimiModel``: a Hugging Face K3 or Kimi Linear directory
(safetensors, read lazily and placed shard by shard) or a pre-shard (Orbax, restored into its
shardings). This is where files meet the model; ``model/`` itself reads none.

Public API::

    from k3serve.checkpoints import load_pretrained
    m = load_pretrained("path/to/hf_dir", dtype="float32")
    m.config; m.logits([1, 2, 3]); m.greedy([1, 2, 3], max_new_tokens=8)
"""
from __future__ import annotations

import os

from flax import nnx

from ..model.config import K3Config
from ..model.k3 import KimiLM
from ..model.pretrained import KimiModel, default_kernels, repack_experts_for_kernels, resolve_dtype
from ..model.weights import load_weights
from .preshard_format import PreshardError, is_preshard, read_manifest
from .safetensors_io import open_checkpoint


def load_pretrained(path: str | os.PathLike, dtype="float32", *, dequantize_experts: bool = False,
                    page_size: int = 16, placement=None, kernels: str | None = None) -> KimiModel:
    """Load a Hugging Face K3 or Kimi Linear checkpoint directory (chosen by config.json), or
    a pre-sharded one (``k3serve preshard``), restored straight into ``placement``'s shardings.

    ``placement(param_path, shape) -> Sharding | None`` (e.g. ``sharding.mesh.placement_for``)
    loads each parameter straight into its shards: every device receives only its slice.
    ``kernels``: the ops' backend, "reference", "pallas" or "pallas-interpret" (default
    :func:`default_kernels`); a Pallas backend repacks MXFP4 experts for its kernel at load."""
    dt = resolve_dtype(dtype)
    if is_preshard(path):
        return _load_preshard(path, dt, dequantize_experts, page_size, placement, kernels)
    with open_checkpoint(path) as ckpt:
        cfg = K3Config.from_dict(ckpt.config)
        model_cfg = cfg.replace(experts_mxfp4=False) if (dequantize_experts and cfg.experts_mxfp4) else cfg
        model_cfg = model_cfg.replace(kernels=kernels or default_kernels())
        module = nnx.eval_shape(lambda: KimiLM(model_cfg, dt))
        # placed: tensors are read lazily, each device reading only its own slice
        read = ckpt.lazy if placement is not None else ckpt.get
        tensors = ((n, (lambda n=n: read(n)), ckpt.shape(n)) for n in ckpt.keys())
        load_weights(module, model_cfg, tensors, ckpt_cfg=cfg, dequantize_experts=dequantize_experts,
                     source=str(path), placement=placement)
        if model_cfg.kernels != "reference" and model_cfg.experts_mxfp4:
            repack_experts_for_kernels(module)
        total = ckpt.nbytes
        read_bytes = ckpt.bytes_read if placement is not None else total
    model = KimiModel(module, model_cfg, dt, page_size=page_size)
    model.load_stats = {"bytes_read": read_bytes, "checkpoint_bytes": total}  # a placed load reads its slices
    return model


def abstract_pretrained(cfg: K3Config, dtype="float32", *, dequantize_experts: bool = False, page_size: int = 16,
                        placement=None, device=None, kernels: str | None = None) -> KimiModel:
    """A ``KimiModel`` whose parameters are ``jax.ShapeDtypeStruct``s exactly as
    :func:`load_pretrained` would store them for ``cfg`` (dtype, MXFP4 stacks packed with their
    scales, the kernels' repacked layout for a Pallas backend), each placed by ``placement``
    (``param_path, shape -> Sharding``) or else on ``device``: for compiling the serving
    programs of a model without reading a weight (``k3serve compile``)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    dt = resolve_dtype(dtype)
    model_cfg = cfg.replace(experts_mxfp4=False) if (dequantize_experts and cfg.experts_mxfp4) else cfg
    model_cfg = model_cfg.replace(kernels=kernels or default_kernels())
    module = nnx.eval_shape(lambda: KimiLM(model_cfg, dt))
    if model_cfg.kernels != "reference" and model_cfg.experts_mxfp4:
        repack_experts_for_kernels(module, abstract=True)
    for path, var in nnx.iter_graph(module):
        if not isinstance(var, nnx.Variable):
            continue
        path, cur = ".".join(str(p) for p in path), var.get_value()
        where = placement(path, tuple(cur.shape)) if placement is not None else None
        if where is None:
            if device is None:
                raise ValueError("abstract_pretrained needs a placement or a device")
            where = SingleDeviceSharding(device)
        var.set_value(jax.ShapeDtypeStruct(cur.shape, cur.dtype, sharding=where))
    model = KimiModel(module, model_cfg, dt, page_size=page_size)
    model.load_stats = {"bytes_read": 0, "checkpoint_bytes": 0}
    return model


def _load_preshard(path, dt, dequantize_experts: bool, page_size: int, placement, kernels) -> KimiModel:
    """``load_pretrained`` of a pre-sharded checkpoint: the arrays are stored as the model
    holds them, so they are read into their shardings and nothing is converted."""
    from .preshard_load import restore_into

    man = read_manifest(path)
    cfg = K3Config.from_dict(man["config"])
    if dequantize_experts and cfg.experts_mxfp4:
        raise PreshardError(f"{path}: pre-sharded with MXFP4 experts; dequantize-at-load needs the safetensors "
                            "checkpoint")
    model_cfg = cfg.replace(kernels=kernels or default_kernels())
    module = nnx.eval_shape(lambda: KimiLM(model_cfg, dt))
    stats = restore_into(module, path, placement)
    if model_cfg.kernels != "reference" and model_cfg.experts_mxfp4:
        repack_experts_for_kernels(module)
    model = KimiModel(module, model_cfg, dt, page_size=page_size)
    model.load_stats = {"bytes_read": stats["bytes_read"], "checkpoint_bytes": stats["checkpoint_bytes"],
                        "seconds": stats["seconds"]}
    return model
