"""``k3serve plan --compare-seed``: the roofline of the seed's two decode recipes at
concurrency 1–72, with and without the DSpark drafter, next to the figures published for K3 on
a 32-device (16-chip) TPU v7 slice (docs/choosing-a-recipe.md, "Against the published figures").

Published figures (quoted in issue #18; the seed's full AgentX table is not in this repository):

* the seed's AgentX run: 408 tok/s per user at concurrency 1, 210,159 tok/s in total at 72.
  AgentX replays agentic (Claude Code) traces and counts the input tokens in its throughput,
  and the seed's recipes run DSpark. A per-user decode rate is output tokens; the total is
  not, so it is compared through the input:output ratio it implies.
* tpu-inference: 18.35 tok/s per user at concurrency 8, 8K prompt and 1K output, tpu7x-32,
  no speculation.
"""
from __future__ import annotations

import dataclasses

SEED_RECIPES = ("v7-32-decode", "v7-32-decode-dp2")
CONCURRENCY = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72)
AGENTX_CONTEXT = 65536  # tokens in context while decoding (an assumption: agentic contexts run to tens of thousands)
SEED_PER_USER_AT_1 = 408.0  # tok/s/user, with DSpark
SEED_TOTAL_AT_72 = 210159.0  # tok/s, input and output tokens, with DSpark
RATIO_BAND = (10, 100)  # input tokens per output token drawn for the seed's total (agentic: long in, short out)
TPU_INFERENCE = {"concurrency": 8, "context": 9216, "tok_s_per_user": 18.35}  # 8K/1K, no speculation


@dataclasses.dataclass
class Comparison:
    context: int
    draft: object
    curves: dict  # (recipe, speculative) -> [(concurrency, tok/s/user, tok/s total, bound)]
    crossover: dict  # speculative -> lowest concurrency at which the DP2 recipe is ahead, or None
    at_1: dict  # speculative -> best tok/s/user at concurrency 1
    at_72: dict  # speculative -> best output tok/s at concurrency 72
    tpu_inference_ceiling: float  # tok/s/user of the best seed recipe at tpu-inference's shape
    waits_at_1: tuple = (0, 0.0, 0.0)  # the first recipe's speculative step at 1: (collectives, their latency, step) s

    def implied_input_per_output(self, speculative: bool = True) -> float:
        """The input:output ratio at which the seed's total at 72 is this roofline's output rate:
        the least it can be (a system below the ceiling implies a larger one)."""
        return SEED_TOTAL_AT_72 / self.at_72[speculative] - 1.0


def compare_seed(cfg, inventory, device, *, context_len: int = AGENTX_CONTEXT, draft=None,
                 concurrency=CONCURRENCY) -> Comparison:
    from .recipe import PRESETS
    from .roofline import DSPARK, step_cost

    draft = draft or DSPARK
    curves = {}
    for name in SEED_RECIPES:
        for spec in (False, True):
            pts = []
            for b in concurrency:
                c = step_cost(cfg, PRESETS[name], inventory, context_len=context_len, concurrency=b, device=device,
                              draft=draft if spec else None)
                pts.append((b, c.tok_s_per_user, c.tok_s_total, c.bound))
            curves[(name, spec)] = pts
    crossover, at_1, at_72 = {}, {}, {}
    for spec in (False, True):
        low, high = curves[(SEED_RECIPES[0], spec)], curves[(SEED_RECIPES[1], spec)]
        crossover[spec] = next((a[0] for a, b in zip(low, high) if b[2] > a[2]), None)
        best = lambda b: max(step_cost(cfg, PRESETS[n], inventory, context_len=context_len, concurrency=b,  # noqa: E731
                                       device=device, draft=draft if spec else None).tok_s_total for n in SEED_RECIPES)
        at_1[spec], at_72[spec] = best(1), best(72)
    ti = TPU_INFERENCE
    ceiling = max(step_cost(cfg, PRESETS[n], inventory, context_len=ti["context"], concurrency=ti["concurrency"],
                            device=device).tok_s_per_user for n in SEED_RECIPES)
    c1 = step_cost(cfg, PRESETS[SEED_RECIPES[0]], inventory, context_len=context_len, concurrency=1, device=device,
                   draft=draft)
    return Comparison(context=context_len, draft=draft, curves=curves, crossover=crossover, at_1=at_1,
                      at_72=at_72, tpu_inference_ceiling=ceiling, waits_at_1=(c1.collectives, c1.latency_s, c1.step_s))


def comparison_json(cmp: Comparison, device) -> dict:
    """The comparison as plain data (``--compare-seed --json``)."""
    return {
        "device": dataclasses.asdict(device), "context": cmp.context, "draft": dataclasses.asdict(cmp.draft),
        "curves": [{"recipe": n, "speculative": s,
                    "points": [{"concurrency": b, "tok_s_per_user": round(u, 1), "tok_s_total": round(t, 1),
                                "bound": bd} for b, u, t, bd in pts]} for (n, s), pts in cmp.curves.items()],
        "dp2_ahead_from": {"plain": cmp.crossover[False], "speculative": cmp.crossover[True]},
        "published": {
            "seed_tok_s_per_user_at_1": SEED_PER_USER_AT_1, "roofline_at_1": {"plain": cmp.at_1[False],
                                                                             "speculative": cmp.at_1[True]},
            "seed_tok_s_total_at_72": SEED_TOTAL_AT_72, "roofline_output_at_72": {"plain": cmp.at_72[False],
                                                                                 "speculative": cmp.at_72[True]},
            "implied_input_per_output_at_72": cmp.implied_input_per_output(True),
            "tpu_inference": dict(TPU_INFERENCE, roofline=cmp.tpu_inference_ceiling)},
    }


def print_comparison(cmp: Comparison, device) -> None:
    d = cmp.draft
    print(f"decode roofline of the seed's recipes on 32 x {device.name}, {cmp.context:,} tokens of context; "
          f"'+{d.name}': {d.verify_tokens} tokens verified and {d.accepted:g} accepted per request and step, "
          f"drafter {d.params / 1e9:.2f}B params, {d.layers} layers")
    heads = [f"{n}{' +' + d.name if s else ''}" for n in SEED_RECIPES for s in (False, True)]
    print("tok/s/user (tok/s total)")
    print(f"{'conc':>5}" + "".join(f"{h:>26}" for h in heads))
    keys = [(n, s) for n in SEED_RECIPES for s in (False, True)]
    for i, (b, *_rest) in enumerate(cmp.curves[keys[0]]):
        cells = []
        for k in keys:
            _, user, total, bound = cmp.curves[k][i]
            cells.append(f"{user:,.0f} ({total:,.0f}) {bound[:3]}")
        print(f"{b:>5}" + "".join(f"{c:>26}" for c in cells))
    for spec in (False, True):
        x = cmp.crossover[spec]
        where = f"from {x} concurrent requests" if x else "at no concurrency up to 72"
        print(f"{'with' if spec else 'without'} {d.name}: {SEED_RECIPES[1]} is ahead of {SEED_RECIPES[0]} {where}")
    print()
    print("against the published figures:")
    print(f"  seed, concurrency 1: {SEED_PER_USER_AT_1:g} tok/s/user; roofline {cmp.at_1[True]:,.0f} with "
          f"{d.name} (seed at {SEED_PER_USER_AT_1 / cmp.at_1[True]:.0%} of it), {cmp.at_1[False]:,.0f} without "
          f"(the seed is {SEED_PER_USER_AT_1 / cmp.at_1[False]:.2f}x above it, so it must speculate)")
    if SEED_PER_USER_AT_1 > cmp.at_1[True]:
        n, lat, step = cmp.waits_at_1
        print(f"  the seed is above even the speculative roofline: {SEED_RECIPES[0]}'s step with {d.name} at "
              f"concurrency 1 waits {lat * 1e3:.2f} of its {step * 1e3:.2f} ms on {n} collectives (an assumed "
              f"{lat / n * 1e6:.0f} us each); the seed's step runs fewer or faster ones, or its drafter accepts "
              f"more than {d.accepted:g} tokens a step")
    print(f"  seed, concurrency 72: {SEED_TOTAL_AT_72:,.0f} tok/s, input and output; roofline output "
          f"{cmp.at_72[True]:,.0f} tok/s with {d.name}: equal if the traces carry "
          f"{cmp.implied_input_per_output(True):.1f} input tokens per output token, more if the seed runs "
          f"below the ceiling")
    ti = TPU_INFERENCE
    print(f"  tpu-inference, concurrency {ti['concurrency']}, {ti['context']:,} tokens, no speculation: "
          f"{ti['tok_s_per_user']} tok/s/user; roofline {cmp.tpu_inference_ceiling:,.0f} "
          f"({cmp.tpu_inference_ceiling / ti['tok_s_per_user']:.0f}x above it)")


def plot_comparison(cmp: Comparison, path: str) -> None:
    """Two panels, tok/s/user and total tok/s against concurrency, published figures marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_u, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {SEED_RECIPES[0]: "tab:blue", SEED_RECIPES[1]: "tab:orange"}
    for (name, spec), pts in cmp.curves.items():
        b = [p[0] for p in pts]
        label = f"{name}{' + ' + cmp.draft.name if spec else ''}"
        style = "-" if spec else "--"
        ax_u.plot(b, [p[1] for p in pts], style, color=colors[name], label=label)
        ax_t.plot(b, [p[2] for p in pts], style, color=colors[name], label=label)
    ax_u.plot([1], [SEED_PER_USER_AT_1], "k*", ms=11, label="seed (AgentX, DSpark)")
    ti = TPU_INFERENCE
    ax_u.plot([ti["concurrency"]], [ti["tok_s_per_user"]], "rs", label="tpu-inference (8K/1K)")
    lo, hi = SEED_TOTAL_AT_72 / (1 + RATIO_BAND[1]), SEED_TOTAL_AT_72 / (1 + RATIO_BAND[0])
    ax_t.errorbar([72], [(lo * hi) ** 0.5], yerr=[[(lo * hi) ** 0.5 - lo], [hi - (lo * hi) ** 0.5]], fmt="k*",
                  ms=11, capsize=4, label=f"seed at 72 as output tokens, input:output "
                                          f"{RATIO_BAND[0]}:1 to {RATIO_BAND[1]}:1")
    for ax, what in ((ax_u, "tok/s per user"), (ax_t, "output tok/s, whole slice")):
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(what)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    ax_u.legend(fontsize=7)
    ax_t.legend(fontsize=7)
    fig.suptitle(f"K3 decode roofline, 32 x TPU v7, {cmp.context:,}-token context", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
