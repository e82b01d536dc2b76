"""Child-process body for ``test_pallas_recipes.py`` (8 virtual CPU devices): greedy decoding of
one tiny K3 with ``kernels="pallas-interpret"`` under each recipe (every Pallas kernel run per
rank inside the recipe's shard_maps) against ``kernels="reference"`` on one device.

Each run is one jitted step of a fixed ``[rows, T]`` padded shape (the prefill, then one-token
decode steps in the same shape), so each model compiles once: interpreted kernels make every
compile and step slow. Pages and slots come from the engine's ``CacheManager`` (DP groups,
DCP round robin), rows laid out by DP group as the runner does. Prints one JSON line."""
from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

from _ragged_emulation import emulated_ragged_all_to_all  # beside this script
from k3serve.checkpoints import load_pretrained
from k3serve.checkpoints.synthetic import generate_checkpoint, k3_config
from k3serve.model.cache import Cache, allocate_cache, make_batch
from k3serve.server.engine.cache import CacheManager, plan_capacity
from k3serve.sharding.mesh import build_mesh, placement_for, shard_params
from k3serve.sharding.parallel import StepParallel
from k3serve.sharding.recipe import Recipe

PAGE = 4
# ``one_program``: every interpreted kernel here runs inside ONE jitted program that is waited
# for before anything else is dispatched. jax 0.10's TPU interpreter calls back into Python at
# each kernel's device barrier and there computes ``device_id * cores`` on a jax array (a CPU
# dispatch); a kernel run eagerly, op by op, with the next op already being dispatched from
# this thread, deadlocked that way about one run in three on 2 cores (the CI timeout of
# 2026-12-07: faulthandler showed the callback in ``update_clocks_for_device_barrier`` and the
# main thread in an eager scatter, both dispatching).


def checkpoint(root: str) -> str:
    """A 3-layer K3 (two KDA layers: the pools' layer index matters; an MLA layer; MXFP4
    LatentMoE experts) with 8 KDA and MLA heads and 8 experts: heads split over every
    attention group of 8 devices."""
    cfg = k3_config(vocab_size=256, hidden_size=64, num_hidden_layers=3, full_attn_layers=[3], kda_num_heads=8,
                    kda_head_dim=16, mla_heads=8, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=8, v_head_dim=8, num_experts=8, num_experts_per_token=2,
                    num_shared_experts=1, moe_intermediate_size=32, routed_expert_hidden_size=32,
                    intermediate_size=64, attn_res_block_size=2)
    return str(generate_checkpoint(os.path.join(root, "k3-pallas-recipes"), cfg, seed=11))


def greedy(m, recipe: str | None, prompts, new_tokens: int) -> dict:
    """Greedy tokens of every prompt, all in one batch, the last step's logits and the
    number of Pallas kernel call sites in the step."""
    cfg = m.config
    par, params, dp, dcp = None, m.params, 1, 1
    if recipe is not None:
        r = Recipe.parse(recipe)
        devs = jax.devices()[: r.devices]
        r = r.validate(cfg, num_devices=len(devs))
        mesh = build_mesh(r, devs)
        par, params, dp, dcp = StepParallel(r, mesh), shard_params(m.params, mesh), r.dp, r.dcp
    rows, T = len(prompts), max(map(len, prompts))
    pps = -(-(T + new_tokens) // PAGE)
    blocks = dp * dcp
    plan = plan_capacity(cfg, page_size=PAGE, dtype=m.dtype, num_pages=-(-rows * pps // blocks) * blocks + blocks,
                         max_num_seqs=rows, dp=dp, dcp=dcp)
    mgr = CacheManager(cfg, plan, m.dtype, allocate=False)
    for i, p in enumerate(prompts):
        assert mgr.admit(i) and mgr.ensure_tokens(i, len(p) + new_tokens)
    groups = [mgr.group_of(i) for i in range(rows)]
    Bg = max(groups.count(g) for g in range(dp))
    B, at, seen = dp * Bg, [], [0] * dp
    for g in groups:  # rows laid out by DP group, as the runner does
        at.append(g * Bg + seen[g])
        seen[g] += 1
    conv_groups = 1 if par is None else par.conv_groups(cfg.kda_num_heads)
    alloc = lambda: allocate_cache(cfg, plan.num_slots, plan.num_pages, PAGE, m.dtype, conv_groups)  # noqa: E731
    cache = alloc() if par is None else jax.jit(alloc, out_shardings=Cache(**par.cache_shardings(cfg.kda_num_heads)))()
    step = jax.jit(lambda p, c, b, at: nnx.merge(m.graphdef, p)(b, c, par=par, logits_at=at), donate_argnums=(1,))

    def batch(tokens, start):
        tok, st, ln = np.zeros((B, T), np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
        slots = np.asarray([mgr.scratch_slot(i // Bg) for i in range(B)], np.int32)
        table = np.zeros((B, pps), np.int32)
        for i in range(rows):
            tok[at[i], : len(tokens[i])] = tokens[i]
            st[at[i]], ln[at[i]] = start[i], len(tokens[i])
            slots[at[i]] = mgr.slot_of(i)
            table[at[i]] = mgr.page_table_row(i, pps)
        return make_batch(tok, st, ln, slots, table), np.maximum(ln - 1, 0)

    out, pos, feed = [[] for _ in prompts], [0] * rows, [list(p) for p in prompts]
    traced = step.trace(params, cache, *batch(feed, pos))
    kernels = str(traced.jaxpr).count("pallas_call[")  # kernel call sites in the step (scan body once)
    run = traced.lower().compile()
    for _ in range(new_tokens):
        logits, cache = run(params, cache, *batch(feed, pos))
        logits = np.asarray(logits[:, 0], np.float32)
        for i in range(rows):
            out[i].append(int(logits[at[i]].argmax()))
            pos[i] += len(feed[i])
            feed[i] = [out[i][-1]]
    return {"tokens": out, "last_logits": [logits[at[i]].tolist() for i in range(rows)], "groups": groups,
            "kernel_calls": kernels}


def ragged_gmm_error(recipe: str) -> float:
    """``expert_ffn_ep`` with the ragged exchange and the MXFP4 kernel (``backend``
    "pallas-interpret", weights repacked, layer 1 of a 2-layer stack read in place) against the
    one-device reference; the collective is EMULATED (all_gather + scatter with
    ``ragged_all_to_all``'s documented semantics), since XLA:CPU has no ragged-all-to-all."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from k3serve.kernels.moe import expert_ffn
    from k3serve.kernels.moe_gmm import repack_experts
    from k3serve.kernels.mxfp4 import quantize_mxfp4_np
    from k3serve.sharding import ep as ep_mod
    from k3serve.sharding.mesh import param_spec

    E, k, I, K, N = 8, 2, 32, 32, 13
    rng = np.random.default_rng(1)
    act = lambda g, u: jax.nn.silu(g) * u  # noqa: E731
    q = {n: [quantize_mxfp4_np((rng.normal(size=s) / np.sqrt(s[-1])).astype(np.float32)) for _ in range(2)]
         for n, s in (("w1", (E, I, K)), ("w3", (E, I, K)), ("w2", (E, K, I)))}
    x = rng.normal(size=(N, K)).astype(np.float32)
    idx = np.argsort(-rng.normal(size=(N, E)), axis=1)[:, :k].astype(np.int32)
    w = rng.uniform(0.2, 1.0, size=(N, k)).astype(np.float32)
    want = np.asarray(expert_ffn(x, idx, w, q["w1"][1], q["w2"][1], q["w3"][1], act, E), np.float64)
    r = Recipe.parse(recipe)
    mesh = build_mesh(r, jax.devices()[: r.devices])

    def stack(name):  # [2, E, ...] packed (repacked) and scale, placed as the model's stacks
        out = []
        for part, arrs in (("packed", [repack_experts(a[0]) for a in q[name]]), ("scale", [a[1] for a in q[name]])):
            a = np.stack(arrs)
            spec = param_spec(f"ffn.1.block_sparse_moe.experts.{name}_{part}", a.shape, dict(mesh.shape))
            out.append(jax.device_put(a, NamedSharding(mesh, PartitionSpec(*spec))))
        return tuple(out)

    ep_mod._ragged_all_to_all = emulated_ragged_all_to_all
    try:
        f = jax.jit(lambda x, i, w, w1, w2, w3: ep_mod.expert_ffn_ep(
            x, i, w, w1, w2, w3, act, E, mesh=mesh, impl="ragged", layer=1, backend="pallas-interpret"))
        got = np.asarray(f(x, idx, w, stack("w1"), stack("w2"), stack("w3")), np.float64)
    finally:
        ep_mod._ragged_all_to_all = jax.lax.ragged_all_to_all
    return float(np.abs(got - want).max() / np.abs(want).max())


def host_rows(index, num_rows: int) -> np.ndarray:
    """``model.step.local_rows`` on the host: the ragged ops' row index (``num_rows`` for none)
    as a constant, where the one-device programs below need it concrete."""
    return np.where(index < 0, num_rows, index).astype(np.int32)


def kda_pools_error(recipe: str) -> float:
    """``StepParallel.kda_layer_on_pools`` on pools placed as the engine keeps them (dp=2,
    heads split; the conv pool's channels rank-major and split over the heads' ranks) on 2-layer pools, with a prefix hit (read slot != write slot), a fresh
    row and snapshots taken by a prefill row (after 2 of its 3 tokens) and by a decode row,
    against ``ops.kda_layer_on_pools`` on one device, group by group: the largest relative
    error of the outputs and both pools."""
    import types

    import jax.numpy as jnp

    from k3serve.kernels import ops
    from k3serve.model.cache import conv_block_rows, conv_pool_logical, conv_pool_rows

    H, d, W, L = 8, 16, 4, 2
    P = H * d
    Tg, Rg, Sg, NSg = 8, 2, 6, 2  # per DP group: tokens, rows, slots, snapshot entries
    T, S = 2 * Tg, 2 * Sg
    rng = np.random.default_rng(0)
    f32 = np.float32
    x = dict(qkv=rng.normal(size=(T, 3 * P)).astype(f32), f=rng.normal(size=(T, P)).astype(f32),
             beta=(1 / (1 + np.exp(-rng.normal(size=(T, H))))).astype(f32), gate=rng.normal(size=(T, P)).astype(f32))
    cw = (0.5 * rng.normal(size=(3 * P, W))).astype(f32)
    A_log, dt_bias = rng.normal(size=(H,)).astype(f32), rng.normal(size=(P,)).astype(f32)
    o_norm = (1 + 0.1 * rng.normal(size=(d,))).astype(f32)
    state = (0.1 * rng.normal(size=(L, S, H, d, d))).astype(f32)
    conv = rng.normal(size=(L, S, W - 1, 3 * P)).astype(f32)
    # group 0: row0 3 tokens (snapshot after 2 -> slot 2), row1 1 token (snapshot len 1 -> slot 3)
    # group 1: row0 1 token read 6 write 7, row1 4 tokens fresh, read/write 8; no snapshots
    q_lens = np.array([3, 1, 1, 4], np.int32)
    tok_row = np.array([0, 0, 0, 1] + [-1] * 4 + [0, 1, 1, 1, 1] + [-1] * 3, np.int32)
    cu = np.array([0, 3, 4, 0, 1, 5], np.int32)
    start = np.array([5, 7, 9, 0], np.int32)
    read, write = np.array([0, 1, 6, 8], np.int32), np.array([0, 1, 7, 8], np.int32)
    fresh = np.array([False, False, False, True])
    snap_row, snap_len = np.array([0, 1, -1, -1], np.int32), np.array([2, 1, 0, 0], np.int32)
    snap_slot = np.array([2, 3, S, S], np.int32)
    layer = 1
    kw = dict(lower_bound=-5.0, eps=1e-5, backend="pallas-interpret")

    @jax.jit  # one device, group by group; one program (see ``one_program``)
    def one_device(st, cv, m, x):  # the inputs and row metadata traced, as in the engine's step
        outs = []
        for g in range(2):
            tk, rw, sn = slice(g * Tg, (g + 1) * Tg), slice(g * Rg, (g + 1) * Rg), slice(g * NSg, (g + 1) * NSg)
            o, st, cv = ops.kda_layer_on_pools(
                x["qkv"][tk], x["f"][tk], x["beta"][tk], x["gate"][tk], cw, A_log, dt_bias, o_norm, st, cv, layer,
                m["tok_row"][tk], m["cu"][g * (Rg + 1):(g + 1) * (Rg + 1)], m["q_lens"][rw], m["start"][rw],
                m["read"][rw], m["write"][rw], m["fresh"][rw], m["snap_row"][sn], m["snap_len"][sn],
                m["snap_slot"][sn], **kw)
            outs.append(o)
        return jnp.concatenate(outs), st, cv

    meta = dict(tok_row=host_rows(tok_row, Rg), cu=cu, q_lens=q_lens, start=start, read=read, write=write,
                fresh=fresh, snap_row=host_rows(snap_row, Rg), snap_len=snap_len, snap_slot=snap_slot)
    want_o, want_st, want_cv = map(np.asarray, one_device(state, conv, meta, x))

    r = Recipe.parse(recipe)
    mesh = build_mesh(r, jax.devices()[:8])
    par = StepParallel(r, mesh)
    sh = par.cache_shardings(H)
    fb = types.SimpleNamespace(tok_row=tok_row, cu_q_lens=cu, start_pos=start, read_slot=read, write_slot=write,
                               fresh=fresh, snap_row=snap_row, snap_len=snap_len, snap_slot=snap_slot)

    def g(st, cv):
        return par.kda_layer_on_pools(x["qkv"].reshape(T, 3, P), x["f"], x["beta"], x["gate"], cw, A_log, dt_bias, o_norm,
                                      st, cv, layer, fb, jnp.asarray(q_lens), **kw)

    G = par.conv_groups(H)  # the pool's rows stored rank-major over the heads' ranks
    assert G == r.attn_group > 1, (G, r.attn_group)
    cv_in = jax.device_put(np.asarray(conv_pool_rows(jnp.asarray(conv), G, d)), sh["kda_conv"])
    # each device: its heads' rows only, padded to whole tiles
    assert cv_in.sharding.shard_shape(cv_in.shape)[-2] == conv_block_rows(W - 1, H, G)
    o, st2, cv2 = jax.jit(g)(jax.device_put(state, sh["kda_state"]), cv_in)
    cv2 = conv_pool_logical(cv2, G, W - 1, H)
    rel = lambda a, b: float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())  # noqa: E731
    return max(rel(o, want_o), rel(st2, want_st), rel(cv2, want_cv))


def _channels_rank_major(x, groups: int, back: bool = False):
    """The journal's pre-conv rows ``[..., 3P]`` as a rank keeps them when the KDA heads are split
    over ``groups`` ranks: block j of the channels is q_j | k_j | v_j (its heads' of each);
    ``back``: the inverse, to q | k | v."""
    outer, inner = (groups, 3) if back else (3, groups)
    v = np.reshape(x, x.shape[:-1] + (outer, inner, x.shape[-1] // (outer * inner)))
    return np.swapaxes(v, -3, -2).reshape(x.shape)


def kda_spec_pools_error(recipe: str) -> float:
    """The record mode per rank (speculative decoding): ``StepParallel.kda_layer_on_pools`` with
    the journal placed as the engine keeps it (dp=2: each group's block of entries; heads split:
    the pre-conv rows rank-major like the conv pool) against ``ops.kda_layer_on_pools`` with the
    journal on one device, group by group. Decode rows with 2, 0 and 3 drafts folding 1, 2 and
    0 accepted drafts from a journal of earlier steps (random), one with a prefix hit, and a
    fresh prefill row beside them: the largest relative error of the outputs, both pools and
    the journal."""
    import types

    import jax.numpy as jnp

    from k3serve.kernels import ops
    from k3serve.model.cache import conv_block_rows, conv_pool_logical, conv_pool_rows

    H, d, W, L, D = 8, 16, 4, 2, 3
    P = H * d
    Tg, Rg, Sg, Jg = 8, 2, 6, 2  # per DP group: tokens, rows, slots, journal entries
    T, S, J = 2 * Tg, 2 * Sg, 2 * Jg
    rng = np.random.default_rng(1)
    f32 = np.float32
    x = dict(qkv=rng.normal(size=(T, 3 * P)).astype(f32), f=rng.normal(size=(T, P)).astype(f32),
             beta=(1 / (1 + np.exp(-rng.normal(size=(T, H))))).astype(f32), gate=rng.normal(size=(T, P)).astype(f32))
    cw = (0.5 * rng.normal(size=(3 * P, W))).astype(f32)
    A_log, dt_bias = rng.normal(size=(H,)).astype(f32), rng.normal(size=(P,)).astype(f32)
    o_norm = (1 + 0.1 * rng.normal(size=(d,))).astype(f32)
    state = (0.1 * rng.normal(size=(L, S, H, d, d))).astype(f32)
    conv = rng.normal(size=(L, S, W - 1, 3 * P)).astype(f32)
    jk = rng.normal(size=(L, J, D, H, d)).astype(f32) * 0.3
    jeg = np.exp(-np.abs(rng.normal(size=(L, J, D, H, d)))).astype(f32)
    jdelta = rng.normal(size=(L, J, D, H, d)).astype(f32) * 0.3
    jraw = rng.normal(size=(L, J, D, 3 * P)).astype(f32)
    # group 0: row0 decode + 2 drafts (entry 0, folds 1), row1 decode alone (entry 1, folds 2)
    # group 1: row0 decode + 3 drafts, read 6 write 7 (entry 2, folds 0), row1 a fresh 4-token prefill
    q_lens = np.array([3, 1, 4, 4], np.int32)
    tok_row = np.array([0, 0, 0, 1] + [-1] * 4 + [0, 0, 0, 0, 1, 1, 1, 1], np.int32)
    cu = np.array([0, 3, 4, 0, 4, 8], np.int32)
    start = np.array([5, 7, 9, 0], np.int32)
    read, write = np.array([0, 1, 6, 8], np.int32), np.array([0, 1, 7, 8], np.int32)
    fresh = np.array([False, False, False, True])
    decode = np.array([True, True, True, False])
    jrow, fold = np.array([0, 1, 2, -1], np.int32), np.array([1, 2, 0, 0], np.int32)
    snap_row, snap_len, snap_slot = (np.full(4, -1, np.int32), np.zeros(4, np.int32), np.full(4, S, np.int32))
    layer = 1
    kw = dict(lower_bound=-5.0, eps=1e-5, backend="pallas-interpret")

    @jax.jit  # one device, group by group; one program (see ``one_program``)
    def one_device(st, cv, jl, m, x):  # the inputs and row metadata traced, as in the engine's step
        outs = []
        for g in range(2):
            tk, rw = slice(g * Tg, (g + 1) * Tg), slice(g * Rg, (g + 1) * Rg)
            o, st, cv, jl = ops.kda_layer_on_pools(
                x["qkv"][tk], x["f"][tk], x["beta"][tk], x["gate"][tk], cw, A_log, dt_bias, o_norm, st, cv, layer,
                m["tok_row"][tk], m["cu"][g * (Rg + 1):(g + 1) * (Rg + 1)], m["q_lens"][rw], m["start"][rw],
                m["read"][rw], m["write"][rw], m["fresh"][rw], m["snap_row"][rw], m["snap_len"][rw],
                m["snap_slot"][rw], journal=jl, decode=m["decode"][rw], jrow=m["jrow"][rw], fold_len=m["fold"][rw],
                **kw)
            outs.append(o)
        return jnp.concatenate(outs), st, cv, jl

    meta = dict(tok_row=host_rows(tok_row, Rg), cu=cu, q_lens=q_lens, start=start, read=read, write=write,
                fresh=fresh, snap_row=host_rows(snap_row, Rg), snap_len=snap_len, snap_slot=snap_slot,
                decode=decode, jrow=jrow, fold=fold)
    o1, st1, cv1, jl1 = one_device(state, conv, (jk, jeg, jdelta, jraw), meta, x)
    want = [np.asarray(o1), np.asarray(st1), np.asarray(cv1)] + [np.asarray(a) for a in jl1]

    r = Recipe.parse(recipe)
    mesh = build_mesh(r, jax.devices()[:8])
    par = StepParallel(r, mesh)
    sh = par.cache_shardings(H)
    G = par.conv_groups(H)
    assert G > 1 and r.dp == 2, (G, r.dp)
    fb = types.SimpleNamespace(tok_row=tok_row, cu_q_lens=cu, start_pos=start, read_slot=read, write_slot=write,
                               fresh=fresh, snap_row=snap_row, snap_len=snap_len, snap_slot=snap_slot,
                               decode=decode, jrow=jrow, fold_len=fold)
    jsh = par.journal_shardings(H)
    j_in = tuple(jax.device_put(a, s) for a, s in zip(
        (jk, jeg, jdelta, _channels_rank_major(jraw, G)), jsh))

    def g(st, cv, jl):
        return par.kda_layer_on_pools(x["qkv"].reshape(T, 3, P), x["f"], x["beta"], x["gate"], cw, A_log, dt_bias,
                                      o_norm, st, cv, layer, fb, jnp.asarray(q_lens), journal=jl, **kw)

    cv_in = jax.device_put(np.asarray(conv_pool_rows(jnp.asarray(conv), G, d)), sh["kda_conv"])
    o, st2, cv2, jl2 = jax.jit(g)(jax.device_put(state, sh["kda_state"]), cv_in, j_in)
    got = [o, st2, conv_pool_logical(cv2, G, W - 1, H), *jl2[:3], _channels_rank_major(np.asarray(jl2[3]), G, back=True)]
    rel = lambda a, b: float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())  # noqa: E731
    assert not np.allclose(want[3], jk)  # the journal was written
    return max(rel(a, b) for a, b in zip(got, want))


def main():
    root, spec = sys.argv[1], json.loads(sys.argv[2])
    path = checkpoint(root)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, n).tolist() for n in spec["lengths"]]
    out, t0 = {}, time.perf_counter()
    out["reference"] = greedy(load_pretrained(path, kernels="reference"), None, prompts, spec["new_tokens"])
    for name, recipe in spec["recipes"].items():
        # loaded straight into the recipe's shards: the kernel's repack keeps each placement
        r = Recipe.parse(recipe)
        mesh = build_mesh(r, jax.devices()[: r.devices])
        pal = load_pretrained(path, kernels="pallas-interpret", placement=placement_for(mesh))
        leaves = jax.tree.leaves(pal.params)
        kept = all(a is b for a, b in zip(leaves, jax.tree.leaves(shard_params(pal.params, mesh))))
        out[name] = dict(greedy(pal, recipe, prompts, spec["new_tokens"]), placement_kept=kept)
        print(f"{time.perf_counter() - t0:.1f}s", name, out[name], file=sys.stderr, flush=True)
    out["ragged_gmm_err"] = ragged_gmm_error(spec["ragged_recipe"])
    out["kda_pools_err"] = kda_pools_error(spec["ragged_recipe"])
    out["kda_spec_pools_err"] = kda_spec_pools_error(spec["ragged_recipe"])
    print(f"{time.perf_counter() - t0:.1f}s ragged", out["ragged_gmm_err"], file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
