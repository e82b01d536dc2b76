"""The ``k3serve`` command line.

Subcommands:
  generate   load a checkpoint (or the embedded demo model) and greedy-decode token ids
  info       print a checkpoint's parsed config and parameter count
  bench      benchmarks: ``bench offline`` = engine throughput at several concurrencies
             (tools/bench_offline.py; ``k3serve bench offline --help``)

Compiled programs are cached on disk (``$K3SERVE_CACHE/jax``, default
``~/.cache/k3serve/jax``) so a second start skips XLA compilation.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _cache_root() -> Path:
    return Path(os.environ.get("K3SERVE_CACHE") or Path.home() / ".cache" / "k3serve")


def _enable_compile_cache() -> None:
    import jax

    path = _cache_root() / "jax"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _model_dir(args) -> Path:
    if args.model:
        return Path(args.model)
    from ..checkpoints.synthetic import demo_checkpoint

    return demo_checkpoint()


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise SystemExit(f"--prompt-ids must be comma-separated integers, got {text!r}")
    if not ids:
        raise SystemExit("--prompt-ids is empty")
    return ids


def cmd_generate(args) -> int:
    _enable_compile_cache()
    from ..model import load_pretrained

    path = _model_dir(args)
    t0 = time.perf_counter()
    m = load_pretrained(path, dtype=args.dtype, dequantize_experts=args.dequantize_experts)
    t1 = time.perf_counter()
    ids = _parse_ids(args.prompt_ids)
    try:
        stop = [m.config.eos_token_id] if (args.stop_at_eos and m.config.eos_token_id is not None) else []
        out = m.greedy(ids, max_new_tokens=args.max_new_tokens, stop_ids=stop)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t2 = time.perf_counter()
    if args.json:
        print(json.dumps({"model": str(path), "prompt_ids": ids, "output_ids": out,
                          "load_s": round(t1 - t0, 3), "generate_s": round(t2 - t1, 3)}))
    else:
        print(f"model: {path} ({m.config.family}, {m.config.num_hidden_layers} layers, dtype {args.dtype})")
        print(f"loaded in {t1 - t0:.2f}s; generated {len(out)} tokens in {t2 - t1:.2f}s (incl. compile)")
        print("prompt ids:", ids)
        print("output ids:", out)
    return 0


def cmd_info(args) -> int:
    from ..checkpoints.safetensors_io import open_checkpoint
    from ..model.config import K3Config

    with open_checkpoint(_model_dir(args)) as ck:
        cfg = K3Config.from_dict(ck.config)
        n = 0
        for name in ck.keys():
            shape = ck.shape(name)
            size = 1
            for d in shape:
                size *= d
            n += size * (2 if ck.dtype(name) == "U8" and name.endswith("weight_packed") else 1)
            if name.endswith("weight_scale"):
                n -= size
        print(f"family: {cfg.family}")
        print(f"layers: {cfg.num_hidden_layers} (MLA at {list(cfg.mla_layers)}, 0-based)")
        print(f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, experts {cfg.num_experts} top-{cfg.num_experts_per_token}"
              f"{' MXFP4' if cfg.experts_mxfp4 else ''}, AttnRes block {cfg.attn_res_block_size}")
        print(f"parameters: {n:,} in {len(ck.keys())} tensors")
    return 0


def cmd_bench(args) -> int:
    if args.kind == "offline":
        from ..tools import bench_offline

        return bench_offline.main(args.rest)
    raise SystemExit(f"unknown benchmark {args.kind!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3serve", description="Kimi K3 inference server (JAX)")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="greedy-decode token ids with a checkpoint or the demo model")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", help="Hugging Face checkpoint directory (K3 or Kimi Linear)")
    src.add_argument("--demo", action="store_true", help="use the embedded demo checkpoint (default)")
    g.add_argument("--prompt-ids", default="1,2,3,4,5", help="comma-separated prompt token ids")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--dequantize-experts", action="store_true", help="decode MXFP4 experts at load")
    g.add_argument("--stop-at-eos", action="store_true", help="stop at the config's eos id")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="describe a checkpoint")
    src = i.add_mutually_exclusive_group()
    src.add_argument("--model")
    src.add_argument("--demo", action="store_true")
    i.set_defaults(func=cmd_info)

    b = sub.add_parser("bench", help="benchmarks (offline: engine throughput)",
                       description="k3serve bench offline [--model DIR|demo] [--concurrency 1,8,32] "
                                   "[--modes async,sync] [--peer-python PY] ...")
    b.add_argument("kind", choices=["offline"])
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the benchmark")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
