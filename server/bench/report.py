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
        from ...checkpoints.synthetic import demo_checkpoint

        return pathlib.Path(demo_checkpoint())
    return pathlib.Path(name)
