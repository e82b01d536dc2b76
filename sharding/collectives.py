"""The collectives of a compiled program, read from its optimized HLO text: which op, the
shape and bytes of each result and the source op it came from.

Why: XLA's Auto partitioner chooses the collectives of a step, and a poor choice (an
all-gather of a whole weight or cache array every layer) costs correctness nothing and shows
up nowhere but in the program. ``tools/step_collectives.py`` prints them for a recipe's step
programs; ``tests/test_step_collectives.py`` checks that no step gathers a whole parameter or
cache array.

A collective inside a loop (the layer scan) is listed once: the counts are of the program
text, not of executions.
"""
from __future__ import annotations

import dataclasses
import math
import re

KINDS = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f4e2m1fn": 1, "s16": 2, "u16": 2, "f16": 2,
          "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<result>.+?)\s+(?P<kind>" + "|".join(KINDS)
                   + r")(?:-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    shapes: tuple  # ((dtype, (dims...)), ...): one per result (a tuple result has several)
    nbytes: int  # all results together
    op_name: str  # the JAX op it was partitioned from (metadata), "" when absent


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in ``hlo_text`` (``compiled.as_text()``), in program order. The
    ``-done`` half of an async pair is not listed again."""
    out = []
    for line in hlo_text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        shapes = tuple((d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _SHAPE.findall(m["result"])
                       if d in _BYTES)
        nbytes = sum(_BYTES[d] * math.prod(dims) for d, dims in shapes)
        op = re.search(r'op_name="([^"]*)"', line)
        out.append(Collective(m["kind"], shapes, nbytes, op.group(1) if op else ""))
    return out


def summary(colls: list[Collective]) -> dict:
    """``{kind: (count, bytes)}``."""
    out: dict = {}
    for c in colls:
        n, b = out.get(c.kind, (0, 0))
        out[c.kind] = (n + 1, b + c.nbytes)
    return out


def runner_arrays(runner) -> dict:
    """The shapes :func:`whole_array_gathers` looks for in an engine's runner
    (``server.engine.runner.Runner``): each weight matrix of its model (one layer's row of a
    scanned stack, ``attn.*``/``ffn.*``) whose dims all exceed 4x the largest token bucket (no
    activation of a step has its shape: tokens, rows and a few experts per token stay below
    it), and every array of its device cache whole. ``{name: shape}``."""
    from flax import nnx

    max_tokens = max(runner.shape_buckets())
    out = {}
    for p, v in nnx.to_flat_state(runner.model.params):
        name, shape = ".".join(map(str, p)), tuple(v.get_value().shape)
        layer = shape[1:] if name.startswith(("attn.", "ffn.")) else shape
        if len(layer) >= 2 and min(layer) > 4 * max_tokens:
            out[name] = layer
    cache = runner.cache_mgr.device_cache
    out.update({f"cache.{k}": tuple(getattr(cache, k).shape) for k in ("kda_state", "kda_conv", "mla_kv")})
    return out


def whole_array_gathers(colls: list[Collective], arrays: dict) -> list[tuple[str, Collective]]:
    """The all-gathers whose result has exactly the shape of one of ``arrays`` ({name:
    shape}): a whole parameter or cache array moved between devices. Pairs of (array name,
    collective). Choose the shapes so that no activation can have them (e.g. every dim larger
    than the step's token and row counts)."""
    by_shape: dict = {}
    for name, shape in arrays.items():  # arrays of one shape are named together
        by_shape[tuple(shape)] = f"{by_shape[tuple(shape)]} or {name}" if tuple(shape) in by_shape else name
    hits = []
    for c in colls:
        if c.kind != "all-gather":
            continue
        for _, dims in c.shapes:
            if dims in by_shape:
                hits.append((by_shape[dims], c))
                break
    return hits
