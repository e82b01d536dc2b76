"""The collectives of an engine's compiled step programs under a recipe: per program, count
and bytes by kind, and any all-gather of a whole weight or cache array
(``k3serve.sharding.collectives``). Counts are of the program text: a collective inside the
layer scan is listed once.

    PYTHONPATH=.. python tools/step_collectives.py --recipe ep=8,tp=1,dp=2,dcp=4 [--devices 8]
        [--model DIR|demo] [--max-num-batched-tokens 16] [--list]
"""
from __future__ import annotations

import argparse
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16)
    ap.add_argument("--list", action="store_true", help="every all-gather and all-to-all, with its source op")
    a = ap.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={a.devices}"

    from k3serve import LLM
    from k3serve.demo import demo_checkpoint
    from k3serve.sharding.collectives import collectives, runner_arrays, summary, whole_array_gathers

    path = str(demo_checkpoint()) if a.model == "demo" else a.model
    llm = LLM(path, recipe=a.recipe, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
              max_model_len=128)
    runner = llm.engine.runner
    arrays = runner_arrays(runner)  # whole weights and cache arrays
    print(f"{path}, recipe {a.recipe}, {a.devices} devices")
    print(f"{'program':<12}" + "".join(f"{k:>26}" for k in ("all-gather", "all-to-all", "all-reduce",
                                                             "collective-permute")))
    whole = []
    for T, exe in sorted(runner._compiled.items()):
        colls = collectives(exe.as_text())
        s = summary(colls)
        print(f"step T={T:<5}" + "".join(f"{s.get(k, (0, 0))[0]:>5} x, {s.get(k, (0, 0))[1]:>10,} B     "
                                         for k in ("all-gather", "all-to-all", "all-reduce", "collective-permute")))
        whole += [(T, n, c) for n, c in whole_array_gathers(colls, arrays)]
        if a.list:
            for c in colls:
                if c.kind in ("all-gather", "all-to-all"):
                    print(f"    {c.kind:<11} {c.nbytes:>9,} B {c.shapes[0][0]}{list(c.shapes[0][1])} "
                          f"x{len(c.shapes)}  {c.op_name[-70:]}")
    print("whole weights or cache arrays gathered:", "none" if not whole else "")
    for T, n, c in whole:
        print(f"    step T={T}: {n} ({c.nbytes:,} B) from {c.op_name[-70:]}")
    return 1 if whole else 0


if __name__ == "__main__":
    sys.exit(main())
