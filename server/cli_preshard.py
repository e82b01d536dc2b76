"""``k3serve preshard``: write a pre-sharded Orbax checkpoint, or verify one.

    k3serve preshard SRC DST [--recipe R] [--devices N] [--dtype float32|bfloat16]
                     [--max-memory-gb G] [--chunk-mb M] [--overwrite] [--quiet] [--json]
                     [--coordinator H:P --num-processes N --process-id I | --distributed auto]
    k3serve preshard verify DST [--source SRC] [--json]

On a host without accelerators the recipe's devices are virtual CPU devices (``--devices``,
default the recipe's ep × tp, divided among the processes): this step needs only the CPU.
With several processes (one per host), each reads only its devices' slices of the source and
writes only their shards into DST, which every process must see. See docs/preshard.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3serve preshard",
                                description="Hugging Face safetensors -> Orbax, laid out for a recipe")
    p.add_argument("src", help="safetensors checkpoint directory")
    p.add_argument("dst", help="output directory (resumed if an earlier run was interrupted)")
    p.add_argument("--recipe", default=None, help="parallelism recipe to lay out for (default: one device)")
    p.add_argument("--devices", type=int, default=None,
                   help="devices to use; on CPU, virtual devices to create (default: the recipe's ep x tp)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the non-expert weights (MXFP4 experts stay packed)")
    p.add_argument("--max-memory-gb", type=float, default=4.0,
                   help="host memory for arrays in flight (parts are a quarter of it)")
    p.add_argument("--chunk-mb", type=int, default=32, help="storage chunk size (what another recipe reads)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a pre-sharded checkpoint at DST (only that: any other folder, or one holding SRC, "
                   "is refused untouched)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    g = p.add_argument_group("several processes (one per host; every process runs the same command)")
    g.add_argument("--coordinator", default=None, help="HOST:PORT of JAX's coordination service (process 0 hosts it)")
    g.add_argument("--num-processes", type=int, default=None, help="processes writing the pre-shard")
    g.add_argument("--process-id", type=int, default=None, help="this process")
    g.add_argument("--distributed", choices=["auto"], default=None,
                   help="auto: let jax.distributed.initialize() find the slice (TPU VMs)")
    return p


def _verify_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3serve preshard verify",
                                description="check a pre-sharded checkpoint against its manifest (hashes, dtypes, "
                                            "one run)")
    p.add_argument("dst")
    p.add_argument("--source", default=None,
                   help="the safetensors checkpoint it came from: compare tensor hashes and logits too")
    p.add_argument("--max-memory-gb", type=float, default=2.0)
    p.add_argument("--json", action="store_true")
    return p


def _virtual_devices(n: int | None) -> None:
    """Ask XLA for ``n`` host devices (only matters where the CPU is the platform); must run
    before jax initialises its backends."""
    if not n:
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


def main(argv: list[str]) -> int:
    from ..checkpoints.preshard_format import PreshardError
    from ..sharding.recipe import Recipe, RecipeError

    if argv and argv[0] == "verify":
        args = _verify_parser().parse_args(argv[1:])
        from ..checkpoints.preshard_verify import verify

        try:
            out = verify(args.dst, args.source, max_memory_gb=args.max_memory_gb)
        except PreshardError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(json.dumps(out) if args.json else
              f"ok: {out['arrays']} arrays in {out['parts']} parts of one run, {out['bytes'] / 2**20:.1f} MiB match "
              "their hashes"
              + (f"; {out['source_tensors']} source tensors match, logits equal" if "logits_gap" in out else ""))
        return 0
    args = _parser().parse_args(argv)
    try:
        recipe = Recipe.parse(args.recipe) if args.recipe else None
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    procs = args.num_processes or 1
    if args.coordinator or args.num_processes or args.process_id is not None or args.distributed:
        if recipe is None:
            print("error: a pre-shard by several processes needs --recipe (the mesh they share)", file=sys.stderr)
            return 2
        if args.distributed is None and recipe.devices % procs:
            print(f"error: recipe {recipe} has {recipe.devices} devices, not a multiple of --num-processes {procs}",
                  file=sys.stderr)
            return 2
        _virtual_devices(args.devices or recipe.devices // procs)
        from .cluster.runtime import init_distributed

        try:
            init_distributed(args.coordinator, args.num_processes, args.process_id, auto=args.distributed == "auto")
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    else:
        _virtual_devices(args.devices or (recipe.devices if recipe else None))
    from ..checkpoints.preshard import preshard

    t = time.perf_counter()
    try:
        man = preshard(args.src, args.dst, recipe=recipe, dtype=args.dtype, max_memory_gb=args.max_memory_gb,
                       chunk_mb=args.chunk_mb, overwrite=args.overwrite, progress=not args.quiet)
    except (PreshardError, RecipeError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    dt = time.perf_counter() - t
    gb = man["source"]["bytes"] / 1e9
    summary = {"dst": str(args.dst), "arrays": len(man["leaves"]), "resumed_arrays": man["resumed_leaves"],
               "source_gb": round(gb, 4), "seconds": round(dt, 2), "s_per_gb": round(dt / max(gb, 1e-9), 2),
               "recipe": (man["recipe"] or {}).get("spec"), "processes": man["processes"],
               **man["this_process"]}
    mine = man["this_process"]
    print(json.dumps(summary) if args.json else
          f"pre-sharded {gb:.3f} GB into {len(man['leaves'])} arrays at {args.dst} in {dt:.1f} s "
          f"({summary['s_per_gb']} s/GB; {man['resumed_leaves']} arrays resumed)"
          + (f"; process {mine['process']} of {man['processes']} read {mine['source_bytes_read'] / 1e9:.3f} GB of "
             "the source" if man["processes"] > 1 else ""))
    return 0
