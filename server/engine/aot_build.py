"""The engine's serving programs built from abstract parameters and caches, and compiled for
another platform (a TPU topology on a CPU host: ``sharding.tpu_aot``) without running anything.

Why: what ``serve`` compiles at warm-up is the truth about a configuration — whether it fits a
device, what it moves, which collectives it runs — and it can be had before a slice exists.
So nothing here re-implements a program: the engine is built with ``abstract=True`` (its
parameters, cache and token table are placed ``ShapeDtypeStruct``s; ``Engine``'s and
``Runner``'s seam), and each program is the runner's or cache manager's own jitted function,
lowered on the arguments warm-up would give it (``Runner.warmup``, ``warm_programs``): a step
program per token bucket, a sampling program per row count (on the step's outputs), the
token-table row write, the prefix-cache copies, the host-tier reads and loads, and a P/D
server's export cuts (prefill) and import loads (decode).

Per-step costs: XLA:TPU's cost analysis counts a loop body once, and the step scans its
layers, so :func:`decode_costs` compiles the decode step of one-layer (and one two-layer)
models of each layer kind, layers unrolled (16-bit stacks, see there), and sums the
per-layer differences times each kind's layer count.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter

import numpy as np

from ...checkpoints.loader import abstract_pretrained
from .engine import Engine
from .sampler import table_width
from .warm_programs import small_program_widths


@dataclasses.dataclass
class Built:
    """One program: its compiled form (None if it failed), seconds to lower and compile, the error."""

    name: str
    compiled: object
    seconds: float
    error: str | None


def abstract_engine(cfg, *, devices, recipe=None, dtype="float32", kernels="reference",
                    dequantize_experts: bool = False, **engine_kw) -> Engine:
    """An ``Engine(abstract=True)`` of ``cfg`` on ``devices`` (e.g. a TPU topology's): the
    parameters as the loader would store them, placed by ``recipe`` (or on ``devices[0]``)."""
    placement = device = None
    if recipe is not None:
        from ...sharding.mesh import build_mesh, placement_for
        from ...sharding.recipe import Recipe

        r = Recipe.parse(recipe).validate(cfg, num_devices=len(devices))
        placement = placement_for(build_mesh(r, list(devices)))
        recipe = r
    else:
        device = list(devices)[0]
    model = abstract_pretrained(cfg, dtype, dequantize_experts=dequantize_experts, placement=placement,
                                device=device, kernels=kernels)
    return Engine(model, recipe=recipe, devices=list(devices), abstract=True, warmup=False, **engine_kw)


def _sds(shape, dtype=np.int32):
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))


def _attempt(name: str, lower, context, compile: bool = True) -> tuple[Built, object]:
    """Lower (under ``context``) and compile; ``(Built, what to read out_info from)``."""
    t = time.perf_counter()
    lowered = compiled = error = None
    try:
        with context():
            lowered = lower()
        if compile:
            compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - a program that fails is a result, not a crash
        error = f"{type(e).__name__}: {e}"
    return Built(name, compiled, time.perf_counter() - t, error), (compiled or lowered)


def serving_programs(engine, context=contextlib.nullcontext, want=lambda name: True):
    """Compile every program ``serve`` compiles for ``engine``'s configuration (its P/D role's
    too: a prefill server's export reads and cuts, a decode server's import loads); yields a
    :class:`Built` per program, in warm-up's order.
    ``want(name)``: False skips a program (a sampler whose step is skipped still lowers it)."""
    import jax

    run, mgr = engine.runner, engine.cache_mgr
    params, cache = engine.model.params, mgr.device_cache
    samplers = set()

    def attempt(name, lower, compile=True):
        if not want(name):
            return None, None
        return _attempt(name, lower, context, compile)

    # a speculating engine has two programs per bucket (``Runner.launch``): the plain one
    # (``step[T=N]``, sampled by ``sample[R=N]``) and the speculative one (``step[T=N,spec]``,
    # sampled by ``sample[R=N,spec]`` and, when a row reads the token table, ``sample[R=N,spec,table]``)
    # (a DSpark engine runs only the speculative one, then its draft program ``draft[T=N]``)
    kinds = ((True,) if run.draft is not None else (False, True)) if run.journal is not None else (False,)
    for T in run.shape_buckets():
        R = run.layout(T).R
        for sp in kinds:
            tag = ",spec" if sp else ""
            snames = [f"sample[R={R}{tag}{',table' if u else ''}]" for u in ((False, True) if sp else (False,))]
            sample = (R, sp) not in samplers and any(want(n) for n in snames)
            name = f"step[T={T}{tag}]"
            dname = f"draft[T={T}]"
            drafting = sp and run.draft is not None and want(dname)
            built, src = _attempt(name, lambda T=T, sp=sp: run._jit(T, sp).lower(params, cache, *run._padding_args(T, sp)),
                                  context, compile=want(name)) if want(name) or sample or drafting else (None, None)
            if want(name):
                yield built
            if drafting:
                if src is None:
                    yield Built(dname, None, 0.0, "not lowered: its step program did not lower")
                else:  # on the step's outputs: the tokens and rows as it ran them, the target's taps
                    _, _, rows, _, _, tok, taps = src.out_info[:7]
                    meta, last = run._padding_args(T, sp)[:2]  # the last tokens: [most rows]
                    acc = jax.ShapeDtypeStruct((R,), last.dtype, sharding=last.sharding)  # accepted: [the step's rows]
                    yield _attempt(dname, lambda T=T, rows=rows, tok=tok, taps=taps, meta=meta, acc=acc, last=last:
                                   run._draft_jit(T).lower(run._draft_params, params, cache, meta, tok, rows, taps, acc,
                                                           last), context)[0]
            if (R, sp) in samplers or not sample:
                continue
            samplers.add((R, sp))
            if src is None:
                for n in snames:
                    yield Built(n, None, 0.0, "not lowered: its step program did not lower")
                continue
            if sp:
                logits, _, rows, spec = src.out_info[:4]
                for u, n in zip((False, True), snames):
                    yield _attempt(n, lambda u=u: run._sample_spec_jit[u].lower(logits, rows, spec, run.table,
                                                                                run.bitmask_arg(R)), context)[0]
                continue
            logits, _, rows = src.out_info
            yield _attempt(snames[0], lambda: run._sample_jit.lower(logits, rows, run.table, run.bitmask_arg(R)),
                           context)[0]
    progs = [("table_row", lambda: run._set_row.lower(run.table, _sds(()), _sds((table_width(run.vocab_size),))))]
    if engine.prefix_cache is not None:
        for w in mgr.copy_widths:
            for what in ("pages", "slots"):
                progs.append((f"cache_{what}[{w}]", lambda what=what, w=w: mgr._program(what).lower(
                    cache, _sds((w,)), _sds((w,)))))
    for name, lower in progs:
        built, _ = attempt(name, lower)
        if built is not None:
            yield built
    widths = small_program_widths(engine, engine.pd_role)
    for w in sorted(set(widths["read"]) | set(widths["load"])):
        load = w in widths["load"] and want(f"cache_load[{w}]")
        cuts = engine.pd_role == "prefill" and w in widths["read"] and want(f"deal[{w}]")
        name = f"cache_read[{w}]"
        built, src = _attempt(name, lambda w=w: mgr._program("read").lower(cache, _sds(()), _sds((w,))), context,
                              compile=want(name)) if want(name) or load or cuts else (None, None)
        if want(name):
            yield built
        if cuts:  # a P/D prefill server's export of w pages, cut into a decode's pieces (deal.warm_cuts)
            if src is None:
                yield Built(f"deal[{w}]", None, 0.0, "not lowered: its read program did not lower")
            else:
                yield from _cut_programs(w, src.out_info, context)
        if load:
            if src is None:
                yield Built(f"cache_load[{w}]", None, 0.0, "not lowered: its read program did not lower")
                continue
            state, conv, rows = src.out_info
            yield _attempt(f"cache_load[{w}]", lambda w=w, st=state, cv=conv, rw=rows: mgr._program("load").lower(
                cache, _sds((w,)), _sds((w,)), rw, _sds(()), _sds(()), st, cv), context)[0]


def _cut_programs(w: int, export, context):
    """The cut programs of a ``w``-page export (``deal.warm_cuts``'s set): a state piece per
    head count dividing the heads, a rows piece per power of two of pages up to ``w``."""
    from .cache import deal

    state, _, rows = export
    for kind, n in deal.cut_variants(state.shape[1], rows.shape[1]):
        lower = (lambda n=n: deal._heads.lower(state, _sds(()), n)) if kind == "heads" else (
            lambda n=n: deal._pages.lower(rows, _sds((n,))))
        yield _attempt(f"deal[{w}]:{kind}[{n}]", lower, context)[0]


def decode_bucket(engine) -> int:
    """The token bucket of a decode step with one token per row at ``max_num_seqs`` rows."""
    run = engine.runner
    return next((b for b in run.token_buckets if b >= run.group_rows), run.token_buckets[-1])


def layer_kinds(cfg) -> Counter:
    """``{(attention type, is MoE): layers}`` of ``cfg``."""
    return Counter((cfg.layer_types[l], bool(cfg.is_moe_layer(l))) for l in range(cfg.num_hidden_layers))


def kinds_config(cfg, kinds):
    """``cfg`` cut to one layer per entry of ``kinds`` (dense-MLP layers first, as the config's
    ``first_k_dense_replace`` puts them), same widths."""
    kinds = sorted(kinds, key=lambda k: k[1])  # stable: the dense layers first
    return cfg.replace(num_hidden_layers=len(kinds), layer_types=tuple(a for a, _ in kinds),
                       first_k_dense_replace=sum(1 for _, moe in kinds if not moe), moe_layer_freq=1)


def _label(kind) -> str:
    return f"{kind[0]}+{'moe' if kind[1] else 'mlp'}"


def decode_costs(build, cfg, T: int, context=contextlib.nullcontext, log=None) -> dict:
    """Per-step cost of the decode step (bucket ``T``), summed over layers. The decode step of
    ``build(cfg_variant)`` (an abstract engine of the same flags) is compiled with its layers
    unrolled for an anchor model (one layer of each attention type: a recipe's DCP needs an
    MLA layer) and for the anchor plus two layers of each kind; half the differences are the
    per-layer costs, the anchor less its layers the rest of the step. Two layers, not one:
    XLA:TPU's memory-space assignment picks which arrays it prefetches into VMEM per program,
    and its cost analysis counts such a prefetch on top of the reads; one program's choice
    moved a one-layer difference by ~40 MB (x 68 layers), the two-layer slope by much less
    (docs/compile.md).

    ``build`` should give engines with 16-bit layer stacks (not packed, ``model.packed_rows``):
    straight-line layers read those once, in the matmuls' tiling (no re-tiling outside a loop),
    which is what the scan does with packed stacks (each layer's slice unpacked in VMEM);
    straight-line layers on packed stacks unpack them into HBM instead (docs/compile.md).

    A ragged EP exchange is compiled as its usual branch (``sharding.ep``'s ``"ragged-usual"``:
    receive buffers of twice the balanced load), what every step whose routing fits them runs:
    XLA's cost analysis counts a ``cond`` at its larger branch, the worst-case buffers a step
    takes only when some rank would receive more (``"ep_exchange"`` in the result says so).
    Likewise the KDA layers run their prefill path (rows of two tokens or more) under a ``cond``
    (``kernels/kda_pools.py``); a decode step takes the other branch, so the decode programs are
    compiled without it (``StepParallel.kda_prefill_rows``).
    ``{"flops", "bytes_accessed", "collectives", "per_layer": {kind: {...}}, "base": {...},
    "programs": [Built]}`` (None figures where a program failed)."""
    from ...sharding import tpu_aot
    from ...sharding.ep import resolve_impl

    kinds = layer_kinds(cfg)
    anchor = [max((k for k in kinds if k[0] == a), key=kinds.get) for a in dict.fromkeys(cfg.layer_types)]
    variants = [("anchor", anchor)] + [(_label(k), anchor + [k, k]) for k in kinds]
    figures, programs = {}, []
    keys = ("flops", "bytes_accessed", "collectives")
    usual = False
    for label, layers in variants:
        eng = build(kinds_config(cfg, layers))
        eng.runner.unroll_layers = True
        par = eng.par
        if par is not None and par.ep_impl is not None and resolve_impl(par.ep_impl, par.mesh) == "ragged":
            par.ep_impl, usual = "ragged-usual", True  # the exchange a step whose routing fits runs (docstring)
        if par is not None:  # one token per row: the KDA layers' prefill path is a branch not taken (docstring)
            par.kda_prefill_rows = False
        run = eng.runner
        built, _ = _attempt(f"decode_layers[{' '.join(_label(k) for k in layers)}]",
                            lambda: run._jit(T).lower(eng.model.params, eng.cache_mgr.device_cache,
                                                      *run._padding_args(T)), context)
        programs.append(built)
        if log:
            log(built)
        if built.compiled is None:
            return {"flops": None, "bytes_accessed": None, "collectives": None, "per_layer": {}, "base": None,
                    "programs": programs}
        c = tpu_aot.cost(built.compiled)
        c["collectives"] = sum(tpu_aot.collectives(built.compiled).values())
        figures[label] = c
    half = lambda f, v: v // 2 if f == "collectives" else v / 2  # noqa: E731  (collectives stay counts)
    per_layer = {k: {f: half(f, figures[_label(k)][f] - figures["anchor"][f]) for f in keys} for k in kinds}
    base = {f: figures["anchor"][f] - sum(per_layer[k][f] for k in anchor) for f in keys}
    total = {f: base[f] + sum(kinds[k] * per_layer[k][f] for k in kinds) for f in keys}
    return {**total, "base": base, "per_layer": {_label(k): {"layers": kinds[k], **per_layer[k]} for k in kinds},
            "ep_exchange": "usual branch" if usual else None, "programs": programs}
