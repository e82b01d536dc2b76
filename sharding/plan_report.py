"""The decode roofline part of ``k3serve plan`` (``--concurrency``, ``--recommend``): tables
of ``sharding.roofline`` for the command line."""
from __future__ import annotations

import dataclasses
import json


def roofline_rows(cfg, recipes, inventory, contexts, concurrencies, device) -> list[dict]:
    from .roofline import step_cost

    rows = []
    for r in recipes:
        for L in contexts:
            for B in concurrencies:
                c = step_cost(cfg, r, inventory, context_len=L, concurrency=B, device=device)
                rows.append({"recipe": c.recipe, "context": L, "concurrency": B, "step_ms": round(c.step_s * 1e3, 3),
                             "bound": c.bound, "hbm_gb": round(sum(c.hbm_bytes.values()) / 1e9, 3),
                             "ici_mb": round(sum(c.ici_bytes.values()) / 1e6, 2),
                             "gflop": round(sum(c.flops.values()) / 1e9, 1), "latency_ms": round(c.latency_s * 1e3, 3),
                             "tok_s_per_user": round(c.tok_s_per_user, 1), "tok_s_total": round(c.tok_s_total, 1)})
    return rows


def print_roofline(rows: list[dict], device, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"device": dataclasses.asdict(device), "steps": rows}, indent=1))
        return
    print(f"decode step per device on {device.name}: HBM {device.hbm_bytes_per_s / 1e12:g} TB/s, ICI "
          f"{device.ici_bytes_per_s / 1e12:g} TB/s out, {device.flops_per_s / 1e12:g} TFLOP/s, "
          f"{device.collective_latency_s * 1e6:g} us per collective (docs/choosing-a-recipe.md)")
    head = ("recipe", "context", "conc", "step ms", "bound", "HBM GB", "ICI MB", "GFLOP", "tok/s/user", "tok/s")
    print(f"{head[0]:<28}" + "".join(f"{h:>11}" for h in head[1:]))
    for x in rows:
        print(f"{x['recipe']:<28}{x['context']:>11,}{x['concurrency']:>11}{x['step_ms']:>11.2f}{x['bound']:>11}"
              f"{x['hbm_gb']:>11.2f}{x['ici_mb']:>11.1f}{x['gflop']:>11.1f}{x['tok_s_per_user']:>11.0f}"
              f"{x['tok_s_total']:>11.0f}")


def print_recommendation(ranked: list[dict], devices: int, context: int, concurrency: int, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"devices": devices, "context": context, "concurrency": concurrency, "ranked": ranked},
                         indent=1))
        return
    print(f"recipes for {devices} devices, {concurrency} requests of {context:,} tokens, best first:")
    for i, x in enumerate(ranked, 1):
        fit = "" if x["fits"] else f"  (does not fit: at most {x['max_concurrent']} requests)"
        print(f"{i:>3}. {x['recipe']:<28} {x['tok_s_total']:>10.0f} tok/s  {x['tok_s_per_user']:>7.0f} tok/s/user  "
              f"step {x['step_ms']:.2f} ms ({x['bound']}){fit}")
