"""``k3serve compile``'s report: the planner's figures for the same flags, and the text form.

Why here: the planner (``memory.py``, ``roofline.py``) is what the compiler's figures are
checked against, so its side of the comparison is computed with it, from the same config,
recipe and flags; the compiled side comes in as plain dicts (``tpu_aot.program_report``).
"""
from __future__ import annotations

GiB = 2 ** 30


def plan_figures(cfg, recipe, *, dtype: str, max_num_seqs: int, max_model_len: int,
                 snapshots: int, hbm_bytes: float | None, packed: bool = True, step_tokens: int = 0) -> dict:
    """The planner's per-device bytes of a server with these flags (weights + ``max_num_seqs``
    requests at ``max_model_len`` tokens with their snapshot slots per attention DP group +,
    unless the engine stores its layer stacks ``packed`` (``model.packed_rows``), the stacks
    the step re-tiles, ``memory.retiled_per_device``, + the activations of a ``step_tokens``
    step, ``memory.step_activations_per_device``) and its decode step (one token per row,
    ``max_num_seqs`` rows): HBM bytes and collectives."""
    from .memory import param_inventory, plan_memory, retiled_per_device, step_activations_per_device
    from .roofline import TPU7X, step_cost

    inv = param_inventory(cfg, dtype)
    hbm_gb = hbm_bytes / 1e9 if hbm_bytes else TPU7X.hbm_gb
    per_req = snapshots / max_num_seqs if max_num_seqs else 0.0
    mem = plan_memory(cfg, recipe, inv, context_len=max_model_len, hbm_gb=hbm_gb, usable_fraction=1.0,
                      snapshots_per_request=per_req)
    rows = -(-max_num_seqs // recipe.dp)  # requests one DP group holds
    step = step_cost(cfg, recipe, inv, context_len=max_model_len, concurrency=max_num_seqs)
    caches = rows * mem.per_request_per_device
    retiled = 0.0 if packed else retiled_per_device(inv, recipe)
    acts = step_activations_per_device(cfg, recipe, step_tokens) if step_tokens else 0.0
    return {"per_device_bytes": mem.weights_per_device + caches + retiled + acts,
            "weights_per_device": mem.weights_per_device, "caches_per_device": caches, "retiled_per_device": retiled,
            "activations_per_device": acts,
            "decode_bytes": sum(step.hbm_bytes.values()), "decode_collectives": step.collectives,
            "decode_collective_parts": dict(step.collective_parts)}


def _gib(x) -> str:
    if x is None:
        return "-"
    return f"{x / GiB:.2f} GiB" if x >= GiB / 10 else f"{x / 2**20:.2f} MiB"


def _plan_parts(rep: dict) -> str:
    pp = rep.get("plan_parts")
    if not pp:
        return ""
    return (f" (weights {_gib(pp['weights'])}, caches {_gib(pp['caches'])}, re-tiled layer stacks "
            f"{_gib(pp['retiled'])}, step activations {_gib(pp.get('activations', 0))})")


def format_report(rep: dict) -> str:
    """The text ``k3serve compile`` prints for its JSON report ``rep``."""
    out = [f"k3serve compile: {rep['model']} on {rep['topology']} ({rep['devices']} devices), recipe "
           f"{rep['recipe'] or 'none (one device)'}, kernels {rep['kernels']}, dtype {rep['dtype']}"]
    if rep.get("error"):
        out.append(f"error: {rep['error']}")
    out.append(f"{'program':<28}{'ok':>4}{'compile s':>10}{'argument':>12}{'output':>12}{'temp':>12}{'code':>11}"
               f"{'GFLOP':>10}{'GB accessed':>12}  collectives")
    for p in rep["programs"]:
        m = p.get("bytes_per_device") or {}
        coll = ", ".join(f"{k} {v}" for k, v in sorted((p.get("collectives") or {}).items())) or "-"
        flops, acc = p.get("flops"), p.get("bytes_accessed")
        out.append(f"{p['name']:<28}{'yes' if p['ok'] else 'NO':>4}{p['compile_s']:>10.1f}"
                   f"{_gib(m.get('argument')):>12}{_gib(m.get('output')):>12}{_gib(m.get('temp')):>12}"
                   f"{_gib(m.get('code')):>11}{'-' if flops is None else f'{flops / 1e9:.2f}':>10}"
                   f"{'-' if acc is None else f'{acc / 1e9:.3f}':>12}  {coll}")
        if not p["ok"]:
            out.append(f"    error: {p['error'][:2000]}")
    pd, hbm = rep["per_device_bytes"], rep["hbm_per_device"]
    parts = rep.get("compiler_parts") or {}
    journal = f" with the speculative journal's {_gib(parts['journal'])}" if parts.get("journal") else ""
    out.append(f"per device: compiler {_gib(pd['compiler'])} (weights {_gib(parts.get('weights'))}, caches "
               f"{_gib(parts.get('caches'))}{journal}, largest temporaries {_gib(parts.get('temp'))} in "
               f"{parts.get('temp_program') or '-'}); planner {_gib(pd['plan'])}{_plan_parts(rep)}; HBM "
               f"{_gib(hbm)} ({rep.get('hbm_source', '')})")
    fits = rep.get("fits")
    out.append("fits a device" if fits else "fit unknown: a program failed for another reason" if fits is None else
               f"DOES NOT FIT a device ({_gib(hbm)}): see the programs past the HBM above")
    d = rep.get("decode") or {}
    if d:
        acc, plan = d.get("bytes_accessed"), d.get("plan_bytes")
        ratio = f" ({acc / plan:.2f}x the planner)" if acc and plan else ""
        out.append(f"decode step ({d.get('rows')} rows, bucket {d.get('bucket')}): "
                   f"{'-' if acc is None else f'{acc / 1e9:.2f}'} GB accessed{ratio}, planner "
                   f"{'-' if plan is None else f'{plan / 1e9:.2f}'} GB; "
                   f"{'-' if d.get('flops') is None else format(d.get('flops') / 1e9, '.1f')} GFLOP; collectives "
                   f"{d.get('collectives')} (planner {d.get('plan_collectives')}"
                   + "".join(f"; {k} {v}" for k, v in (d.get("plan_collective_parts") or {}).items()) + ")"
                   + (f"; EP exchange: its {d['ep_exchange']}" if d.get("ep_exchange") else ""))
        for kind, f in (d.get("per_layer") or {}).items():
            out.append(f"    per {kind} layer (x{f['layers']}): {f['bytes_accessed'] / 1e9:.3f} GB, "
                       f"{f['flops'] / 1e9:.2f} GFLOP, {f['collectives']:.0f} collectives")
    out.append("ok" if rep["ok"] else "FAILED")
    return "\n".join(out)
