"""The ``k3serve`` command line.

Subcommands:
  generate   load a checkpoint (or the embedded demo model) and greedy-decode token ids
  info       print a checkpoint's parsed config and parameter count
  plan       memory per device and max concurrent requests for parallelism recipes
  serve      serve a checkpoint over gRPC (SGLang scheduler protocol, health, reflection)
  compile    ``compile --topology tpu7x:2x2x4 --recipe R --model M``: every serving program compiled
             for a TPU topology here, no TPU and no weights (server/cli_compile.py, docs/compile.md)
  preshard   ``preshard SRC DST --recipe R``: safetensors -> Orbax laid out for a recipe;
             ``preshard verify DST [--source SRC]`` (server/cli_preshard.py)
  bench      ``bench --server HOST:PORT --trace T.jsonl``: replay a Mooncake trace over gRPC
             (server/client/replay.py); ``bench offline``: engine throughput at several
             concurrencies; ``bench prefix``: the agentic trace with prefix caching on and off;
             ``bench host``: host time per decode step at several context lengths;
             ``bench step``: decode step time by row count and the memory roofline;
             ``bench spec``: speculative decoding against plain (imposed acceptance, drafters);
             ``bench structured``: step time with grammar rows, grammar compile time

Compiled programs are cached on disk (``$K3SERVE_CACHE/jax``, default
``~/.cache/k3serve/jax``) so a second start skips XLA compilation.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from .api.engine_args import add_prefix_flags, add_spec_flags


def _model_dir(args) -> Path:
    from ..demo import model_or_demo

    return model_or_demo(args.model)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise SystemExit(f"--prompt-ids must be comma-separated integers, got {text!r}")
    if not ids:
        raise SystemExit("--prompt-ids is empty")
    return ids


def cmd_generate_remote(args) -> int:
    """Stream a completion from a running server (text via the server's own tokenizer)."""
    from .client.client import Client

    with Client(args.server, api_key=args.api_key) as c:
        tok = None
        if args.ids:
            ids = _parse_ids(args.ids)
        else:
            if not args.text:
                raise SystemExit("give a prompt text, or --ids")
            tok = c.tokenizer()
            if tok is None:
                raise SystemExit("the server has no tokenizer: use --ids")
            if args.chat:
                from .text.chat import encode_chat

                ids = encode_chat(tok, [{"role": "user", "content": args.text}], thinking=args.thinking)
            else:
                ids = tok.encode(args.text)
        detok = tok.detokenizer(skip_special_tokens=not args.show_special) if tok is not None else None
        t0 = time.perf_counter()
        ttft = None
        done = None
        try:
            for r in c.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, ignore_eos=args.ignore_eos):
                if r.HasField("chunk"):
                    ttft = ttft or time.perf_counter() - t0
                    new = list(r.chunk.token_ids)
                    sys.stdout.write(detok.add(new) if detok else " ".join(map(str, new)) + " ")
                    sys.stdout.flush()
                else:
                    done = r.complete
        except Exception as e:  # grpc.RpcError: print the status, not a traceback
            code = getattr(e, "code", lambda: None)()
            details = getattr(e, "details", lambda: str(e))()
            print(f"\nerror: {code.name if code else type(e).__name__}: {details}", file=sys.stderr)
            return 2
        if detok:
            sys.stdout.write(detok.flush())
        wall = time.perf_counter() - t0
        print(f"\n[{done.finish_reason}; {len(ids)} prompt + {done.completion_tokens} generated tokens; "
              f"TTFT {1000 * (ttft or wall):.0f} ms; {wall:.2f} s]", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    if args.server:
        return cmd_generate_remote(args)
    from ..compile_cache import enable_compile_cache

    enable_compile_cache()
    from ..checkpoints import load_pretrained

    path = _model_dir(args)
    t0 = time.perf_counter()
    m = load_pretrained(path, dtype=args.dtype, dequantize_experts=args.dequantize_experts)
    t1 = time.perf_counter()
    ids = _parse_ids(args.ids or args.prompt_ids)
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
    from ..checkpoints.preshard_format import is_preshard, read_manifest
    from ..checkpoints.safetensors_io import open_checkpoint
    from ..model.config import K3Config

    if is_preshard(_model_dir(args)):
        man = read_manifest(_model_dir(args))
        cfg = K3Config.from_dict(man["config"])
        print(f"family: {cfg.family} (pre-sharded, {man['format']}, for recipe "
              f"{(man['recipe'] or {}).get('spec', 'one device')}, dtype {man['dtype']}, experts {man['experts']})")
        print(f"layers: {cfg.num_hidden_layers} (MLA at {list(cfg.mla_layers)}, 0-based)")
        print(f"arrays: {len(man['leaves'])} from {len(man['source']['tensors'])} source tensors "
              f"({man['source']['bytes']:,} bytes)")
        return 0
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


def cmd_serve(args) -> int:
    from .api.serve import serve

    return serve(args)


# ``k3serve bench NAME ...``: the in-process benchmarks (server/bench/NAME.py's main)
BENCHES = {"offline": "offline", "prefix": "prefix", "pd": "pd", "loop": "loop_latency", "host": "host",
           "warmup": "warmup", "step": "step", "spec": "spec", "structured": "structured"}


def cmd_bench(args) -> int:
    import importlib

    rest = list(args.rest)
    if rest and rest[0] in BENCHES:
        return importlib.import_module(f"{__package__}.bench.{BENCHES[rest[0]]}").main(rest[1:])
    from .client.replay import bench_main

    return bench_main(rest)


def cmd_plan(args) -> int:
    """Memory per device and max concurrency for recipes (the full K3 by default)."""
    from ..model.config import K3Config, k3_full
    from ..sharding.memory import param_inventory, plan_memory
    from ..sharding.recipe import Recipe, RecipeError

    if args.model:
        cfg = K3Config.from_dict(json.loads((Path(args.model) / "config.json").read_text()))
        label = args.model
    else:
        cfg, label = k3_full(), "Kimi K3 (full release config)"
    inv = param_inventory(cfg)
    if args.compare_seed:
        return _plan_compare_seed(args, cfg, inv)
    if args.context_len is None:
        args.context_len = 131072
    if args.concurrency or args.recommend:
        return _plan_roofline(args, cfg, inv)
    plans = []
    for text in args.recipe:
        try:
            r = Recipe.parse(text).validate(cfg)
        except RecipeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        plans.append(plan_memory(cfg, r, inv, context_len=args.context_len, hbm_gb=args.hbm_gb,
                                 usable_fraction=args.usable_fraction,
                                 snapshots_per_request=args.snapshots_per_request))
    if args.json:
        import dataclasses

        print(json.dumps({"model": label, "plans": [dataclasses.asdict(p) for p in plans]}, indent=1))
        return 0
    n = sum(math.prod(s) * (2 if p.endswith("_packed") else 0 if p.endswith("_scale") else 1) for p, s, _ in inv)
    print(f"{label}: {n:,} parameters; HBM {args.hbm_gb:g} GB/device, "
          f"{args.usable_fraction:.0%} usable; context {args.context_len:,} tokens")
    rows = [p.rows() for p in plans]
    width = max(len(k) for k, _ in rows[0])
    for i in range(len(rows[0])):
        print(rows[0][i][0].ljust(width), *(r[i][1].rjust(22) for r in rows))
    return 0


def _plan_compare_seed(args, cfg, inv) -> int:
    import dataclasses

    from ..sharding.roofline import DSPARK, TPU7X
    from ..sharding.plan_compare import AGENTX_CONTEXT, compare_seed, plot_comparison, print_comparison

    device = dataclasses.replace(TPU7X, collective_latency_s=args.collective_us * 1e-6)
    draft = dataclasses.replace(DSPARK, accepted=args.accept_length) if args.accept_length else DSPARK
    cmp = compare_seed(cfg, inv, device, context_len=args.context_len or AGENTX_CONTEXT, draft=draft)
    if args.json:
        from ..sharding.plan_compare import comparison_json

        print(json.dumps(comparison_json(cmp, device), indent=1))
    else:
        print_comparison(cmp, device)
    if args.png:
        try:
            plot_comparison(cmp, args.png)
        except ImportError:
            print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
            return 0
        print(f"plot: {args.png}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _plan_roofline(args, cfg, inv) -> int:
    import dataclasses

    from ..sharding.recipe import Recipe, RecipeError
    from ..sharding.roofline import TPU7X, candidate_recipes, recommend
    from ..sharding.plan_report import print_recommendation, print_roofline, roofline_rows

    device = dataclasses.replace(TPU7X, collective_latency_s=args.collective_us * 1e-6)
    concurrency = [int(x) for x in (args.concurrency or "1").split(",")]
    if args.recommend:
        recipes = candidate_recipes(cfg, args.recommend)
        if not recipes:
            print(f"error: no recipe over {args.recommend} devices fits this config", file=sys.stderr)
            return 2
        ranked = recommend(cfg, recipes, inv, context_len=args.context_len, concurrency=concurrency[0], device=device,
                           usable_fraction=args.usable_fraction, snapshots_per_request=args.snapshots_per_request)
        print_recommendation(ranked[: args.top], args.recommend, args.context_len, concurrency[0], args.json)
        return 0
    try:
        recipes = [Recipe.parse(t).validate(cfg) for t in args.recipe]
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_roofline(roofline_rows(cfg, recipes, inv, [args.context_len], concurrency, device), device, args.json)
    return 0


def add_cluster_flags(p) -> None:
    g = p.add_argument_group("multi-host (one process per host; docs/multihost.md)")
    g.add_argument("--coordinator", default=None,
                   help="HOST:PORT of JAX's coordination service (hosted by process 0, the leader)")
    g.add_argument("--num-processes", type=int, default=None, help="processes in the deployment")
    g.add_argument("--process-id", type=int, default=None, help="this process (0: the leader, serves gRPC)")
    g.add_argument("--distributed", choices=["auto"], default=None,
                   help="auto: let jax.distributed.initialize() find the slice (TPU VMs)")
    g.add_argument("--control-host", default=None,
                   help="address the leader's control channel binds and followers connect to "
                        "(default: the coordinator's host)")
    g.add_argument("--heartbeat-timeout", type=float, default=10.0,
                   help="seconds of silence after which the leader counts a follower as lost")


def add_pd_flags(p) -> None:
    g = p.add_argument_group("prefill/decode disaggregation through smg (docs/pd.md)")
    g.add_argument("--role", choices=["unified", "prefill", "decode"], default="unified",
                   help="prefill: compute prompts and hand their cache to a decode server; decode: continue "
                        "requests from a prefill's handoff (requests without disaggregated_params run unified)")
    g.add_argument("--bootstrap-port", type=int, default=8998,
                   help="prefill: the rendezvous port decode servers call (on --host; smg's default 8998)")
    g.add_argument("--transfer-host", default=None,
                   help="address this process's transfer server binds and announces to the other side (default: "
                        "--host; when that is a wildcard such as 0.0.0.0, this host's own address on the route to "
                        "the coordinator, or its hostname's)")
    g.add_argument("--pd-wait", type=float, default=30.0,
                   help="prefill: seconds a request waits for its decode server before failing")
    g.add_argument("--pd-transfer-timeout", type=float, default=60.0,
                   help="seconds a staged handoff waits to be pulled (prefill) / a pull may take (decode)")
    g.add_argument("--pd-handoff-memory-gb", type=float, default=4.0,
                   help="GiB of device memory for handoff arrays held at once outside the KV pools (prefill: "
                        "exports and staged pieces; decode: pulls and their assembled copies), set aside from "
                        "--kv-memory-gb; a handoff that does not fit waits, one larger than this is refused")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3serve", description="Kimi K3 inference server (JAX)")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="greedy-decode token ids with a checkpoint or the demo model")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", help="Hugging Face checkpoint directory (K3 or Kimi Linear)")
    src.add_argument("--demo", action="store_true", help="use the embedded demo checkpoint (default)")
    g.add_argument("text", nargs="?", help="prompt text (with --server; uses the server's tokenizer)")
    g.add_argument("--server", help="HOST:PORT of a running k3serve: stream from it instead of loading a model")
    g.add_argument("--ids", help="comma-separated prompt token ids (alias of --prompt-ids)")
    g.add_argument("--chat", action="store_true", help="with --server: render the text as a user chat turn")
    g.add_argument("--thinking", action="store_true", help="with --chat: open a think block")
    g.add_argument("--show-special", action="store_true", help="print control tokens")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--api-key", default=None)
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

    sv = sub.add_parser("serve", help="serve a checkpoint (default: the demo model) over gRPC")
    src = sv.add_mutually_exclusive_group()
    src.add_argument("--model", help="Hugging Face checkpoint directory")
    src.add_argument("--demo", action="store_true", help="serve the embedded demo checkpoint (default)")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=50051)
    sv.add_argument("--metrics-host", default="127.0.0.1")
    sv.add_argument("--metrics-port", type=int, default=9090, help="Prometheus port (-1: off, 0: any free port)")
    sv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    sv.add_argument("--dequantize-experts", action="store_true")
    sv.add_argument("--kernels", choices=["reference", "pallas", "pallas-interpret"], default=None,
                    help="kernel backend (default: pallas on TPU, reference elsewhere)")
    sv.add_argument("--max-num-seqs", type=int, default=4, help="rows per step (concurrent running requests)")
    sv.add_argument("--max-num-batched-tokens", type=int, default=256, help="token budget per step")
    sv.add_argument("--chunk-size", type=int, default=64, help="longest prefill chunk per row")
    sv.add_argument("--bucket-growth", type=int, default=8,
                    help="token buckets (one compiled program each): 1, the row count, that times powers "
                         "of this, the budget (default 8: 1, 4, 32, 256 at the defaults)")
    sv.add_argument("--page-size", type=int, default=16)
    sv.add_argument("--max-model-len", type=int, default=512)
    sv.add_argument("--kv-memory-gb", type=float, default=None, help="KV budget (KDA slots first, then pages)")
    sv.add_argument("--num-pages", type=int, default=None, help="KV budget as a page count")
    sv.add_argument("--sync", action="store_true", help="disable async scheduling")
    sv.add_argument("--max-n", type=int, default=8,
                    help="most samples one request may ask for (n): each runs as a request of its own, the "
                         "prompt computed once through the prefix cache")
    sv.add_argument("--recipe", default=None, help="parallelism recipe: preset or 'ep=8,tp=4,dcp=32,sp=4' "
                                                    "(default: one device)")
    sv.add_argument("--api-key", default=None,
                    help="require 'authorization: Bearer KEY' metadata; visible to other users of the machine "
                         "(ps): prefer --api-key-file or $K3SERVE_API_KEY")
    sv.add_argument("--api-key-file", default=None,
                    help="the API key from a file (default: $K3SERVE_API_KEY)")
    sv.add_argument("--admin-key-file", default=None,
                    help="the key SubscribeKvEvents needs (every tenant's cached token ids: give it to the router "
                         "only); default: $K3SERVE_ADMIN_KEY. With an API key and no admin key it is refused")
    sv.add_argument("--cluster-secret-file", default=None,
                    help="the deployment's shared secret (the P/D bootstrap service, the multi-host control "
                         "channel); default: $K3SERVE_CLUSTER_SECRET. Never on the command line")
    sv.add_argument("--tls-cert", default=None)
    sv.add_argument("--tls-key", default=None)
    sv.add_argument("--max-message-mb", type=int, default=16, help="largest gRPC message accepted")
    sv.add_argument("--max-concurrent-rpcs", type=int, default=1024,
                    help="open RPCs (streams) served at once; more get RESOURCE_EXHAUSTED")
    sv.add_argument("--grace-period", type=float, default=30.0, help="seconds in-flight requests get at shutdown")
    sv.add_argument("--served-model-name", default=None)
    add_prefix_flags(sv)
    add_spec_flags(sv)
    add_cluster_flags(sv)
    add_pd_flags(sv)
    sv.set_defaults(func=cmd_serve)

    pl = sub.add_parser("plan", help="memory per device and max concurrency for parallelism recipes")
    pl.add_argument("--model", help="checkpoint dir (its config.json); default: the full K3 release config")
    pl.add_argument("--recipe", action="append", default=None,
                    help="preset or 'ep=8,tp=4,dcp=32,sp=4' (repeat to compare); default: TP-only, DCP32, DP2xDCP16")
    pl.add_argument("--context-len", type=int, default=None,
                    help="tokens per request (default 131072; 65536 with --compare-seed)")
    pl.add_argument("--hbm-gb", type=float, default=101.74,
                    help="HBM per device in GB (TPU v7: a TensorCore, 94.75 GiB = 101.74 GB as libtpu counts it)")
    pl.add_argument("--usable-fraction", type=float, default=0.9)
    pl.add_argument("--snapshots-per-request", type=float, default=2.0,
                    help="prefix-cache KDA snapshot slots per request (serve's default 2 x max-num-seqs "
                         "slots: 2; 0 with --no-prefix-caching)")
    pl.add_argument("--concurrency", default=None,
                    help="decode roofline at these concurrencies (e.g. 1,8,72) instead of the memory plan")
    pl.add_argument("--recommend", type=int, default=None, metavar="DEVICES",
                    help="rank every recipe over DEVICES chips for --context-len and --concurrency")
    pl.add_argument("--top", type=int, default=10, help="with --recommend: how many to print")
    pl.add_argument("--collective-us", type=float, default=5.0, help="latency of one collective (roofline)")
    pl.add_argument("--compare-seed", action="store_true",
                    help="the seed's decode recipes at concurrency 1-72, with and without DSpark, against the "
                         "published K3 figures (docs/choosing-a-recipe.md)")
    pl.add_argument("--accept-length", type=float, default=None,
                    help="with --compare-seed: tokens DSpark emits per request and step (default 2.68)")
    pl.add_argument("--png", default="plan-compare-seed.png",
                    help="with --compare-seed: where to draw the plot ('' for none)")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)

    ps = sub.add_parser("preshard", help="safetensors -> Orbax laid out for a recipe; 'preshard verify DST'",
                        add_help=False)  # main() hands its arguments to server/cli_preshard.py
    ps.add_argument("rest", nargs=argparse.REMAINDER)

    sub.add_parser("compile", help="compile serve's programs for a TPU topology on this host (libtpu, no TPU, "
                                   "no weights): per program memory, cost, collectives; fits or not",
                   add_help=False).add_argument("rest", nargs=argparse.REMAINDER)

    b = sub.add_parser("bench", help="benchmarks: trace replay over gRPC, or 'offline' engine throughput",
                       description="k3serve bench --server HOST:PORT --trace trace.jsonl [--concurrency N] ... | "
                                   "k3serve bench offline [--model DIR|demo] [--concurrency 1,8,32] "
                                   "[--modes async,sync] [--peer-python PY] ...", add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the benchmark (--help for its flags)")
    b.set_defaults(func=cmd_bench)
    return p


BENCH_USAGE = """usage: k3serve bench --server HOST:PORT --trace T.jsonl [--concurrency N] [--block-size 512] ...
       k3serve bench offline [--model DIR|demo] [--concurrency 1,8,32] [--modes async,sync] ...
       k3serve bench prefix [--model DIR|demo] [--sessions 8] [--max-num-seqs 4] ...
       k3serve bench loop [--model DIR] [--streams 8] [--probes 20]   (submit/abort latency in steps)
       k3serve bench spec [--model DIR|demo] [--concurrency 1,8] [--k 4] [--rates 0,0.5,0.8,1]
       k3serve bench host [--model DIR|demo] [--contexts 1024,16384] [--rows 4] [--penalties] [--stop] ...
       k3serve bench step [--model DIR|demo] [--rows 1,8,32] [--context 128]   (decode step time, roofline)
       k3serve bench pd [--model DIR|demo] [--sessions 8] ...   (P/D pair vs unified, same trace)
       k3serve bench warmup [--layers 13,49]   (cold warm-up of serve's defaults, demo models by depth)
(each accepts --help for its flags)"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "preshard":  # SRC DST ... | verify DST ...: its own parser
        from .cli_preshard import main as preshard_main

        return preshard_main(argv[1:])
    if argv and argv[0] == "compile":  # its own parser (serve's engine flags)
        from .cli_compile import main as compile_main

        return compile_main(argv[1:])
    if argv and argv[0] == "bench":
        # the benchmarks parse their own flags (argparse's REMAINDER stops at a leading --flag)
        rest = argv[1:]
        if not rest or rest[0] in ("-h", "--help"):
            print(BENCH_USAGE)
            return 0
        return cmd_bench(argparse.Namespace(rest=rest))
    args = build_parser().parse_args(argv)
    if getattr(args, "func", None) is cmd_plan and not args.recipe:
        args.recipe = ["ep=8,tp=4", "v7-32-decode", "v7-32-decode-dp2"]
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
