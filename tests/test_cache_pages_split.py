"""The cache's page and slot programs on pools split over devices (``cache.device_ops``): a
copy, a read and a load give what they give on one device, each device reading and writing
only its own rows (a page load zeroes the positions past the prompt). Pages over DCP and
attention DP; KDA state slots over the DP groups with the heads over the group's ranks.

Why: indexed on the global pool, XLA's partitioner copied the whole pool for a one-page copy
or load (K3 under v7-32-decode: 15 GiB of temporaries per device, ``k3serve compile``). The
per-device versions must change nothing else. One subprocess with 8 virtual CPU devices.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from k3serve.server.engine.cache import device_ops as d

    L, pages, ps, W = 3, 32, 4, 8
    rng = np.random.default_rng(0)
    kv = rng.normal(size=(L, pages, ps, W)).astype(np.float32)
    out = {}
    for name, shape, axes in (("dcp8", (1, 8, 1), ("ep", "tp")), ("dp2xdcp4", (2, 2, 2), ("dp", "ep", "tp"))):
        mesh = Mesh(np.asarray(jax.devices()).reshape(shape), ("dp", "ep", "tp"))
        placed = jax.device_put(kv, NamedSharding(mesh, P(None, axes, None, None)))
        split = d.split_of(placed)
        src = jnp.asarray([3, 17, 30, 3], jnp.int32)
        dst = jnp.asarray([9, 0, 31, 9], jnp.int32)
        read = jax.jit(lambda kv, i: d._read_rows(kv, i, split))(placed, src)
        copied = jax.jit(lambda kv, s, t: d._write_rows(kv, t, d._read_rows(kv, s, split), split))(placed, src, dst)
        rows = rng.normal(size=(L, 4, ps, W)).astype(np.float32)
        idx = jnp.asarray([5, pages, 26, 12], jnp.int32)  # `pages`: padding, dropped
        keep = np.ones((4, ps), bool); keep[2, 1:] = False  # a prompt ending inside page 26
        loaded = jax.jit(lambda kv, i, r, k: d._write_rows(kv, i, r, split, k))(placed, idx, rows, keep)
        want_copy = kv.copy(); want_copy[:, np.asarray(dst)] = kv[:, np.asarray(src)]
        want_load = kv.copy(); want_load[:, [5, 26, 12]] = np.where(keep[None, [0, 2, 3], :, None], rows[:, [0, 2, 3]], 0)
        out[name] = {"split": list(split[2]), "read": bool(np.array_equal(np.asarray(read), kv[:, np.asarray(src)])),
                     "copy": bool(np.array_equal(np.asarray(copied), want_copy)),
                     "load": bool(np.array_equal(np.asarray(loaded), want_load)),
                     "kept": str(copied.sharding.spec) == str(placed.sharding.spec)}
    # a KDA state pool [L, slots, H, d, d]: slots over the DP groups, heads over the group's ranks
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2, 2), ("dp", "ep", "tp"))
    st = rng.normal(size=(L, 6, 4, 2, 2)).astype(np.float32)
    placed = jax.device_put(st, NamedSharding(mesh, P(None, "dp", ("ep", "tp"), None, None)))
    split = d.split_of(placed)
    src, dst = jnp.asarray([4, 1], jnp.int32), jnp.asarray([0, 5], jnp.int32)  # across the two groups
    copied = jax.jit(lambda p, s, t: d._write_rows(p, t, d._read_rows(p, s, split), split))(placed, src, dst)
    want = st.copy(); want[:, [0, 5]] = st[:, [4, 1]]
    new_rows = rng.normal(size=(L, 1, 4, 2, 2)).astype(np.float32)
    wrote = jax.jit(lambda p, i, r: d._write_rows(p, i, r, split))(placed, jnp.asarray([3], jnp.int32), new_rows)
    want_w = st.copy(); want_w[:, 3] = new_rows[:, 0]
    out["slots_dp2"] = {"split": list(split[2]), "read": bool(np.array_equal(
                            np.asarray(jax.jit(lambda p, i: d._read_rows(p, i, split))(placed, src)), st[:, [4, 1]])),
                        "copy": bool(np.array_equal(np.asarray(copied), want)),
                        "load": bool(np.array_equal(np.asarray(wrote), want_w)),
                        "kept": str(copied.sharding.spec) == str(placed.sharding.spec)}
    whole = jax.device_put(kv, jax.devices()[0])
    out["unsplit"] = d.split_of(whole) is None
    print(json.dumps(out))
''')


def test_page_programs_per_device_equal_the_global_ones():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res.pop("unsplit") is True
    assert res["dcp8"]["split"] == ["ep", "tp"] and res["dp2xdcp4"]["split"] == ["dp", "ep", "tp"]
    assert res["slots_dp2"]["split"] == ["dp"]
    for name, c in res.items():
        assert c == {**c, "read": True, "copy": True, "load": True, "kept": True}, (name, c)
