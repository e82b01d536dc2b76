"""Child-process body for the recipe tests (run with N virtual CPU devices, see
``test_sharding.py``): a model step under each recipe's parallel path (DCP, attention DP,
SP, EP dispatch) against one device, on batches of very different lengths, then a few
greedy decode steps. Prints one JSON line."""
from __future__ import annotations

import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _util import greedy_padded
from k3serve.checkpoints import load_pretrained
from k3serve.model.cache import Cache, allocate_cache, make_batch
from k3serve.server.engine.cache import CacheManager, plan_capacity
from k3serve.sharding.mesh import build_mesh, shard_params
from k3serve.sharding.parallel import StepParallel
from k3serve.sharding.recipe import Recipe


def one_device_step(m):
    """The single-device reference step, jitted once per process: recipes whose batch and cache
    have the same shapes (``pool_blocks``) share its compiled programs."""
    def step(params, cache, batch):
        return nnx.merge(m.graphdef, params)(batch, cache, par=None)

    return jax.jit(step, donate_argnums=(1,))


def run_recipe(m, recipe: Recipe, lengths, page_size: int, decode_steps: int, ep_impl=None, seed: int = 0,
               f_one=None, pool_blocks: int = 1):
    """(max rel. logits error over prefill + decode, tokens identical, per-device KV bytes, total KV bytes).

    ``f_one``: the single-device step (``one_device_step``); ``pool_blocks``: the page count is
    a multiple of it and of the recipe's dp × dcp blocks (the same pool for every recipe of a
    child, so the reference compiles once for all its recipes with the same row count)."""
    cfg = m.config
    devs = jax.devices()[: recipe.devices]
    recipe = recipe.validate(cfg, num_devices=len(devs))
    mesh = build_mesh(recipe, devs)
    par = StepParallel(recipe, mesh, ep_dispatch=ep_impl)
    rows = len(lengths)
    max_len = max(lengths) + decode_steps
    pages_per_seq = -(-max_len // page_size)
    blocks = recipe.dp * recipe.dcp
    unit = math.lcm(blocks, pool_blocks)
    num_pages = -(-rows * pages_per_seq // unit) * unit + unit * 2
    plan = plan_capacity(cfg, page_size=page_size, dtype=m.dtype, num_pages=num_pages, max_num_seqs=rows,
                         dp=recipe.dp, dcp=recipe.dcp)
    mgr = CacheManager(cfg, plan, m.dtype, allocate=False)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    for i, n in enumerate(lengths):  # each sequence holds only the pages it needs
        assert mgr.admit(i)
        assert mgr.ensure_tokens(i, n + decode_steps)
    # rows laid out by DP group, as the runner does
    groups = [mgr.group_of(i) for i in range(rows)]
    Bg = max(groups.count(g) for g in range(recipe.dp))
    B = recipe.dp * Bg
    at, seen = [], [0] * recipe.dp
    for g in groups:
        at.append(g * Bg + seen[g])
        seen[g] += 1
    width = pages_per_seq
    sharded = shard_params(m.params, mesh)
    shard = Cache(**par.cache_shardings(cfg.kda_num_heads))
    alloc = lambda groups=1: allocate_cache(cfg, plan.num_slots, plan.num_pages, page_size, m.dtype, groups)
    cache_par = jax.jit(lambda: alloc(par.conv_groups(cfg.kda_num_heads)), out_shardings=shard)()
    cache_one = alloc()
    kv = cache_par.mla_kv
    per_dev = kv.addressable_shards[0].data.nbytes
    total = kv.nbytes

    def step(params, cache, batch, par):
        return nnx.merge(m.graphdef, params)(batch, cache, par=par)

    f_par = jax.jit(lambda p, c, b: step(p, c, b, par), donate_argnums=(1,))
    f_one = f_one or one_device_step(m)

    def batch_for(tokens, start):
        T = max(len(t) for t in tokens)
        tok = np.zeros((B, T), np.int32)
        st, ln = np.zeros(B, np.int32), np.zeros(B, np.int32)
        slots = np.asarray([mgr.scratch_slot(i // Bg) for i in range(B)], np.int32)
        table = np.zeros((B, width), np.int32)
        for i in range(rows):
            r = at[i]
            tok[r, : len(tokens[i])] = tokens[i]
            st[r], ln[r] = start[i], len(tokens[i])
            slots[r] = mgr.slot_of(i)
            table[r] = mgr.page_table_row(i, width)
        return make_batch(tok, st, ln, slots, table), T

    errs, same = [], True
    batch, T = batch_for(prompts, [0] * rows)
    lp, cache_par = f_par(sharded, cache_par, batch)
    lo, cache_one = f_one(m.params, cache_one, batch)
    lp, lo = np.asarray(lp), np.asarray(lo)
    # the collectives XLA compiled into the prefill step (the executable is cached: no compile)
    hlo = f_par.lower(sharded, cache_par, batch).compile().as_text()
    collectives = {op: hlo.count(op + "(") + hlo.count(op + "-start(")
                   for op in ("all-to-all", "reduce-scatter", "all-gather", "all-reduce")}
    last = []
    for i, n in enumerate(lengths):
        a, b = lp[at[i], :n], lo[at[i], :n]
        errs.append(float(np.abs(a - b).max() / np.abs(b).max()))
        same &= bool((a.argmax(-1) == b.argmax(-1)).all())
        last.append(int(b[n - 1].argmax()))
    pos = list(lengths)
    toks = [[t] for t in last]
    for _ in range(decode_steps):
        batch, _ = batch_for([[t[-1]] for t in toks], pos)
        lp, cache_par = f_par(sharded, cache_par, batch)
        lo, cache_one = f_one(m.params, cache_one, batch)
        lp, lo = np.asarray(lp), np.asarray(lo)
        for i in range(rows):
            a, b = lp[at[i], 0], lo[at[i], 0]
            errs.append(float(np.abs(a - b).max() / np.abs(b).max()))
            same &= int(a.argmax()) == int(b.argmax())
            toks[i].append(int(b.argmax()))
            pos[i] += 1
    # pages of each sequence per block (round robin over the group's DCP ranks)
    spread = [[sum(mgr.pages.block_of(p) == b for p in mgr.pages_of(i)) for b in range(blocks)] for i in range(rows)]
    from k3serve.sharding.ep import resolve_impl

    exchange = resolve_impl(par.ep_impl, mesh) if par.ep_impl else None
    return {"err": max(errs), "tokens_equal": same, "ep_exchange": exchange, "collectives": collectives,
            "sp_active": par.sp > 1 and B >= par.sp_min_rows and B % (par.sp * par.dp) == 0, "kv_bytes_device": per_dev, "kv_bytes_total": total,
            "spread": spread, "groups": groups}


def run_engine(m, recipe: str, lengths, new_tokens: int, page_size: int, seed: int = 1):
    """Serve one request per length through the engine under ``recipe`` (all in one batch);
    returns whether every output equals the single-device greedy decode, and the DP group of
    each request."""
    from k3serve.server.engine.engine import Engine
    from k3serve.server.engine.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, m.config.vocab_size, n).tolist() for n in lengths]
    # one device (before the engine places params), every prompt in one prefill and one decode
    # program (``m.greedy`` compiled three of each for these lengths)
    expect = [greedy_padded(m, p, new_tokens) for p in prompts]
    orig = m.params
    r = Recipe.parse(recipe)
    # bucket_growth: token buckets 1, the group's rows and the budget (one program fewer than
    # growth 8's 1, 2, 16, 64; a bucket only sets the padding of the same step)
    eng = Engine(m, max_num_seqs=len(lengths), max_num_batched_tokens=16 * len(lengths), chunk_size=16,
                 page_size=page_size, max_model_len=64, warmup=False, recipe=recipe, bucket_growth=32,
                 devices=jax.devices()[: r.devices],
                 # the sharded step is what this checks; prefix-cache placement under DP/DCP is
                 # checked without devices in test_prefix_cache.py (its copies on a 32-device
                 # mesh would cost this suite about a minute of compiles)
                 enable_prefix_caching=False)
    rids = [eng.add_request(p, SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True))
            for p in prompts]
    eng.step()  # admits all of them: every request now has its DP group
    groups = [eng.cache_mgr.group_of(rid) for rid in rids]
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.rid] = o.token_ids
    eng.check_invariants()
    m.params = orig
    got = [done[r] for r in rids]
    return {"equal": got == expect, "groups": groups, "free_pages": eng.cache_mgr.num_free_pages,
            "num_pages": eng.capacity_plan.num_pages, "recipe": str(eng.recipe), "steps": eng.num_steps}


def main():
    case, spec = sys.argv[1], json.loads(sys.argv[2])
    m = load_pretrained(case)
    out, t0 = {}, time.perf_counter()
    f_one = one_device_step(m)
    pool_blocks = math.lcm(*(Recipe.parse(rec).dp * Recipe.parse(rec).dcp for rec in spec["recipes"].values()))
    for name, rec in spec["recipes"].items():
        r = Recipe.parse(rec)
        out[name] = run_recipe(m, r, spec["lengths"], spec["page_size"], spec["decode_steps"],
                               ep_impl=spec.get("ep_impl", "auto"), f_one=f_one, pool_blocks=pool_blocks)
        print(f"{time.perf_counter() - t0:.1f}s", name, out[name], file=sys.stderr, flush=True)
    for name, rec in spec.get("engine", {}).items():
        out["engine:" + name] = run_engine(m, rec, spec["engine_lengths"], spec["engine_new_tokens"], spec["page_size"])
        print(f"{time.perf_counter() - t0:.1f}s", name, out["engine:" + name], file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
