"""Child-process body for ``test_pd_layouts.py`` (run with 8 virtual CPU devices): P/D
handoffs between engines of different layouts in one process, through the transfer server.

A tiny K3 with 8 KDA and MLA heads and 8 experts. Engines: ``one`` (one device, no recipe),
``dcp4a`` and ``dcp4b`` (``ep=4,tp=1,dcp=4`` on devices 0-3 and 4-7), ``dp2`` (``ep=4,tp=2,
dp=2,dcp=2`` on all 8). For each pair in the spec the prefill engine computes each prompt
with ``export=True``; the pieces the decode's reservation asks for (``handoff_target``) are
cut on the prefill's devices, staged on one transfer server and pulled by another onto the
decode's devices, put together there and delivered. The decode's greedy tokens and their
logprobs must equal the one-device engine's; both sides end with every page and slot free.
Mutations — the rows pieces of two DCP ranks swapped, two KDA-state pieces swapped — must
change them. Prints one JSON line (``gap``: the largest logprob difference, inf when the
tokens differ). With ``second_turn`` a second turn of the longest prompt goes the same way
to a decode with prefix caching on, which must ask only for the pages past its cached prefix."""
from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import assert_all_free, run_to_end  # noqa: E402

from k3serve.checkpoints.synthetic import generate_checkpoint, k3_config  # noqa: E402
from k3serve.checkpoints import load_pretrained  # noqa: E402
from k3serve.server.engine.cache.deal import cut_pieces  # noqa: E402
from k3serve.server.engine.engine import Engine  # noqa: E402
from k3serve.server.engine.handoff import Handoff  # noqa: E402
from k3serve.server.engine.sampling_params import SamplingParams  # noqa: E402
from k3serve.server.pd.transfer import TransferEndpoint, wait_ready  # noqa: E402

ENGINES = {"one": (None, [0]), "dcp4a": ("ep=4,tp=1,dcp=4", range(4)), "dcp4b": ("ep=4,tp=1,dcp=4", range(4, 8)),
           "dp2": ("ep=4,tp=2,dp=2,dcp=2", range(8))}
PREFIX = {"dcp4a"}  # engines with prefix caching on (the decode-side hit of a second turn)
KW = dict(max_num_seqs=2, max_num_batched_tokens=16, chunk_size=8, page_size=4, max_model_len=64, num_pages=32,
          warmup=False, enable_prefix_caching=False)
NEW = 5


def checkpoint(root: str) -> str:
    cfg = k3_config(vocab_size=256, hidden_size=96, num_hidden_layers=2, full_attn_layers=[2], kda_num_heads=8,
                    kda_head_dim=16, mla_heads=8, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=8, v_head_dim=8, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
                    moe_intermediate_size=32, routed_expert_hidden_size=32, intermediate_size=64, attn_res_block_size=2)
    return str(generate_checkpoint(os.path.join(root, f"h8e8-{os.getpid()}"), cfg, seed=3))


def engine(path: str, name: str) -> Engine:
    recipe, devs = ENGINES[name]
    devices = [jax.devices()[i] for i in devs]
    kw = dict(KW, enable_prefix_caching=name in PREFIX)
    return Engine(load_pretrained(path), recipe=recipe, devices=devices, **kw) if recipe \
        else Engine(load_pretrained(path), **kw)


FIRST_PAGE: dict = {}  # request id -> pages its decode held already (prefix cache)
PARAMS = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True, logprobs=1)


def handoff(pre: Engine, dec: Engine, ids, rid: str, ends, mutate: str | None = None):
    """One request from ``pre`` to ``dec`` through the transfer servers ``ends``: its output
    and the bytes staged. ``mutate``: "rows" swaps the rows pieces of DCP ranks 0 and 1,
    "state" the first two KDA-state pieces."""
    params = PARAMS
    out = run_to_end(pre, [pre.admit(ids, params, rid=rid, export=True)])[0]
    h = out.handoff
    reserved = []
    dec.admit_prefilled(ids, params, rid=rid, on_reserved=reserved.append)
    while not reserved:
        dec.step()
    target = dec.cache_mgr.handoff_target(rid, len(ids))
    FIRST_PAGE[rid] = target.dest.first_page
    pre_devices = sorted(pre.cache_mgr.device_cache.mla_kv.sharding.device_set, key=lambda d: d.id)
    pieces = cut_pieces(h.arrays, target.dest, pre_devices)
    if mutate:
        k = 1 + len(target.dest.head_starts) if mutate == "rows" else 1  # ranks 0 and 1 hold pages here
        pieces[k], pieces[k + 1] = pieces[k + 1], pieces[k]
    src, dst = ends
    uuid = int(time.time_ns() % (1 << 62))
    src.stage(uuid, pieces, 30)
    got = dst.pull(src.address, uuid, [(p.shape, p.dtype) for p in pieces], devices=target.pull_devices())
    assert wait_ready(got, 30)
    arrays = target.assemble(got)
    assert dec.deliver(rid, Handoff(h.prompt_len, h.first_token, h.logprob, h.cached_tokens, arrays, target.dest))
    return run_to_end(dec, [rid])[0], sum(int(p.nbytes) for p in pieces)


def logprob_gap(a, b) -> float:
    """Largest difference of the chosen tokens' logprobs (inf if the tokens differ)."""
    if list(a.token_ids) != list(b.token_ids):
        return float("inf")
    return max(abs(x[0] - y[0]) for x, y in zip(a.logprobs, b.logprobs))


def main():
    root, spec = sys.argv[1], json.loads(sys.argv[2])
    path = checkpoint(root)
    rng = np.random.default_rng(11)
    # a prompt inside one page, one ending on a page boundary, one over many pages
    prompts = [rng.integers(0, 256, n).tolist() for n in spec["lengths"]]
    one = engine(path, "one")
    want = run_to_end(one, [one.add_request(p, PARAMS) for p in prompts])
    engines = {"one": one}
    ends = (TransferEndpoint(), TransferEndpoint())
    res = {}
    for pair in spec["pairs"]:
        a, b = pair.split(">")
        for n in (a, b):
            if n not in engines:
                engines[n] = engine(path, n)
        t = time.perf_counter()
        got, nbytes = zip(*[handoff(engines[a], engines[b], p, f"{pair}/{i}", ends) for i, p in enumerate(prompts)])
        assert_all_free(engines[a]), assert_all_free(engines[b])
        res[pair] = {"gap": max(logprob_gap(g, w) for g, w in zip(got, want)), "bytes": list(nbytes),
                     "s": round(time.perf_counter() - t, 1)}
        print(pair, res[pair], file=sys.stderr, flush=True)
    for what, pair in spec.get("mutate", []):
        a, b = pair.split(">")
        got, _ = handoff(engines[a], engines[b], prompts[-1], f"m/{what}/{pair}", ends, mutate=what)
        assert_all_free(engines[a]), assert_all_free(engines[b])
        res[f"mutated:{what}:{pair}"] = {"gap": logprob_gap(got, want[-1])}
    if "second_turn" in spec:  # the third prompt's next turn: the decode maps its cached prefix
        a, b = spec["second_turn"].split(">")
        ids = prompts[-1] + list(want[-1].token_ids) + [1, 2, 3, 4, 5]
        ref = run_to_end(one, [one.add_request(ids, PARAMS)])[0]
        handoff(engines[a], engines[b], prompts[-1], "turn1", ends)  # (assert_all_free flushed the caches)
        got, nbytes = handoff(engines[a], engines[b], ids, "turn2", ends)
        assert_all_free(engines[a]), assert_all_free(engines[b])
        res["turn2:" + spec["second_turn"]] = {"gap": logprob_gap(got, ref), "first_page": FIRST_PAGE["turn2"],
                                               "bytes": nbytes}
    if "grpc" in spec:
        res["grpc:" + spec["grpc"]] = through_grpc(engines, spec["grpc"], prompts[-1], want[-1])
    print(json.dumps(res))


def through_grpc(engines, pair: str, ids, want) -> dict:
    """One request through a prefill and a decode gRPC server on these engines, the test in
    smg's place (the same GenerateRequest to both legs at once): the destination travels in
    ``AwaitHandoff``, the pieces through the servers' own transfer endpoints."""
    import threading

    import grpc
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as spb
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as spb_grpc

    from _util import collect_generate
    from k3serve.server.api.engine_thread import EngineThread
    from k3serve.server.api.grpc_service import GrpcServer, Servicer
    from k3serve.server.pd.decode import DecodeSide
    from k3serve.server.pd.prefill import PrefillSide

    a, b = pair.split(">")
    servers, box = {}, {}
    try:
        for role, name in (("prefill", a), ("decode", b)):
            loop = EngineThread(engines[name])
            servicer = Servicer()
            server = GrpcServer(servicer, host="127.0.0.1", port=0)
            if role == "prefill":
                side = servicer.pd_prefill = PrefillSide(loop.engine, host="127.0.0.1", bootstrap_port=0, stage_s=20)
                port = side.port
            else:
                side = servicer.pd_decode = DecodeSide(loop.engine, await_s=60, transfer_s=20)
            server.set_ready(loop)
            servers[role] = (server, side, loop, grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        req = spb.GenerateRequest(request_id="g1", tokenized=spb.TokenizedInput(input_ids=ids), stream=True,
                                  sampling_params=spb.SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True))
        req.disaggregated_params.CopyFrom(spb.DisaggregatedParams(bootstrap_host="127.0.0.1", bootstrap_port=port,
                                                                  bootstrap_room=7))

        def leg(role):
            box[role] = collect_generate(spb_grpc.SglangSchedulerStub(servers[role][3]), req)

        ts = [threading.Thread(target=leg, args=(r,)) for r in ("decode", "prefill")]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        chunks, complete = box["decode"]
        got = [t for c in chunks for t in c.token_ids]
        for role in servers:
            servers[role][2].call(assert_all_free, timeout=30)
        return {"equal": got == list(want.token_ids), "got": got, "bytes": servers["decode"][1].bytes_received}
    finally:
        for server, side, loop, ch in servers.values():
            ch.close()
            server.shutdown(grace_s=5)
            side.stop()


if __name__ == "__main__":
    main()
