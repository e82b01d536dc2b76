"""Speculative decoding, side by side in one run: ``k3serve bench spec``.

    k3serve bench spec [--model DIR|demo] [--concurrency 1,8] [--k 4] [--rates 0,0.5,0.8,1]
        [--prompt-len 32] [--gen-len 48] [--draft-model DIR|synthetic] [--no-async] [--json OUT]

Four parts, every figure a ratio to plain decoding measured in the same process:

1. **The cost curve under an imposed acceptance rate.** A plain greedy run records each
   prompt's output; an imposing drafter (bench code, never a serving option) then proposes
   ``k`` tokens of that output with each token wrong with probability ``1 - rate`` (draws from
   a fixed seed), so a row accepts ``j`` drafts with the chance a real drafter of that rate
   would give. Per concurrency and rate: tokens/s per user, emitted tokens per verified row,
   and the speedup over plain decoding; beside it the planner's prediction for the v7 decode
   recipe (``sharding.roofline.step_cost`` with ``k + 1`` tokens a row and the same expected
   emitted tokens, full K3 at 128K context).
2. **The weight-free drafters on a replay workload.** Each prompt is sent twice, the second
   time after the first finished, in one tenant: suffix decoding finds the first answer in its
   tenant trie; prompt lookup finds what repeats inside the request. With random weights a
   model neither copies its prompt nor says anything twice on its own, so natural acceptance
   here measures the replay only; claims rest on part 1.
3. **DSpark** (``--draft-model DIR``, or ``synthetic``: a small random draft fitted to the
   model, ``checkpoints.dspark_checkpoint.dspark_config_for``): the same prompts, first turn,
   against plain decoding just before. With random weights (the demo model, a synthetic
   draft) nothing is accepted, so this row measures what drafting costs a step (the taps, the
   context rows, the block's forward, the speculative program), not what it gains.
4. **Async scheduling** (skipped with ``--no-async``): plain and imposed-rate speculation,
   synchronous and async, back to back on the same prompts, with how many of the async
   rows' guesses of their in-flight predecessor's outcome held.

Every speculative run's tokens are checked equal to plain decoding's (greedy).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from .report import emit, model_dir as resolve_model


class ImposedDrafter:
    """Proposes the known output with each draft wrong with probability ``1 - rate``."""

    def __init__(self, truth: dict, vocab: int, rate: float = 1.0, seed: int = 0):
        self.truth, self.vocab, self.rate = truth, vocab, rate
        self.rng = np.random.default_rng(seed)

    def propose(self, req, max_tokens, after=()):
        seq = self.truth.get(tuple(req.prompt), [])
        at = len(req.output) + len(after)
        out = list(seq[at:at + max_tokens])
        wrong = self.rng.random(len(out)) >= self.rate
        return [(t + 1) % self.vocab if w else t for t, w in zip(out, wrong)]

    def finish(self, req, keep=True):
        pass


def _engine(m, conc, prompt_len, gen_len, async_scheduling=False, **kw):
    from k3serve.server.engine.engine import Engine

    k = (kw.get("speculative") or {}).get("num_speculative_tokens", 0)
    c = max(conc)
    return Engine(m, max_num_seqs=c, max_num_batched_tokens=max(256, c * (k + 1)), page_size=16,
                  max_model_len=prompt_len + gen_len + 16, async_scheduling=async_scheduling, **kw)


def _run(eng, prompts, params, salt=None):
    """Submit at once, run to completion: (outputs in order, wall s, draft tokens, accepted, verified rows)."""
    st0 = eng.stats()
    eng.flush_prefix_cache()
    t = time.perf_counter()
    rids = [eng.add_request(p, params, cache_salt=salt) for p in prompts]
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                out[o.rid] = o.token_ids
    wall = time.perf_counter() - t
    st = eng.stats()
    rows = sum(st["spec_accept_counts"]) - sum(st0["spec_accept_counts"])
    return ([out[r] for r in rids], wall, st["spec_draft_tokens"] - st0["spec_draft_tokens"],
            st["spec_accepted_tokens"] - st0["spec_accepted_tokens"], rows)


def planner_curve(k: int, rates, conc, context_len: int = 131072, recipe: str = "v7-32-decode") -> dict:
    """The planner's speedup of ``k`` weight-free drafts at each acceptance rate (full K3)."""
    from k3serve.model.config import k3_full
    from k3serve.sharding.memory import param_inventory
    from k3serve.sharding.recipe import Recipe
    from k3serve.sharding.roofline import step_cost

    cfg = k3_full()
    r = Recipe.parse(recipe)
    inv = param_inventory(cfg)
    out = {}
    for c in conc:
        base = step_cost(cfg, r, inv, context_len=context_len, concurrency=c)
        for rate in rates:
            emitted = sum(rate ** j for j in range(k + 1))  # E[accepted + 1], drafts wrong independently
            s = step_cost(cfg, r, inv, context_len=context_len, concurrency=c, tokens_per_step=k + 1,
                          accepted=emitted)
            out[f"c{c}_rate{rate}"] = {"speedup": round(s.tok_s_per_user / base.tok_s_per_user, 2),
                                       "step_ms": round(s.step_s * 1e3, 2), "plain_step_ms": round(base.step_s * 1e3, 2),
                                       "tok_s_per_user": round(s.tok_s_per_user, 1)}
    return out


def _async_rows(m, a, conc, rates, prompts, params, plain, spec, imposed) -> list:
    """Part 4: async scheduling against synchronous, plain and speculative (imposed rates), each
    run just after the others on the same prompts. Async speculation plans a row while its
    request's previous verify row runs: its drafts are proposed after a guess of that row's
    outcome (all drafts accepted, then the drafter's next token) and dropped when the guess
    fails, so it verifies fewer drafts than synchronous speculation at the same rate."""
    plain_a = _engine(m, conc, a.prompt_len, a.gen_len, async_scheduling=True)
    spec_a = _engine(m, conc, a.prompt_len, a.gen_len, async_scheduling=True,
                     speculative={"num_speculative_tokens": a.k}, drafter=imposed)
    out = []
    for c in conc:
        res = {"concurrency": c, "rates": {}}
        walls = {}
        for name, eng in (("plain_sync", plain), ("plain_async", plain_a)):
            _run(eng, prompts[c], params)  # untimed: first-run allocations
            truth, walls[name], *_ = _run(eng, prompts[c], params)
        imposed.truth = {tuple(p): o for p, o in zip(prompts[c], truth)}
        res.update({f"{k}_tok_s_per_user": round(a.gen_len / w, 1) for k, w in walls.items()})
        for rate in rates:
            cell = {}
            for name, eng in (("sync", spec), ("async", spec_a)):
                imposed.rate, imposed.rng = rate, np.random.default_rng(1)
                _run(eng, prompts[c], params)  # untimed
                imposed.rng = np.random.default_rng(1)
                g0, r0 = eng.stats()["spec_guess_rows"], eng.stats()["spec_guess_held"]
                got, wall, drafts, acc, rows = _run(eng, prompts[c], params)
                assert got == truth, "speculative tokens differ from plain decoding"
                st = eng.stats()
                cell[name] = {"tok_s_per_user": round(a.gen_len / wall, 1),
                              "speedup_vs_plain_sync": round(walls["plain_sync"] / wall, 2),
                              "emitted_per_row": round(1 + acc / max(1, rows), 2),
                              "guesses_held": f"{st['spec_guess_held'] - r0}/{st['spec_guess_rows'] - g0}"}
            res["rates"][str(rate)] = cell
        out.append(res)
    return out


def _dspark_rows(m, a, conc, prompts, params, plain) -> list:
    """Part 3: DSpark against plain decoding, per concurrency."""
    import tempfile

    draft_dir = a.draft_model
    if draft_dir == "synthetic":
        from k3serve.checkpoints.dspark_checkpoint import dspark_config_for, generate_dspark_checkpoint

        draft_dir = str(generate_dspark_checkpoint(tempfile.mkdtemp(prefix="k3-dspark-"),
                                                   dspark_config_for(m.config, block_size=a.k)))
    eng = _engine(m, conc, a.prompt_len, a.gen_len,
                  speculative={"method": "dspark", "num_speculative_tokens": a.k, "draft_model": draft_dir})
    rows_out = []
    for c in conc:
        _run(eng, prompts[c], params)  # untimed: first-run allocations
        _run(plain, prompts[c], params)
        ref, pwall, *_ = _run(plain, prompts[c], params)
        got, wall, drafts, acc, rows = _run(eng, prompts[c], params)
        assert got == ref, "speculative tokens differ from plain decoding"
        rows_out.append({"concurrency": c, "speedup": round(pwall / wall, 2), "tok_s_per_user": round(a.gen_len / wall, 1),
                         "plain_tok_s_per_user": round(a.gen_len / pwall, 1),
                         "emitted_per_row": round(1 + acc / max(1, rows), 2),
                         "accept_rate": round(acc / max(1, drafts), 3), "drafts": drafts,
                         "draft_model": a.draft_model})
    return rows_out


def main(argv=None) -> int:
    from k3serve.checkpoints import load_pretrained
    from k3serve.server.engine.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo", help="checkpoint dir, or 'demo'")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--k", type=int, default=4, help="drafts per row")
    ap.add_argument("--rates", default="0,0.5,0.8,1", help="imposed per-draft acceptance rates")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=48)
    ap.add_argument("--no-planner", action="store_true", help="skip the planner's K3 prediction")
    ap.add_argument("--draft-model", default=None,
                    help="a DSpark draft checkpoint dir, or 'synthetic' (a random draft fitted to the model)")
    ap.add_argument("--no-async", action="store_true",
                    help="skip the async-scheduling part (async vs synchronous, plain and speculative)")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    conc = [int(c) for c in a.concurrency.split(",")]
    rates = [float(r) for r in a.rates.split(",")]
    model_dir = resolve_model(a.model)
    m = load_pretrained(model_dir)
    V = m.config.vocab_size
    params = SamplingParams(max_new_tokens=a.gen_len, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    prompts = {c: [rng.integers(2, min(V, 4000), a.prompt_len).tolist() for _ in range(c)] for c in conc}
    report = {"model": str(model_dir), "k": a.k, "prompt_len": a.prompt_len, "gen_len": a.gen_len, "imposed": [],
              "drafters": []}
    plain = _engine(m, conc, a.prompt_len, a.gen_len)
    imposed = ImposedDrafter({}, V)
    spec = _engine(m, conc, a.prompt_len, a.gen_len, speculative={"num_speculative_tokens": a.k}, drafter=imposed)
    for c in conc:
        _run(plain, prompts[c], params)  # untimed: first-run allocations
        truth, wall, *_ = _run(plain, prompts[c], params)
        base = a.gen_len / wall
        imposed.truth = {tuple(p): o for p, o in zip(prompts[c], truth)}
        row = {"concurrency": c, "plain_tok_s_per_user": round(base, 1), "rates": {}}
        for rate in rates:
            imposed.rate, imposed.rng = rate, np.random.default_rng(1)
            _run(spec, prompts[c], params)  # untimed
            imposed.rng = np.random.default_rng(1)
            got, wall, drafts, acc, rows = _run(spec, prompts[c], params)
            assert got == truth, "speculative tokens differ from plain decoding"
            row["rates"][str(rate)] = {"tok_s_per_user": round(a.gen_len / wall, 1),
                                       "speedup": round(a.gen_len / wall / base, 2),
                                       "emitted_per_row": round(1 + acc / max(1, rows), 2),
                                       "accept_rate": round(acc / max(1, drafts), 3)}
        report["imposed"].append(row)
    for method in ("ngram", "suffix"):
        eng = _engine(m, conc, a.prompt_len, a.gen_len,
                      speculative={"method": method, "num_speculative_tokens": a.k})
        for c in conc:
            truth = None
            res = {"method": method, "concurrency": c}
            for turn in ("first", "replay"):
                _run(plain, prompts[c], params)  # plain, just before, for the ratio
                ref, pwall, *_ = _run(plain, prompts[c], params)
                got, wall, drafts, acc, rows = _run(eng, prompts[c], params, salt="bench")
                assert got == ref, "speculative tokens differ from plain decoding"
                truth = truth or ref
                res[turn] = {"speedup": round(pwall / wall, 2), "tok_s_per_user": round(a.gen_len / wall, 1),
                             "emitted_per_row": round(1 + acc / max(1, rows), 2),
                             "accept_rate": round(acc / max(1, drafts), 3), "drafts": drafts}
            report["drafters"].append(res)
    if not a.no_async:
        report["async"] = _async_rows(m, a, conc, rates, prompts, params, plain, spec, imposed)
    if a.draft_model:
        report["dspark"] = _dspark_rows(m, a, conc, prompts, params, plain)
    if not a.no_planner:
        report["planner_v7_32_decode"] = planner_curve(a.k, rates, conc)
    return emit(report, a.json)


if __name__ == "__main__":
    sys.exit(main())
