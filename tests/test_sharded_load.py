"""Parameters loaded straight into their shards (``load_pretrained(..., placement=...)``): every
parameter lands on its ``param_spec`` sharding, each device holds exactly its slice, no whole
sharded parameter is ever put on one device, the values are bit for bit a plain load's (so
the logits are the sharded step's, which test_sharding checks against one device), and the
engine keeps the placed parameters where they are. One subprocess (the device count is fixed at jax
import)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from _util import DATA

SCRIPT = textwrap.dedent('''
    import gc, json, math, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
    from k3serve.checkpoints import load_pretrained
    from k3serve.model.config import K3Config
    from k3serve.checkpoints.safetensors_io import open_checkpoint
    from k3serve.server.engine.engine import Engine
    from k3serve.sharding.mesh import _path_str, build_mesh, param_spec, placement_for, shard_params
    from k3serve.sharding.recipe import PRESETS

    case = sys.argv[1]
    with open_checkpoint(case) as ck:
        cfg = K3Config.from_dict(ck.config)
    mesh = build_mesh(PRESETS["test-8-dp2"].validate(cfg, num_devices=8), jax.devices())
    mshape, ndev = dict(mesh.shape), mesh.size

    # every array that jnp.asarray / jnp.array / jax.device_put puts on one device during a load
    single, on = [], [False]
    def recording(fn):
        def wrapper(*a, **k):
            r = fn(*a, **k)
            if (on[0] and isinstance(r, jax.Array) and not isinstance(r, jax.core.Tracer)
                    and len(r.sharding.device_set) == 1):
                single.append((tuple(r.shape), str(r.dtype)))
            return r
        return wrapper
    jnp.asarray, jnp.array, jax.device_put = (recording(jnp.asarray), recording(jnp.array),
                                              recording(jax.device_put))

    asked = []
    place = placement_for(mesh)
    def placement(path, shape):
        asked.append(path)
        return place(path, shape)

    on[0] = True
    m = load_pretrained(case, placement=placement)
    on[0] = False
    during_load = list(single)
    gc.collect()
    live_single = [(tuple(a.shape), str(a.dtype)) for a in jax.live_arrays()
                   if isinstance(a.sharding, SingleDeviceSharding)]

    leaves = jax.tree_util.tree_flatten_with_path(m.params)[0]
    paths = [_path_str(kp) for kp, _ in leaves]
    bad_sharding, bad_slices, sharded = [], [], {}
    for path, (_, x) in zip(paths, leaves):
        spec = param_spec(path, tuple(x.shape), mshape)
        if x.sharding != NamedSharding(mesh, PartitionSpec(*spec)):
            bad_sharding.append(path)
        if all(s is None for s in spec):
            continue
        sharded[path] = (tuple(x.shape), str(x.dtype))
        used = [a for s in spec if s is not None for a in ((s,) if isinstance(s, str) else s)]
        replication = ndev // math.prod(mshape[a] for a in used)
        shards = x.addressable_shards
        if (len(shards) != ndev or any(tuple(s.data.shape) == tuple(x.shape) for s in shards)
                or sum(s.data.nbytes for s in shards) != x.nbytes * replication):
            bad_slices.append(path)
    full = set(sharded.values())

    # the engine (shard_params on the same mesh) keeps the placed parameters as they are
    before = [x for _, x in leaves]
    kept = all(a is b for a, b in zip(jax.tree_util.tree_leaves(shard_params(m.params, mesh)), before))
    Engine(m, max_num_seqs=1, max_num_batched_tokens=16, chunk_size=16, page_size=16, max_model_len=32,
           warmup=False, recipe="test-8-dp2")
    kept_engine = all(a is b for a, b in zip(jax.tree_util.tree_leaves(m.params), before))

    single.clear()
    on[0] = True
    ref_model = load_pretrained(case)  # the plain load: also shows the recorder sees whole parameters
    on[0] = False
    control = sum(1 for s in single if s in full)
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree_util.tree_leaves(m.params), jax.tree_util.tree_leaves(ref_model.params)))
    print(json.dumps({
        "num_params": len(paths), "num_sharded": len(sharded), "asked_sorted": sorted(asked),
        "paths_sorted": sorted(paths), "bad_sharding": bad_sharding, "bad_slices": bad_slices,
        "single_during_load": len(during_load),
        "full_during_load": [list(s) for s in during_load if s in full],
        "full_live": [list(s) for s in live_single if s in full], "control": control,
        "kept": kept, "kept_engine": kept_engine, "same_values": same}))
''')


def test_load_straight_into_shards(tmp_path):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    child = subprocess.Popen([sys.executable, "-c", SCRIPT, str(DATA / "k3-tiny-a"), "-"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = child.communicate(timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, stderr[-3000:]
    res = json.loads(stdout.strip().splitlines()[-1])
    print({k: v for k, v in res.items() if not k.endswith("_sorted")})
    # placement is asked once per parameter, by the same path sharding.mesh derives from the state
    assert res["asked_sorted"] == res["paths_sorted"]
    assert res["num_sharded"] > 0 and res["num_sharded"] < res["num_params"]
    assert res["bad_sharding"] == []  # (a) every parameter on its param_spec sharding
    assert res["bad_slices"] == []  # (b) each device holds exactly its slice
    assert res["full_during_load"] == [] and res["full_live"] == []  # (c) never whole on one device
    assert res["control"] > 0  # ...which the recorder would have seen (the plain load shows it)
    assert res["kept"] and res["kept_engine"]  # the engine does not move them again
    assert res["same_values"]  # bit for bit the plain load's parameters
