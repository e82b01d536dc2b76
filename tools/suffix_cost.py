"""Memory and time per token of the suffix drafter's tree (``server/spec/suffix.py``).

    python tools/suffix_cost.py [--tokens 100000] [--vocab 163840] [--max-depth 24] [--oracle]

Builds a ``SuffixDrafter`` over one request whose prompt is ``--tokens`` uniformly random
token ids (text that never repeats beyond chance: the worst case for the tree's size), as
``SuffixEngineDrafter`` does on a request's first proposal, then asks for a proposal. Prints
the seconds to index the prompt (one run without tracemalloc), the bytes the drafter holds
afterwards (tracemalloc, a second run; the prompt list itself is allocated before and not
counted), both per prompt token, and the tree's stored and trie node counts.
``--oracle`` measures the plain trie the tree replaced instead
(``tests/_suffix_trie_oracle.py``, kept as the tests' oracle): about 7 KB per token, so
keep ``--tokens`` near 10,000 there. ``--repeat-every P`` makes the prompt repeat a random
block of ``P`` tokens instead (highly repetitive text).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import pathlib
import random
import sys
import time
import tracemalloc

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _drafter_class(oracle: bool):
    if oracle:
        spec = importlib.util.spec_from_file_location("_suffix_trie_oracle", ROOT / "tests" / "_suffix_trie_oracle.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses resolve the module by name
        spec.loader.exec_module(module)
        return module.SuffixDrafter
    sys.path.insert(0, str(ROOT.parent))
    from k3serve.server.spec.suffix import SuffixDrafter

    return SuffixDrafter


def _build(cls, prompt, max_depth):
    drafter = cls(max_depth=max_depth, max_tokens=4)
    drafter.start("r", "t", prompt)
    drafter.propose("r")
    return drafter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--vocab", type=int, default=163_840)
    p.add_argument("--max-depth", type=int, default=24)
    p.add_argument("--repeat-every", type=int, default=0)
    p.add_argument("--oracle", action="store_true", help="measure the old plain trie instead")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cls = _drafter_class(args.oracle)
    rng = random.Random(args.seed)
    n = args.tokens
    if args.repeat_every:
        block = [rng.randrange(args.vocab) for _ in range(args.repeat_every)]
        prompt = (block * (n // len(block) + 1))[:n]
    else:
        prompt = [rng.randrange(args.vocab) for _ in range(n)]

    t0 = time.perf_counter()
    drafter = _build(cls, prompt, args.max_depth)
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(1000):
        drafter.propose("r")
    propose_us = (time.perf_counter() - t0) * 1e3
    tree = drafter._requests["r"].tree
    stored = getattr(tree, "num_stored_nodes", None)
    trie_nodes = tree.num_nodes
    del drafter, tree
    gc.collect()

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    drafter = _build(cls, prompt, args.max_depth)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()

    name = "oracle trie" if args.oracle else "path-compressed tree"
    print(f"{name}: {n} tokens (vocab {args.vocab}, max_depth {args.max_depth}"
          f"{f', repeating every {args.repeat_every}' if args.repeat_every else ''})")
    print(f"  index: {seconds:.3f} s = {seconds / n * 1e6:.2f} us/token")
    print(f"  held:  {held / 2**20:.1f} MiB = {held / n:.0f} bytes/token")
    print(f"  nodes: {stored if stored is not None else trie_nodes} stored, {trie_nodes} trie nodes")
    print(f"  propose: {propose_us:.1f} us")


if __name__ == "__main__":
    main()
