"""How every in-process benchmark hands over its result: indented JSON on stdout, and the same
JSON in a file when ``--json PATH`` was given."""
from __future__ import annotations

import json
import pathlib


def emit(report: dict, json_path: str | None = None) -> int:
    text = json.dumps(report, indent=1)
    print(text)
    if json_path:
        pathlib.Path(json_path).write_text(text)
    return 0


def model_dir(name: str) -> pathlib.Path:
    """A benchmark's ``--model``: a checkpoint directory, or ``demo`` (the embedded demo model)."""
    if name == "demo":
        from ...demo import demo_checkpoint

        return pathlib.Path(demo_checkpoint())
    return pathlib.Path(name)


def add_trace_flags(ap) -> None:
    """The flags ``bench prefix`` and ``bench pd`` share: the checkpoint, the synthetic agentic
    trace and the serve-like engine settings."""
    ap.add_argument("--model", default="demo", help="checkpoint dir, or 'demo'")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=16, help="trace tokens per hash block")
    ap.add_argument("--time-scale", type=float, default=1.0, help="trace time multiplier (0.5 = twice as fast)")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
