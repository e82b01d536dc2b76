"""Ahead-of-time compilation for a TPU topology on a host without TPUs (libtpu, compile only).

Why: a Pallas TPU kernel's interpret mode ignores Mosaic's rules (tiling, alignment, VMEM),
and XLA:CPU says nothing of a TPU's memory. libtpu (the ``tpu`` extra: ``jax[tpu]`` pinned to
our jax) compiles for a named topology — ``tpu7x:2x2x1`` is 8 devices (4 chips), ``tpu7x:2x2x4``
32 (16 chips) — with no TPU attached: the default backend stays the CPU, arguments are
``ShapeDtypeStruct``s placed on the topology's devices, and ``jit(f).lower(...).compile()``
runs Mosaic and XLA:TPU for real. A v7x device is one TensorCore (two per chip).

What this gives: :func:`topology_devices`, :func:`tpu_mesh`, :func:`placed` (arguments);
:func:`compile_for_tpu` (lower under the mesh's abstract mesh — Pallas asks the default
device's TPU info otherwise — and compile); :func:`program_report` (per-device memory,
FLOPs, bytes accessed, collectives, copies of parameters, Mosaic kernels' scoped VMEM).
Nothing here runs a program.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import os
import re
import time

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")


class LibtpuMissing(RuntimeError):
    """libtpu is not installed: ``pip install 'k3serve[tpu]'`` (``jax[tpu]`` of our jax)."""


def require_libtpu() -> None:
    """Raise :class:`LibtpuMissing`, saying how to install it, unless libtpu can be imported."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:  # the 'tpu' extra's jax[tpu] brings it
        import jax

        raise LibtpuMissing(f"compiling for TPU needs libtpu: pip install 'jax[tpu]=={jax.__version__}' "
                            "(k3serve's 'tpu' extra)")


@functools.lru_cache(maxsize=None)
def topology_devices(name: str) -> tuple:
    """The devices of TPU topology ``name`` (e.g. ``"tpu7x:2x2x4"``), for compiling only."""
    require_libtpu()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # tests run two processes at once
    from jax.experimental import topologies

    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)


def tpu_mesh(name: str, shape: tuple[int, ...] = (), axes: tuple[str, ...] = ()):
    """An Auto-axes mesh of ``shape`` over the first ``prod(shape)`` devices of topology
    ``name`` (``shape=()``: one device, no axes)."""
    from jax.sharding import AxisType, Mesh

    devs = topology_devices(name)
    n = int(np.prod(shape)) if shape else 1
    if n > len(devs):
        raise ValueError(f"mesh {shape} needs {n} devices; {name} has {len(devs)}")
    arr = np.asarray(devs[:n], dtype=object).reshape(shape or (1,))
    return Mesh(arr, axes or ("x",), axis_types=(AxisType.Auto,) * max(1, len(axes)))


def placed(shape, dtype, mesh, spec=None):
    """``ShapeDtypeStruct(shape, dtype)`` placed on ``mesh`` with ``PartitionSpec`` ``spec``
    (default: replicated)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.ShapeDtypeStruct(tuple(shape), dtype,
                                sharding=NamedSharding(mesh, spec if spec is not None else PartitionSpec()))


def compile_for_tpu(fn, args, mesh, **jit_kwargs):
    """``(compiled, seconds)``: ``jax.jit(fn, **jit_kwargs)`` lowered on ``args`` (placed on
    ``mesh``'s TPU devices) and compiled by libtpu."""
    import jax

    t = time.perf_counter()
    with _abstract(mesh):
        lowered = jax.jit(fn, **jit_kwargs).lower(*args)
    compiled = lowered.compile()
    return compiled, time.perf_counter() - t


@contextlib.contextmanager
def abstract_mesh(mesh):
    """Lower under ``mesh``'s abstract mesh: Pallas's lowering of some integer ops asks the
    default device's TPU info otherwise, and the default device here is the CPU."""
    import jax

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        yield


_abstract = abstract_mesh


def memory(compiled) -> dict:
    """Per-device bytes of ``compiled`` as the compiler counts them."""
    m = compiled.memory_analysis()
    return {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
            "alias": int(m.alias_size_in_bytes), "temp": int(m.temp_size_in_bytes),
            "code": int(m.generated_code_size_in_bytes)}


def cost(compiled) -> dict:
    """``{"flops", "bytes_accessed"}`` per device. XLA:TPU counts a while loop's body once."""
    c = compiled.cost_analysis() or {}
    if isinstance(c, (list, tuple)):
        c = c[0] if c else {}
    return {"flops": float(c.get("flops", 0.0)), "bytes_accessed": float(c.get("bytes accessed", 0.0))}


_OP = re.compile(r"=\s*(?:\([^=]*?\)|\S+)\s+([a-z][a-z0-9-]*)\(")


_COND_BRANCH = re.compile(r'op_name="(.*)/cond/branch_(\d+)_fun/')


def collectives(compiled) -> dict[str, int]:
    """Collective ops a run of the partitioned HLO executes, by opcode (``-start`` / ``-done``
    pairs count once; a loop body's once). The branches of a ``lax.cond`` (recognised by their
    ops' ``.../cond/branch_N_fun/`` names) count as their largest branch, not their sum: one
    branch runs (the EP exchange's capped and worst-case paths, ``sharding.ep``)."""
    return collective_counts(compiled.as_text())


def collective_counts(hlo_text: str) -> dict[str, int]:
    """:func:`collectives` of HLO text."""
    n = collections.Counter()
    branches: dict = collections.defaultdict(collections.Counter)  # (cond, branch) -> ops
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        op = m.group(1)
        if op.endswith("-done"):
            continue
        op = op.removesuffix("-start")
        if op not in COLLECTIVES:
            continue
        b = _COND_BRANCH.search(line)
        if b:
            branches[b.group(1), int(b.group(2))][op] += 1
        else:
            n[op] += 1
    for cond in {c for c, _ in branches}:
        arms = [ops for (c, _), ops in branches.items() if c == cond]
        n.update(max(arms, key=lambda ops: (sum(ops.values()), sorted(ops.items()))))
    return dict(n)


def copies(compiled) -> list[str]:
    """The HLO lines of ``copy`` ops (and ``copy-start``) in ``compiled``: a pool or weight the
    compiler re-lays out around a kernel shows up here."""
    out = []
    for line in compiled.as_text().splitlines():
        m = _OP.search(line)
        if m and m.group(1) in ("copy", "copy-start"):
            out.append(line.strip())
    return out


_USED_VMEM = re.compile(r'"used_scoped_memory_configs":\[([^\]]*)\]')
_LIMIT_VMEM = re.compile(r'"scoped_memory_configs":\[([^\]]*)\]')
_SIZE = re.compile(r'"size":"(\d+)"')


def scoped_vmem(compiled) -> list[dict]:
    """Each Mosaic kernel (``tpu_custom_call``) of ``compiled``: ``{"used", "limit"}`` bytes of
    scoped VMEM (the limit is the kernel's ``vmem_limit_bytes``; 32 MiB when it sets none)."""
    out = []
    for line in compiled.as_text().splitlines():
        if "tpu_custom_call" not in line:
            continue
        used, limit = _USED_VMEM.search(line), _LIMIT_VMEM.search(line)
        size = lambda m: sum(int(v) for v in _SIZE.findall(m.group(1))) if m else 0  # noqa: E731
        out.append({"used": size(used), "limit": size(limit)})
    return out


_KERNEL = re.compile(r'custom_call_target="tpu_custom_call".*?op_name="[^"]*?jit\((\w+)\)/pallas_call')


def kernels(compiled) -> dict[str, int]:
    """Mosaic kernels (``tpu_custom_call``) in the compiled program, by the kernel function's
    name (``kda_decode``, ``mla_ragged_attention_kernel``, ``mxfp4_gmm``, ...): the Pallas
    backend really ran through Mosaic, and which kernels a program calls (a loop body counts
    once)."""
    n = collections.Counter()
    for line in compiled.as_text().splitlines():
        m = _KERNEL.search(line)
        if m:
            n[m.group(1)] += 1
    return dict(n)


def program_report(name: str, compiled, seconds: float) -> dict:
    """The fields ``k3serve compile`` prints and writes for one compiled program."""
    mem = memory(compiled)
    return {"name": name, "ok": True, "error": None, "compile_s": round(seconds, 3),
            "bytes_per_device": mem, **cost(compiled), "collectives": collectives(compiled),
            "kernels": kernels(compiled)}


# HBM per device by device kind, where libtpu does not say: v7x from libtpu 0.0.42.1's own
# "exceeds available HBM (94.75G)" (G = GiB) on tpu7x topologies
HBM_PER_DEVICE = {"TPU7x": int(94.75 * 2**30)}
_HBM = re.compile(r"exceeds available HBM \(([\d.]+)([KMGT])\)")
_TEMP = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\)")


def _sized(m) -> int | None:
    return int(float(m.group(1)) * 2 ** (10 * "KMGT".index(m.group(2)) + 10)) if m else None


def temp_from_error(message: str) -> int | None:
    """The HLO temporaries' bytes libtpu names in a RESOURCE_EXHAUSTED compile error."""
    return _sized(_TEMP.search(message))


def shard_bytes(tree) -> int:
    """Bytes one device holds of ``tree``'s placed arrays or ``ShapeDtypeStruct``s (the most
    any device holds, leaf by leaf)."""
    import jax

    total = 0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(tuple(a.shape)) if getattr(a, "sharding", None) is not None else a.shape
        total += int(np.prod(shape)) * np.dtype(a.dtype).itemsize
    return total


def hbm_from_error(message: str) -> int | None:
    """The available HBM libtpu names in a RESOURCE_EXHAUSTED compile error, in bytes."""
    return _sized(_HBM.search(message))


@functools.lru_cache(maxsize=None)
def hbm_per_device(name: str) -> tuple[int | None, str]:
    """``(bytes, source)``: HBM one device of topology ``name`` may use. libtpu gives no memory
    stats for a device it does not drive, so ask its compiler: a program needing far more than
    any device has fails naming the figure (to 0.01 GiB). Else :data:`HBM_PER_DEVICE`."""
    import jax.numpy as jnp

    mesh = tpu_mesh(name)
    try:
        compile_for_tpu(lambda x: jnp.zeros((1 << 40,), jnp.int8) + x, [placed((), jnp.int8, mesh)], mesh)
    except Exception as e:  # noqa: BLE001 - the error is the answer
        got = hbm_from_error(str(e))
        if got:
            return got, "libtpu (compile error of a 1 TiB program)"
    kind = topology_devices(name)[0].device_kind
    return HBM_PER_DEVICE.get(kind), f"table for {kind} (sharding/tpu_aot.py HBM_PER_DEVICE)"
