"""Child-process body for ``test_pd_multiprocess.py``: the P/D data plane between engines
whose caches span two processes (issue #36), process ``I`` of 2 (``jax.distributed`` on
loopback, gloo), 4 virtual CPU devices each, 8 global devices.

Both processes build the same engines from the same arguments and drive them the same way
(the multi-controller model: each process runs the same scheduler on the same requests, so
they launch the same programs in the same order): ``dp2`` (``ep=4,tp=2,dp=2,dcp=2`` on all 8
devices) and ``dcp4`` (``ep=4,tp=1,dcp=4`` on devices 0, 1 of each process). For each pair of
the spec, the prefill engine computes each prompt with ``export=True``: the export is whole on
every device (``CacheManager.export_request`` under multi-host), each process cuts only the
pieces staged from its own devices (``deal.cut_local_pieces``) and stages each once per
decode process that pulls it, on its own transfer server; each decode process pulls only
the pieces its devices need, straight from the process that staged them, puts its part of
the load's inputs together and the engine writes them into the reservation. The decode's
greedy tokens and logprobs must equal a one-device engine's (each process runs one on its
first device); every page and slot ends free on both sides. Prints one JSON line: per pair
the largest logprob gap (inf when tokens differ), the bytes this process staged and pulled.

    python _pd_multiprocess_check.py ROOT PORT I SPEC
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import zlib

root, port, pid, spec = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
os.environ["XLA_FLAGS"] = " ".join([f for f in os.environ.get("XLA_FLAGS", "").split()
                                    if "device_count" not in f] + ["--xla_force_host_platform_device_count=4"])

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _pd_layout_check import KW, PARAMS, checkpoint, logprob_gap  # noqa: E402
from _util import assert_all_free, run_to_end  # noqa: E402

from k3serve.checkpoints import load_pretrained  # noqa: E402
from k3serve.server.engine.cache.deal import cut_local_pieces, piece_devices, pull_uuid  # noqa: E402
from k3serve.server.engine.engine import Engine  # noqa: E402
from k3serve.server.engine.handoff import Handoff  # noqa: E402
from k3serve.server.engine.llm import recipe_placement  # noqa: E402
from k3serve.server.pd.transfer import TransferEndpoint, wait_ready  # noqa: E402

PARAMS = dataclasses.replace(PARAMS, seed=5)  # an unseeded request draws its seed in each process
G = jax.devices()
ENGINES = {"dp2": ("ep=4,tp=2,dp=2,dcp=2", G), "dcp4": ("ep=4,tp=1,dcp=4", [G[0], G[1], G[4], G[5]])}
from k3serve.server.cluster.runtime import distributed_store  # noqa: E402

_kv = distributed_store()


def exchange(name: str, value: str) -> list[str]:
    """``value`` of every process under ``name`` (the coordination service's key-value store)."""
    _kv.key_value_set(f"k3test/{name}/{pid}", value)
    return [_kv.blocking_key_value_get(f"k3test/{name}/{p}", 60_000) for p in range(2)]


def engine(path: str, name: str) -> Engine:
    recipe, devs = ENGINES[name]
    return Engine(load_pretrained(path, placement=recipe_placement(path, recipe, devs)), recipe=recipe,
                  devices=devs, async_scheduling=False, **KW)  # plans that never depend on timing


def handoff(pre: Engine, dec: Engine, ids, rid: str, end: TransferEndpoint, peers: list[str]):
    out = run_to_end(pre, [pre.admit(ids, PARAMS, rid=rid, export=True)])[0]
    h = out.handoff
    reserved = []
    dec.admit_prefilled(ids, PARAMS, rid=rid, on_reserved=reserved.append)
    while not reserved:
        dec.step()
    target = dec.cache_mgr.handoff_target(rid, len(ids))
    pre_devices = list(pre.cache_mgr.device_cache.mla_kv.sharding.mesh.devices.flat)
    uuid = zlib.crc32(rid.encode()) << 20  # the same on both processes
    # prefill: cut and stage this process's pieces, once per decode process that pulls each
    mine = cut_local_pieces(h.arrays, target.dest, pre_devices)
    staged = 0
    for i, piece in mine.items():
        for k in range(target.dest.num_pulls(i)):
            end.stage(pull_uuid(uuid, i, k), [piece], 30)
        staged += int(piece.nbytes) * target.dest.num_pulls(i)
    owner = [d.process_index for d in piece_devices(target.dest, pre_devices)]
    # decode: pull what this process's devices need, from the process that staged it
    readers, where = target.readers(), target.local_pull_devices()
    specs = [(tuple(s), d) for s, d in zip(target.dest.piece_shapes(*[a.shape for a in h.arrays]),
                                             [h.arrays[1].dtype] + [h.arrays[0].dtype] * len(target.dest.head_starts)
                                             + [h.arrays[2].dtype] * len(target.dest.sent_ranks))]
    got = {}
    for i, dev in enumerate(where):
        if dev is None:
            continue
        got[i] = end.pull(peers[owner[i]], pull_uuid(uuid, i, readers[i].index(pid)), [specs[i]], devices=[dev])[0]
    assert wait_ready(list(got.values()), 60)
    pulled = sum(int(a.nbytes) for a in got.values())
    arrays = target.assemble(got)
    assert dec.deliver(rid, Handoff(h.prompt_len, h.first_token, h.logprob, h.cached_tokens, arrays, target.dest))
    return run_to_end(dec, [rid])[0], staged, pulled


def main():
    path = checkpoint(os.path.join(root, f"p{pid}"))
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 256, n).tolist() for n in spec["lengths"]]
    local = jax.local_devices()[0]
    one = Engine(load_pretrained(path, placement=lambda p, s: jax.sharding.SingleDeviceSharding(local)),
                 devices=[local], **KW)
    want = run_to_end(one, [one.add_request(p, PARAMS) for p in prompts])
    end = TransferEndpoint(device=local)
    peers = exchange("transfer", end.address)
    engines, res = {}, {}
    for pair in spec["pairs"]:
        a, b = pair.split(">")
        for n in (a, b):
            if n not in engines:
                engines[n] = engine(path, n)
        t = time.perf_counter()
        got, staged, pulled = zip(*[handoff(engines[a], engines[b], p, f"{pair}/{i}", end, peers)
                                    for i, p in enumerate(prompts)])
        assert_all_free(engines[a]), assert_all_free(engines[b])
        res[pair] = {"gap": max(logprob_gap(g, w) for g, w in zip(got, want)), "staged": list(staged),
                     "pulled": list(pulled), "s": round(time.perf_counter() - t, 1)}
        print(pid, pair, res[pair], file=sys.stderr, flush=True)
    print(json.dumps({"process": pid, **res}), flush=True)


if __name__ == "__main__":
    main()
