"""Lower and compile step programs of an engine and count the fusions of the compiled HLO: how
big each step program is and how long XLA takes for it.

    PYTHONPATH=<dir holding k3serve> python tools/count_step_kernels.py [--model DIR] [--tokens 1,32]

Without ``--model`` it uses the embedded demo checkpoint at serve's engine defaults. Run it
against another commit from a worktree (``PYTHONPATH``) to compare programs side by side.
"""
from __future__ import annotations

import argparse
import re
import time


def main() -> None:
    from k3serve.demo import model_or_demo
    from k3serve.checkpoints import load_pretrained
    from k3serve.server.engine.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the demo)")
    ap.add_argument("--tokens", default="1,32", help="comma-separated token buckets to compile")
    a = ap.parse_args()
    runner = Engine(load_pretrained(model_or_demo(a.model)), warmup=False).runner
    for T in (int(x) for x in a.tokens.split(",")):
        t0 = time.perf_counter()
        lowered = runner._jit(T).lower(runner.model.params, runner.cache_mgr.device_cache, *runner._padding_args(T))
        t1 = time.perf_counter()
        text = lowered.compile().as_text()
        t2 = time.perf_counter()
        fusions = len(re.findall(r"^\s*(?:ROOT\s+)?%?\S+ = \S+ fusion\(", text, re.M))
        print(f"T={T}: lower {t1 - t0:.2f} s, compile {t2 - t1:.2f} s, {fusions} fusions, "
              f"{len(text)} characters of compiled HLO")


if __name__ == "__main__":
    main()
