"""``k3serve compile``: compile every program ``serve`` would compile, for a TPU topology, on
this host (libtpu ahead-of-time; no TPU, no weights read), and report what the compiler says.

Why: a slice is expensive and a model takes long to load; whether the configuration fits a
device, what a decode step moves and which collectives it runs are all known to the compiler
before either. Run it with the slice's topology before ``serve`` (docs/compile.md).

    k3serve compile --topology tpu7x:2x2x4 --recipe v7-32-decode --model k3 \\
        [--kernels pallas|reference] [serve's engine flags] [--json OUT]

``--model``: a checkpoint directory, a pre-shard, a ``config.json``, ``demo``, ``k3`` (the
released config) or ``k3@L`` (the release's widths at L layers: how compile time scales with
depth); the K3 ones default to bfloat16, the others to serve's float32. The engine is
built abstractly (``server.engine.aot_build``); the planner's side is
``sharding.compile_report``. Exit status 0 when every program compiled, 1 otherwise, 2 on a
usage error.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .api.engine_args import add_prefix_flags, add_spec_flags, prefix_kwargs, spec_kwargs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3serve compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", required=True, help="TPU topology, e.g. tpu7x:2x2x4 (32 devices, 16 chips)")
    p.add_argument("--recipe", default=None, help="parallelism recipe, as serve's (default: one device)")
    p.add_argument("--model", required=True,
                   help="checkpoint dir, pre-shard, config.json, 'demo', 'k3' or 'k3@L' (K3's widths, L layers)")
    p.add_argument("--kernels", choices=["pallas", "reference"], default="pallas",
                   help="kernel backend (default pallas: serve's on a TPU)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="parameter dtype (default: bfloat16 for 'k3' and 'k3@L', else serve's float32)")
    p.add_argument("--dequantize-experts", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--bucket-growth", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-memory-gb", type=float, default=None)
    p.add_argument("--num-pages", type=int, default=None)
    add_prefix_flags(p)
    add_spec_flags(p)
    p.add_argument("--role", choices=["unified", "prefill", "decode"], default="unified",
                   help="serve's P/D role: a prefill server also compiles its exports' cut programs, a decode "
                        "server its imports' loads (default unified)")
    p.add_argument("--pd-handoff-memory-gb", type=float, default=4.0,
                   help="serve's handoff memory of a P/D server (counted in the capacity plan)")
    p.add_argument("--only", default=None, metavar="REGEX",
                   help="compile only the programs whose name matches (e.g. 'step|decode'); the rest are not "
                        "reported, and the per-device total counts only their temporaries")
    p.add_argument("--no-pack-layer-stacks", action="store_true",
                   help="keep the 16-bit layer stacks as 16-bit arrays (serve on a TPU stores them packed as "
                        "uint32 row pairs, the matmuls' tiling: docs/compile.md); for comparison")
    p.add_argument("--no-decode-costs", action="store_true",
                   help="skip the per-layer decode programs (the decode step's summed cost)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the report as JSON to OUT ('-': stdout)")
    return p


def model_config(spec: str):
    """``(K3Config, label)`` of ``--model``: 'k3', 'k3@L', 'demo', a config.json, or a checkpoint dir."""
    from ..model.config import K3Config, k3_full

    if spec == "k3":
        return k3_full(), "k3 (released config)"
    if spec.startswith("k3@"):  # the release's widths at another depth (compile-time scaling, issue #33 item 5)
        import dataclasses

        from ..model.config import release_layer_types

        L = int(spec[3:])
        return (dataclasses.replace(k3_full(), num_hidden_layers=L, layer_types=release_layer_types(L)),
                f"k3 widths, {L} layers")
    if spec == "demo":
        from ..demo import demo_checkpoint

        path = demo_checkpoint()
    else:
        path = Path(spec)
    if path.is_file():
        return K3Config.from_json_file(path), str(path)
    from ..checkpoints.config_of import checkpoint_config

    return K3Config.from_dict(checkpoint_config(path)), str(path)


def engine_kwargs(args) -> dict:
    """The engine keywords of serve's flags (as ``api.engine_args.build_engine`` passes them)."""
    kv = dict(kv_memory_bytes=int(args.kv_memory_gb * (1 << 30))) if args.kv_memory_gb else (
        dict(num_pages=args.num_pages) if args.num_pages else {})
    from .api.engine_args import pd_handoff_bytes

    return dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                chunk_size=args.chunk_size, page_size=args.page_size, max_model_len=args.max_model_len,
                bucket_growth=args.bucket_growth, pd_role=None if args.role == "unified" else args.role,
                pd_handoff_bytes=pd_handoff_bytes(args), pack_layer_stacks=not args.no_pack_layer_stacks,
                **prefix_kwargs(args), **spec_kwargs(args), **kv)


def _failed(name: str, error: str, seconds: float = 0.0) -> dict:
    return {"name": name, "ok": False, "error": error, "compile_s": round(seconds, 3), "bytes_per_device": None,
            "flops": None, "bytes_accessed": None, "collectives": {}, "kernels": {}}


def _entry(built) -> dict:
    from ..sharding import tpu_aot

    if built.compiled is None:
        return _failed(built.name, built.error, built.seconds)
    return tpu_aot.program_report(built.name, built.compiled, built.seconds)


def run(args, log=print) -> dict:
    """Build, compile and measure; the JSON report (``ok`` False on any failure)."""
    from ..sharding import tpu_aot

    rep = {"ok": False, "error": None, "model": args.model, "topology": args.topology, "devices": None,
           "recipe": args.recipe, "kernels": args.kernels, "dtype": args.dtype, "programs": [],
           "hbm_per_device": None, "fits": None, "per_device_bytes": {"compiler": None, "plan": None},
           "decode": {}}
    try:
        tpu_aot.require_libtpu()
        cfg, rep["model"] = model_config(args.model)
        rep["dtype"] = dtype = args.dtype or ("bfloat16" if args.model.split("@")[0] == "k3" else "float32")
        devices = tpu_aot.topology_devices(args.topology)
        rep["devices"] = len(devices)
        rep["hbm_per_device"], rep["hbm_source"] = tpu_aot.hbm_per_device(args.topology)
        from .engine.aot_build import abstract_engine

        kw = engine_kwargs(args)
        t = time.perf_counter()
        engine = abstract_engine(cfg, devices=devices, recipe=args.recipe, dtype=dtype, kernels=args.kernels,
                                 dequantize_experts=args.dequantize_experts, **kw)
        log(f"k3serve compile: engine built abstractly in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - reported, not raised: CI reads the JSON
        rep["error"] = f"{type(e).__name__}: {e}"
        return rep
    mesh = engine.mesh if engine.mesh is not None else tpu_aot.tpu_mesh(args.topology)
    ctx = lambda: tpu_aot.abstract_mesh(mesh)  # noqa: E731 - Pallas asks the default device's TPU otherwise
    from .engine.aot_build import decode_bucket, decode_costs, serving_programs

    # a DSpark draft's weights (whole on every device) count with the target's
    draft = tpu_aot.shard_bytes(engine.runner._draft_params) if engine.runner.draft is not None else 0
    weights = tpu_aot.shard_bytes(engine.model.params) + draft
    # speculative decoding's KDA journal lives beside the cache (counted with it)
    journal = tpu_aot.shard_bytes(engine.runner.journal) if engine.runner.journal is not None else 0
    caches = tpu_aot.shard_bytes((engine.cache_mgr.device_cache, engine.runner.table)) + journal
    temps = {}
    import re

    want = (lambda name: re.search(args.only, name) is not None) if args.only else (lambda name: True)
    rep["only"] = args.only
    for built in serving_programs(engine, ctx, want):
        entry = _entry(built)
        rep["programs"].append(entry)
        log(f"  {built.name}: {'ok' if entry['ok'] else 'FAILED'} in {built.seconds:.1f}s", file=sys.stderr)
        # libtpu's "HLO temporaries (X)" of a program past the HBM is its whole need (the design
        # note: 128.71G = 62.2 GiB of parameters and cache + 66.6 GiB of temporaries)
        past = None if entry["ok"] else tpu_aot.temp_from_error(built.error or "")
        temp = entry["bytes_per_device"]["temp"] if entry["ok"] else (
            None if past is None else max(0, past - weights - caches))
        if temp is not None:
            temps[built.name] = temp
    worst = max(temps, key=temps.get) if temps else None
    rep["compiler_parts"] = {"weights": weights, "caches": caches, "temp": temps.get(worst), "temp_program": worst,
                             "journal": journal, "draft_weights": draft}
    rep["per_device_bytes"]["compiler"] = weights + caches + (temps.get(worst) or 0)
    plan_cap = engine.capacity_plan
    T = decode_bucket(engine)
    rep["decode"] = {"rows": args.max_num_seqs, "bucket": T, "bytes_accessed": None, "plan_bytes": None}
    try:
        from ..sharding.compile_report import plan_figures
        from ..sharding.recipe import Recipe

        recipe = engine.recipe or Recipe.parse("ep=1,tp=1")
        plan = plan_figures(cfg, recipe, dtype=dtype, max_num_seqs=args.max_num_seqs,
                            max_model_len=args.max_model_len, snapshots=plan_cap.snapshot_slots,
                            hbm_bytes=rep["hbm_per_device"], packed=engine.packed_layer_stacks,
                            step_tokens=max(engine.runner.shape_buckets()))
        rep["per_device_bytes"]["plan"] = plan["per_device_bytes"]
        rep["plan_parts"] = {"weights": plan["weights_per_device"], "caches": plan["caches_per_device"],
                             "retiled": plan["retiled_per_device"], "activations": plan["activations_per_device"]}
        rep["decode"].update(plan_bytes=plan["decode_bytes"], plan_collectives=plan["decode_collectives"],
                             plan_collective_parts=plan["decode_collective_parts"])
    except Exception as e:  # noqa: BLE001
        rep["decode"]["plan_error"] = f"{type(e).__name__}: {e}"
    ok = True
    if not args.no_decode_costs and want("decode_layers[]"):
        # straight-line layers read 16-bit stacks once (``aot_build.decode_costs``): not packed
        var_kw = dict(kw, num_pages=plan_cap.num_pages, kv_memory_bytes=None,
                      prefix_snapshots=plan_cap.snapshot_slots or None, pack_layer_stacks=False)

        def build(var_cfg):
            return abstract_engine(var_cfg, devices=devices, recipe=args.recipe, dtype=dtype, kernels=args.kernels,
                                   dequantize_experts=args.dequantize_experts, **var_kw)

        try:
            d = decode_costs(build, cfg, T, ctx, log=lambda b: log(
                f"  {b.name}: {'ok' if b.compiled is not None else 'FAILED'} in {b.seconds:.1f}s", file=sys.stderr))
            progs = d.pop("programs")
            rep["programs"].extend(_entry(b) for b in progs)
            rep["decode"].update(d)
        except Exception as e:  # noqa: BLE001
            rep["decode"]["error"] = f"{type(e).__name__}: {e}"
            ok = False
    rep["ok"] = ok and bool(rep["programs"]) and all(p["ok"] for p in rep["programs"])
    hbm, need = rep["hbm_per_device"], rep["per_device_bytes"]["compiler"]
    over = any(tpu_aot.hbm_from_error(p["error"] or "") for p in rep["programs"])
    # fits: every program compiled and the sum is within a device; False when the compiler said
    # it is not (a program past the HBM) or the sum is past it; None when a failure hides it
    rep["fits"] = (False if over or (hbm and need > hbm) else
                   True if all(p["ok"] for p in rep["programs"]) and hbm else None)
    return rep


def main(argv=None) -> int:
    from ..sharding.compile_report import format_report

    args = build_parser().parse_args(argv)
    t = time.perf_counter()
    rep = run(args)
    rep["wall_s"] = round(time.perf_counter() - t, 1)
    if args.json:
        text = json.dumps(rep, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    if args.json != "-":
        print(format_report(rep))
    return 0 if rep["ok"] else 1
