"""From ``k3serve serve``'s flags to an engine: the prefix-cache flags and their engine
keywords, the P/D handoff bound, and ``build_engine`` (every process of a deployment builds
the same engine from the same flags: the leader in ``serve.py``, a follower in
``multihost.py``). The CLI only declares the flags (docs/layout.md: the API floor never imports the CLI).
"""
from __future__ import annotations

import time


def add_prefix_flags(p) -> None:
    g = p.add_argument_group("prefix caching (on by default)")
    g.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt from scratch")
    g.add_argument("--prefix-unit", type=int, default=None,
                   help="prefix-match unit in tokens (divides the page size; default min(16, page/2))")
    g.add_argument("--prefix-interval", type=int, default=0,
                   help="also snapshot the KDA state every N tokens (multiple of the unit; 0 = off)")
    g.add_argument("--no-prefix-second-hit", action="store_true",
                   help="do not register a branch point the second time it is seen")
    g.add_argument("--no-prefix-output-end", action="store_true",
                   help="do not register the state at the end of each request's output")
    g.add_argument("--prefix-snapshots", type=int, default=None,
                   help="device KDA snapshot slots (default 2 x max-num-seqs; paid before pages)")
    g.add_argument("--prefix-cache-gb", type=float, default=None,
                   help="byte budget of cached pages + snapshots (default: what the pool and slots hold)")
    g.add_argument("--prefix-host-gb", type=float, default=1.0,
                   help="host-DRAM tier for evicted prefixes (pages + state), 0 = off (default 1)")


def prefix_kwargs(args) -> dict:
    """Engine keyword arguments of the prefix-cache flags (``add_prefix_flags``)."""
    return dict(enable_prefix_caching=not args.no_prefix_caching, prefix_unit=args.prefix_unit,
                prefix_interval=args.prefix_interval, prefix_second_hit=not args.no_prefix_second_hit,
                prefix_output_end=not args.no_prefix_output_end, prefix_snapshots=args.prefix_snapshots,
                prefix_cache_bytes=int(args.prefix_cache_gb * (1 << 30)) if args.prefix_cache_gb else None,
                prefix_host_bytes=int(args.prefix_host_gb * (1 << 30)))


def add_spec_flags(p) -> None:
    g = p.add_argument_group("speculative decoding (off by default; docs/speculative.md)")
    g.add_argument("--speculative", choices=("ngram", "suffix", "dspark"), default=None,
                   help="draft with prompt lookup (ngram), suffix decoding (suffix) or a DSpark draft model "
                        "(dspark, with --draft-model); greedy and seeded outputs are exactly those without "
                        "speculation")
    g.add_argument("--draft-model", default=None, metavar="DIR",
                   help="the DSpark draft checkpoint (config.json + safetensors) for --speculative dspark; "
                        "k3serve compile reads only its config.json, or takes 'k3' for the released draft's shapes")
    g.add_argument("--num-speculative-tokens", type=int, default=4, help="most drafts a decode row carries (k)")
    g.add_argument("--speculative-max-rows", type=int, default=None,
                   help="no drafts in a step while more requests than this run (default: always draft)")


def spec_kwargs(args) -> dict:
    """Engine keyword arguments of the speculative flags (``add_spec_flags``)."""
    method = getattr(args, "speculative", None)
    draft_dir = getattr(args, "draft_model", None)
    if not method:
        if draft_dir:
            raise SystemExit("--draft-model needs --speculative dspark")
        return {}
    spec = {"method": method, "num_speculative_tokens": args.num_speculative_tokens,
            "max_rows": args.speculative_max_rows}
    if method == "dspark":
        if not draft_dir:
            raise SystemExit("--speculative dspark needs --draft-model DIR")
        spec["draft_model"] = draft_dir
    elif draft_dir:
        raise SystemExit(f"--draft-model is for --speculative dspark, not {method}")
    return dict(speculative=spec)


def pd_handoff_bytes(args) -> int:
    """``--pd-handoff-memory-gb`` in bytes on a P/D server (0 on a unified one)."""
    if getattr(args, "role", "unified") == "unified":
        return 0
    return int(getattr(args, "pd_handoff_memory_gb", 0) * (1 << 30))


def build_engine(args, path, dispatch=None):
    """The engine ``k3serve serve``'s flags describe (every process of a deployment builds
    the same one; ``dispatch``: the leader's, which replays device calls on the followers)."""
    from ...checkpoints import load_pretrained
    from ..engine.engine import Engine
    from ..engine.llm import recipe_placement

    # with a recipe: mesh first, then every parameter loaded straight into its shards
    t = time.perf_counter()
    m = load_pretrained(path, dtype=args.dtype, dequantize_experts=args.dequantize_experts,
                        placement=recipe_placement(path, args.recipe), kernels=getattr(args, "kernels", None))
    st = m.load_stats
    print(f"k3serve: loaded {path.name} in {time.perf_counter() - t:.1f}s: read {st['bytes_read']} of "
          f"{st['checkpoint_bytes']} checkpoint bytes ({100 * st['bytes_read'] / max(1, st['checkpoint_bytes']):.0f}%), "
          f"peak RSS {_peak_rss_mib():.0f} MiB", flush=True)
    detok = None
    tok = None
    try:
        from ..text.tokenizer import load_tokenizer

        tok = load_tokenizer(path)
        if tok is not None:
            detok = lambda: tok.detokenizer(keep_text=False)  # stop strings: one per request
    except ImportError:
        pass
    kv = dict(kv_memory_bytes=int(args.kv_memory_gb * (1 << 30))) if args.kv_memory_gb else (
        dict(num_pages=args.num_pages) if args.num_pages else {})
    eng = Engine(m, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                 chunk_size=args.chunk_size, page_size=args.page_size, max_model_len=args.max_model_len,
                 bucket_growth=args.bucket_growth,
                 detokenizer=detok, tokenizer=tok, async_scheduling=not args.sync, recipe=args.recipe,
                 max_n=getattr(args, "max_n", 8),
                 dispatch=dispatch, pd_handoff_bytes=pd_handoff_bytes(args), pd_role=getattr(args, "role", None),
                 **prefix_kwargs(args), **spec_kwargs(args), **kv)
    if eng.pd_role is not None and eng.cache_mgr.spans_processes:  # every process of a multi-host P/D side
        import jax
        from jax._src import distributed

        from ..engine.cache.handoff_plane import HandoffPlane
        from ..pd.transfer import TransferEndpoint, transfer_host

        coordinator = (distributed.global_state.coordinator_address or "").rsplit(":", 1)[0] or None
        host = transfer_host(args.host, getattr(args, "transfer_host", None), toward=coordinator)
        eng.handoff_plane = HandoffPlane(eng.cache_mgr, eng.dispatch,
                                         TransferEndpoint(host, device=jax.local_devices()[0]))
    return eng


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
