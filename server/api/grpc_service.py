"""The gRPC front: SGLang's scheduler protocol (as the ``smg`` router speaks it), standard
health, server reflection, optional API key and TLS.

Wire format: ``sglang.grpc.scheduler.SglangScheduler`` from the pinned PyPI
``smg-grpc-proto`` stubs. Implemented: ``Generate`` (server streaming; ``stream=false`` sends
only the final ``GenerateComplete``), ``Abort``, ``HealthCheck``, ``GetModelInfo``,
``GetServerInfo``, ``GetLoads``, ``GetTokenizer`` (zip bundle of the checkpoint's tokenizer
files + config.json, sha256 on the last chunk), ``FlushCache`` (drops the prefix cache) and
``SubscribeKvEvents`` (the prefix cache's stored/removed blocks, for the admin key only when
the server has keys; FAILED_PRECONDITION when prefix caching is off). ``Embed``, ``StartProfile``, ``StopProfile`` and the three LoRA RPCs
answer UNIMPLEMENTED with a message.

Proto3 cannot tell "absent" from zero, so zero means "default" where zero is not a
meaningful value: ``top_p`` 0 → 1.0, ``top_k`` 0 → off, ``repetition_penalty`` 0 → 1.0,
``n`` 0 → 1. ``temperature`` 0 is greedy. An absent ``max_new_tokens`` means "up to the
context": ``max_model_len - len(prompt)``. The proto has no seed: ``custom_params`` ``{"seed":
N}`` seeds a request's sampling (same seed, same tokens, whatever the batch).

Errors are gRPC statuses with a message, and a refused request changes nothing in the
engine: INVALID_ARGUMENT (malformed or unsupported parameters, duplicate request id in
flight), OUT_OF_RANGE (token ids outside the vocabulary, prompt or max_new_tokens beyond the
context), RESOURCE_EXHAUSTED (a request that cannot fit the KV budget even alone; messages
larger than the configured limit), UNAVAILABLE (not ready yet, or shutting down),
UNAUTHENTICATED (missing / wrong API key). A client that cancels or whose deadline passes
has its request aborted in the engine, which frees its pages and slot. A failed engine step
fails every request in flight with INTERNAL (and the message) and turns health NOT_SERVING.
"""
from __future__ import annotations

import hashlib
import io
import math
import time
import uuid
import zipfile
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf import struct_pb2, timestamp_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from ..engine.request import RequestError
from ..pd.prefill import HandoffError
from .auth import ApiKeyInterceptor
from .worker_info import EnginePlan, checkpoint_config, planned_disaggregation
from ..engine.sampling_params import SamplingParams

LOADING = "k3serve is still loading the model (health NOT_SERVING until its warm-up ends)"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SglangScheduler"].full_name
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model",
                   "special_tokens_map.json", "generation_config.json", "config.json")
VERSION = "k3serve-0.1.0"


def _status(code: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, code, grpc.StatusCode.INVALID_ARGUMENT)


class BadRequest(RequestError):
    pass


# What one request may ask for. The engine thread checks every stop string and stop id on every
# generated token, so their number and size bound how long one request can hold up everyone's step.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_CHARS = 256
MAX_SEED = 2**53  # |seed|: custom_params numbers are doubles, exact up to here


def check_request(req: "pb.GenerateRequest", *, dp_size: int) -> None:
    """Request-level fields ``sampling_from_proto`` does not map; BadRequest for what we refuse."""
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise BadRequest(f"request_id has {len(req.request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
    if req.HasField("data_parallel_rank") and not 0 <= req.data_parallel_rank < dp_size:
        raise BadRequest(f"data_parallel_rank {req.data_parallel_rank} is not in [0, {dp_size}) "
                         f"(this engine's data-parallel size is {dp_size})")


def sampling_from_proto(req: "pb.GenerateRequest", *, max_model_len: int, has_detokenizer: bool) -> SamplingParams:
    """Map a GenerateRequest's sampling options to ours; raise BadRequest for what we refuse."""
    sp = req.sampling_params
    has_sp = req.HasField("sampling_params")
    n_prompt = len(req.tokenized.input_ids)
    if has_sp:
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(sp, name)):
                raise BadRequest(f"{name} must be a finite number, got {getattr(sp, name)}")
        if sp.temperature < 0:
            raise BadRequest(f"temperature must be >= 0, got {sp.temperature}")
        if not 0 <= sp.top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {sp.top_p}")
        if sp.top_k < -1:
            raise BadRequest(f"top_k must be -1 (off) or >= 1, got {sp.top_k}")
        if len(sp.stop) > MAX_STOP_STRINGS:
            raise BadRequest(f"{len(sp.stop)} stop strings; at most {MAX_STOP_STRINGS}")
        if any(len(s) > MAX_STOP_CHARS for s in sp.stop):
            raise BadRequest(f"a stop string has {max(map(len, sp.stop))} characters; at most {MAX_STOP_CHARS}")
        if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise BadRequest(f"{len(sp.stop_token_ids)} stop_token_ids; at most {MAX_STOP_TOKEN_IDS}")
        if sp.stop and not has_detokenizer:
            raise BadRequest("stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)")
    if sp.HasField("max_new_tokens"):
        max_new = int(sp.max_new_tokens)
        if max_new <= 0:
            raise BadRequest(f"max_new_tokens must be >= 1, got {max_new}")
    else:
        max_new = max(1, max_model_len - n_prompt)
    logprobs = None
    if req.return_logprob:
        logprobs = int(req.top_logprobs_num)
        if logprobs < 0:
            raise BadRequest(f"top_logprobs_num must be >= 0, got {logprobs}")
    if req.mm_inputs.ByteSize() or len(req.input_embeds):
        raise BadRequest("multimodal inputs and input embeddings are not supported")
    if req.lora_id:
        raise BadRequest(f"LoRA adapter {req.lora_id!r} is not loaded (no LoRA support)")
    if req.custom_logit_processor:
        raise BadRequest("custom logit processors are not supported")
    if req.return_hidden_states:
        raise BadRequest("return_hidden_states is not supported")
    constraint = {}
    kind = sp.WhichOneof("constraint") if has_sp else None
    if kind:  # compiled when the engine validates the request (this thread, not the engine's)
        constraint = {"ebnf" if kind == "ebnf_grammar" else kind: getattr(sp, kind)}
    bias = {}
    for key, value in (sp.logit_bias.items() if has_sp else ()):
        try:
            tid = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}") from None
        if tid < 0:
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}")
        bias[tid] = float(value)
    seed = None
    if sp.HasField("custom_params"):  # the proto has no seed field: {"seed": N} (or "sampling_seed")
        extra = dict(sp.custom_params.items())
        unknown = sorted(set(extra) - {"seed", "sampling_seed"})
        if unknown:
            raise BadRequest(f"unsupported custom_params {unknown} (supported: seed)")
        raw = extra.get("seed", extra.get("sampling_seed"))
        if raw is not None:
            if not isinstance(raw, float) or not math.isfinite(raw) or raw != int(raw):
                raise BadRequest(f"custom_params seed must be an integer, got {raw!r}")
            if abs(raw) > MAX_SEED:
                raise BadRequest(f"custom_params seed {raw:.0f} is out of range (|seed| <= 2**53)")
            seed = int(raw)
    try:
        params = SamplingParams(
            max_new_tokens=max_new,
            temperature=float(sp.temperature),
            top_p=float(sp.top_p) if sp.top_p > 0 else 1.0,
            top_k=int(sp.top_k) if sp.top_k > 0 else -1,
            min_p=float(sp.min_p),
            frequency_penalty=float(sp.frequency_penalty),
            presence_penalty=float(sp.presence_penalty),
            repetition_penalty=float(sp.repetition_penalty) if sp.repetition_penalty != 0 else 1.0,
            stop=list(sp.stop),
            stop_token_ids=[int(t) for t in sp.stop_token_ids],
            ignore_eos=bool(sp.ignore_eos),
            min_new_tokens=int(sp.min_new_tokens),
            logprobs=logprobs,
            seed=seed,
            logit_bias=bias or None,
            token_ids_logprob=[int(t) for t in req.token_ids_logprob],
            n=int(sp.n) if has_sp and sp.n > 0 else 1,
            **constraint,
        )
    except ValueError as e:
        raise BadRequest(str(e)) from None
    # the engine only tests membership (per token) and iterates them: a set after validation
    params.stop_token_ids = frozenset(params.stop_token_ids)
    return params


def _struct(d: dict) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(d)
    return s


def tokenizer_bundle(model_dir: Path | None) -> bytes:
    """A zip of the checkpoint's tokenizer files and config.json (what smg's GetTokenizer wants)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        if model_dir is not None:
            for name in TOKENIZER_FILES:
                p = Path(model_dir) / name
                if p.is_file():
                    z.write(p, name)
    return buf.getvalue()


class Servicer(pb_grpc.SglangSchedulerServicer):
    """Holds an ``EngineThread`` once the model is ready. Until then ``GetModelInfo`` and
    ``GetServerInfo`` answer from the checkpoint's config and ``plan`` (a router registers a
    worker from them once, maybe while it loads), the rest UNAVAILABLE."""

    def __init__(self, *, model_dir=None, served_model_name: str = "k3serve", metrics=None,
                 tokenizer=None, server_args: dict | None = None, plan: EnginePlan | None = None,
                 role: str = "unified", bootstrap_port: int | None = None):
        self.loop = None
        self.model_dir = Path(model_dir) if model_dir else None
        self.served_model_name = served_model_name
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.server_args = dict(server_args or {})
        self.start_time = time.time()
        self.last_receive = 0.0
        self._bundle: bytes | None = None
        self._raw_config: dict | None = None  # config.json, read once
        self.pd_prefill = None  # server.pd.prefill.PrefillSide on a prefill-role server
        self.pd_decode = None  # server.pd.decode.DecodeSide on a decode-role server
        # what GetModelInfo / GetServerInfo answer while loading (worker_info.py); None: UNAVAILABLE
        self.plan = plan
        self.planned_pd = planned_disaggregation(role, bootstrap_port)

    def set_ready(self, loop) -> None:
        self.loop = loop

    def _loop(self, context):
        loop = self.loop
        if loop is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, LOADING)
        if not loop.accepting:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        return loop

    # ------------------------------------------------------------------ generate
    def Generate(self, request, context):
        loop = self._loop(context)
        self.last_receive = time.time()
        eng = loop.engine
        rid = request.request_id or f"k3-{uuid.uuid4().hex}"
        dparams = request.disaggregated_params if request.HasField("disaggregated_params") else None
        prefill = self.pd_prefill if dparams is not None else None
        room = None
        try:
            check_request(request, dp_size=getattr(eng.recipe, "dp", 1) or 1)
            params = sampling_from_proto(request, max_model_len=eng.max_model_len,
                                         has_detokenizer=eng.detokenize is not None)
            md = dict(context.invocation_metadata() or ())
            key = md.get("authorization", "")
            ids = list(request.tokenized.input_ids)
            kw = dict(rid=rid, cache_salt=md.get("x-cache-salt") or None, api_key=key.removeprefix("Bearer ") or None)
            if params.n > 1 and dparams is not None:
                raise BadRequest(f"n={params.n} with prefill/decode disaggregation is not supported (n=1 only)")
            if params.n > 1:  # samples RID#0..n-1: the prefix cache computes the prompt once
                handle = loop.submit_n(ids, params, **kw)
            elif prefill is not None:  # P/D prefill: compute only once the decode has room for the result
                eng.validate(ids, params)
                room = prefill.wait_for_decode((dparams.bootstrap_room, rid), context)
                prefill.check_registration(room, ids)
                prefill.reserve_memory(room, ids, context)  # the staged handoff's bytes (--pd-handoff-memory-gb)
                handle = loop.submit(ids, params, export=True, **kw)
            elif dparams is not None and self.pd_decode is not None:  # P/D decode: continue from the handoff
                handle = self.pd_decode.submit(loop, ids, params, dparams=dparams, **kw)
            else:
                handle = loop.submit(ids, params, **kw)
        except RequestError as e:
            if prefill is not None:  # its decode, waiting or still to come, gets this error at once
                prefill.reject((dparams.bootstrap_room, rid), e)
            if self.metrics is not None:
                self.metrics.rejected(e.code)
            context.abort(_status(e.code), str(e))
        # cancel / deadline / disconnect: abort this handle (a no-op once it finished, so a
        # retry that reuses the id is never hit). False: the RPC already ended, abort now.
        if not context.add_callback(handle.abort):
            handle.abort()
        def on_final(out):  # P/D prefill: hand the cache over before the final answer
            if out.handoff is not None:
                prefill.publish(room, out, time.monotonic())
            else:
                prefill.rooms.fail(room.key, HandoffError("ABORTED", f"the prefill of {rid!r} was aborted"))
        try:
            yield from self._stream(handle, request, rid, params, on_final if room is not None else None)
        except RequestError as e:  # the engine failed under this request
            if room is not None:
                prefill.rooms.fail(room.key, e)
            context.abort(_status(e.code), str(e))
        finally:  # gRPC closed the generator (client gone) or anything raised: free the request
            handle.abort()
            if room is not None and not room.done.is_set():
                prefill.rooms.fail(room.key, HandoffError("ABORTED", f"the prefill of {rid!r} was cancelled"))

    def _stream(self, handle, request, rid, params, on_final=None):
        """The responses of ``handle`` (a ``RequestHandle``, or the ``HandleGroup`` of an n > 1
        request: chunks and completes carry the sample's ``index``)."""
        n_prompt = handle.num_prompt
        want_lp = params.logprobs is not None
        want_ids = bool(params.token_ids_logprob)
        sent_lp = {}  # sample index -> logprobs sent
        outputs = handle.outputs() if hasattr(handle, "handles") else ((0, o) for o in handle.outputs())
        for index, out in outputs:
            if request.stream and out.new_token_ids:
                chunk = pb.GenerateStreamChunk(token_ids=out.new_token_ids, prompt_tokens=n_prompt,
                                               completion_tokens=out.completion_tokens,
                                               cached_tokens=out.cached_tokens, index=index)
                if want_lp:
                    new_lp = getattr(out, "new_logprobs", None)
                    if new_lp is None:  # outputs that carry the whole list so far
                        new_lp = out.logprobs[sent_lp.get(index, 0):]
                    sent_lp[index] = sent_lp.get(index, 0) + len(new_lp)
                    chunk.output_logprobs.CopyFrom(_logprobs(new_lp, out.new_token_ids))
                if want_ids:
                    _id_logprobs(chunk.output_logprobs, out.new_id_logprobs or [])
                yield pb.GenerateResponse(request_id=rid, chunk=chunk)
            if out.finished:
                if on_final is not None:
                    on_final(out)
                done = pb.GenerateComplete(output_ids=out.token_ids, finish_reason=out.finish_reason or "abort",
                                           prompt_tokens=n_prompt, completion_tokens=out.completion_tokens,
                                           cached_tokens=out.cached_tokens,
                                           spec_draft_tokens=getattr(out, "spec_draft_tokens", 0),
                                           spec_accepted_tokens=getattr(out, "spec_accepted_tokens", 0),
                                           index=index)
                if isinstance(out.matched_stop, str):
                    done.matched_stop_str = out.matched_stop
                elif out.matched_stop is not None:
                    done.matched_token_id = int(out.matched_stop)
                if want_lp:
                    done.output_logprobs.CopyFrom(_logprobs(out.logprobs or [], out.token_ids))
                if want_ids:
                    _id_logprobs(done.output_logprobs, out.id_logprobs or [])
                yield pb.GenerateResponse(request_id=rid, complete=done)

    def Abort(self, request, context):
        loop = self.loop  # served while draining too: a router's aborts must land during the grace period
        if loop is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, LOADING)
        ok = loop.abort(request.request_id)
        return pb.AbortResponse(success=ok, message="aborted" if ok else f"no running request {request.request_id!r}")

    # ------------------------------------------------------------------ info
    def HealthCheck(self, request, context):
        loop = self.loop
        if loop is None:
            return pb.HealthCheckResponse(healthy=False, message="loading")
        if loop.error is not None:
            return pb.HealthCheckResponse(healthy=False, message=f"engine failed: {loop.error!r}")
        if not loop.accepting:
            return pb.HealthCheckResponse(healthy=False, message="shutting down")
        return pb.HealthCheckResponse(healthy=True, message="ok")

    def _engine_plan(self, context) -> EnginePlan:
        """The engine's limits: read from it once loaded, else as planned from the flags."""
        if self.loop is not None:
            return EnginePlan.of_engine(self.loop.engine)
        if self.plan is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, LOADING)
        return self.plan

    def _checkpoint_config(self) -> dict:
        if self._raw_config is None:
            self._raw_config = checkpoint_config(self.model_dir)
        return self._raw_config

    def GetModelInfo(self, request, context):
        """Answered while loading too (from the checkpoint's config): smg registers a worker
        with what it answers the first time."""
        plan = self._engine_plan(context)
        raw = self._checkpoint_config()
        if self.loop is not None:
            cfg = self.loop.engine.model.config
        elif raw:
            from ...model.config import K3Config

            cfg = K3Config.from_dict(raw)
        else:
            context.abort(grpc.StatusCode.UNAVAILABLE, LOADING + " (no config.json to describe it before)")
        eos = cfg.eos_token_id
        tok_dir = str(self.model_dir) if self.model_dir and any(
            (self.model_dir / f).is_file() for f in TOKENIZER_FILES[:4]) else ""
        return pb.GetModelInfoResponse(
            model_path=str(self.model_dir or ""), tokenizer_path=tok_dir, is_generation=True,
            served_model_name=self.served_model_name, max_context_length=plan.max_model_len,
            vocab_size=cfg.vocab_size, supports_vision=False, model_type=str(raw.get("model_type", cfg.family)),
            eos_token_ids=[eos] if eos is not None else [], pad_token_id=_int_or(cfg.pad_token_id, 0),
            bos_token_id=_int_or(cfg.bos_token_id, 0), max_req_input_len=plan.max_model_len - 1,
            architectures=list(raw.get("architectures", [])), weight_version="default",
        )

    def GetServerInfo(self, request, context):
        """Answered while loading too: the planned limits, role and bootstrap port; what only
        the loaded engine knows (KV size, mesh, compiles) is added once it is up."""
        plan = self._engine_plan(context)
        args = {"model_path": str(self.model_dir or ""), "served_model_name": self.served_model_name,
                **plan.server_args()}
        loop = self.loop
        ts = timestamp_pb2.Timestamp()
        ts.FromSeconds(int(self.start_time))
        common = dict(sglang_version=VERSION, server_type="grpc", start_time=ts,
                      uptime_seconds=time.time() - self.start_time, last_receive_timestamp=self.last_receive)
        if loop is None:
            args.update(self.planned_pd, **self.server_args)
            return pb.GetServerInfoResponse(server_args=_struct(args), is_paused=False, **common)
        st = loop.stats()
        eng = loop.engine
        args.update(max_total_num_tokens=st["max_tokens_in_kv"], **_mesh(eng), **self._disaggregation_args(),
                    **self.server_args)
        ps = eng.capacity_plan.page_size
        sched = {"num_pages": eng.capacity_plan.num_pages, "num_slots": eng.capacity_plan.num_slots,
                 "max_concurrent_slots": st["max_concurrent_slots"], "num_compiles": st["num_compiles"],
                 "warmup_s": round(st["warmup_s"], 3), "num_used_tokens": st["request_pages"] * ps,
                 "num_cached_tokens": st["evictable_pages"] * ps}
        return pb.GetServerInfoResponse(
            server_args=_struct(args), scheduler_info=_struct(sched), active_requests=st["active_requests"],
            is_paused=not loop.accepting, max_total_num_tokens=st["max_tokens_in_kv"], **common)

    def GetLoads(self, request, context):
        """From the engine thread's last snapshot. As SGLang: used = total - free - evictable
        (pages only the prefix cache holds are free for the taking); cached tokens are in
        GetServerInfo's scheduler_info (``num_cached_tokens``), the hit rate here."""
        loop = self._loop(context)
        st = loop.stats()
        eng = loop.engine
        used = st["request_pages"] * eng.capacity_plan.page_size
        cap = max(1, st["max_tokens_in_kv"])
        running, waiting = st["running"], st["waiting"]
        max_seqs = eng.scheduler.max_num_seqs
        hit_rate = st.get("prefix_hit_tokens", 0) / max(1, st.get("prefix_query_tokens", 0))
        load = pb.SchedulerLoad(
            dp_rank=0, num_running_reqs=running, num_waiting_reqs=waiting, num_total_reqs=running + waiting,
            num_used_tokens=used, max_total_num_tokens=st["max_tokens_in_kv"], token_usage=used / cap,
            max_running_requests=max_seqs, utilization=running / max(1, max_seqs), cache_hit_rate=hit_rate,
            num_waiting_uncached_tokens=st["waiting_uncached_tokens"])
        if self.pd_prefill is not None or self.pd_decode is not None:
            load.disaggregation.CopyFrom(self._disaggregation_metrics(st))
        rows = sum(st.get("spec_accept_counts") or [])
        if rows:  # speculative decoding: tokens a verified row emits (accepted + 1), drafts accepted
            load.speculative.CopyFrom(pb.SpeculativeMetrics(
                accept_length=1 + st["spec_accepted_tokens"] / rows,
                accept_rate=st["spec_accepted_tokens"] / max(1, st["spec_draft_tokens"])))
        plan = eng.capacity_plan  # the KV pools plus the memory set aside for P/D handoffs
        load.memory.CopyFrom(pb.MemoryMetrics(kv_cache_gb=(plan.total_bytes + plan.handoff_bytes) / 2**30,
                                              token_capacity=st["max_tokens_in_kv"]))
        agg = pb.AggregateMetrics(total_running_reqs=running, total_waiting_reqs=waiting,
                                  total_reqs=running + waiting, avg_token_usage=used / cap,
                                  avg_utilization=load.utilization)
        return pb.GetLoadsResponse(timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), version=VERSION,
                                   dp_rank_count=1, loads=[load], aggregate=agg)

    def _disaggregation_args(self) -> dict:
        if self.pd_prefill is not None:
            return {"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": self.pd_prefill.port,
                    "disaggregation_transfer_backend": "jax-transfer"}
        if self.pd_decode is not None:
            return {"disaggregation_mode": "decode", "disaggregation_transfer_backend": "jax-transfer"}
        return {"disaggregation_mode": "null"}

    def _disaggregation_metrics(self, st: dict) -> "pb.DisaggregationMetrics":
        """SGLang's queues, mapped: prefill — rooms waiting for their decode (prealloc) and
        rooms computing or staged (inflight); decode — P/D requests in the engine still
        waiting for a reservation (prealloc, from the engine's last snapshot, so it falls as
        they are reserved, finish or are aborted) and reserved requests whose handoff is on its
        way (transfer, those waiting for handoff memory included)."""
        m = pb.DisaggregationMetrics()
        if self.pd_prefill is not None:
            rooms = self.pd_prefill.rooms
            m.mode = "prefill"
            m.prefill_prealloc_queue_reqs, m.prefill_inflight_queue_reqs = rooms.counts()
        if self.pd_decode is not None:
            d = self.pd_decode
            m.mode = "decode"
            m.decode_prealloc_queue_reqs, m.decode_transfer_queue_reqs = st.get("waiting_prefilled", 0), d.transferring
            if d.transfer_time_s > 0:
                m.kv_transfer_speed_gb_s = d.bytes_received / d.transfer_time_s / 1e9
            m.kv_transfer_latency_ms = d.last_latency_s * 1e3
        return m

    def GetTokenizer(self, request, context):
        if self._bundle is None:
            self._bundle = tokenizer_bundle(self.model_dir)
        data = self._bundle
        digest = hashlib.sha256(data).hexdigest()
        step = 1 << 20
        for i in range(0, max(len(data), 1), step):
            last = i + step >= len(data)
            yield common_pb2.GetTokenizerChunk(data=data[i:i + step], sha256=digest if last else "")

    # ------------------------------------------------------------------ not here
    def _unimplemented(self, context, what):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{what} is not implemented by k3serve")

    def Embed(self, request, context):
        self._unimplemented(context, "Embed (k3serve serves generation models only)")

    def FlushCache(self, request, context):
        loop = self._loop(context)
        if loop.engine.prefix_cache is None:
            return common_pb2.FlushCacheResponse(success=True, message="prefix caching is off: nothing to flush")
        try:
            n = loop.flush_cache()
        except RequestError as e:
            context.abort(_status(e.code), str(e))
        return common_pb2.FlushCacheResponse(
            success=True, message=f"dropped {n} cached prefix states and the pages only they held "
                                  "(pages of running requests stay until they finish)")

    def StartProfile(self, request, context):
        self._unimplemented(context, "StartProfile")

    def StopProfile(self, request, context):
        self._unimplemented(context, "StopProfile")

    def SubscribeKvEvents(self, request, context):
        """Stream the prefix cache's stored/removed blocks (one block = one prefix-match unit,
        ``block_hash`` = its chained key) from ``start_sequence_number`` (0 = from now). The
        blocks carry every tenant's token ids (smg's router hashes them to route), so the
        interceptor answers this RPC only to the admin key (``auth.py``, docs/grpc.md)."""
        loop = self._loop(context)
        if loop.engine.prefix_cache is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "prefix caching is off: no KV events")
        log = loop.engine.prefix_cache.events
        seq = log.last_seq if request.start_sequence_number == 0 else request.start_sequence_number - 1
        # answer at once (the response headers), not with the first event: smg gives a
        # subscription 2 s to answer and, on an idle server, retried it every 5 s as unavailable
        context.send_initial_metadata(())
        while context.is_active() and loop.accepting:
            for b in log.after(seq, timeout=0.5):
                seq = b.seq
                yield common_pb2.KvEventBatch(sequence_number=b.seq, timestamp=b.timestamp, dp_rank=0,
                                              events=[_kv_event(e) for e in b.events])

    def LoadLoRAAdapter(self, request, context):
        self._unimplemented(context, "LoRA")

    def UnloadLoRAAdapter(self, request, context):
        self._unimplemented(context, "LoRA")

    def ListLoadedLoRAAdapters(self, request, context):
        self._unimplemented(context, "LoRA")


def _mesh(eng) -> dict:
    """The global mesh of a loaded engine: its axes and device count."""
    mesh = eng.mesh
    return {"num_devices": mesh.size if mesh is not None else 1,
            "mesh_shape": {k: int(v) for k, v in mesh.shape.items()} if mesh is not None else {}}


def _int_or(v, default):
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _logprobs(lps, ids) -> "pb.OutputLogProbs":
    out = pb.OutputLogProbs()
    for (lp, top), tid in zip(lps, ids):
        out.token_logprobs.append(lp)
        out.token_ids.append(int(tid))
        out.top_logprobs.append(pb.TopLogProbs(values=[b for _, b in top], token_ids=[int(a) for a, _ in top]))
    return out


def _id_logprobs(into: "pb.OutputLogProbs", rows) -> None:
    """``token_ids_logprob``: one row per output position, the asked ids' log-probs."""
    for row in rows:
        into.token_ids_logprobs.append(pb.TopLogProbs(values=[b for _, b in row], token_ids=[int(a) for a, _ in row]))


def _kv_event(e) -> "common_pb2.KvCacheEvent":
    device = common_pb2.KV_CACHE_TIER_DEVICE
    if e.kind == "removed":
        return common_pb2.KvCacheEvent(removed=common_pb2.KvBlocksRemoved(block_hashes=e.hashes, tier=device,
                                                                          cache_level=0))
    if e.kind == "cleared":
        return common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared())
    stored = common_pb2.KvBlocksStored(
        blocks=[common_pb2.KvBlock(block_hash=h, token_ids=t, block_size=e.block_size, cache_level=0)
                for h, t in zip(e.hashes, e.token_ids)], tier=device, medium="device",
        kv_cache_spec_kind="mla_latent+kda_state", locality=common_pb2.KV_CACHE_LOCALITY_LOCAL)
    if e.parent is not None:
        stored.parent_block_hash = e.parent
    return common_pb2.KvCacheEvent(stored=stored)


class GrpcServer:
    """A started gRPC server: the scheduler servicer, health and reflection."""

    def __init__(self, servicer: Servicer, *, host: str = "127.0.0.1", port: int = 50051, max_workers: int = 1032,
                 api_key: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 max_message_bytes: int = 16 << 20, admin_key: str | None = None):
        self.servicer = servicer
        interceptors = [ApiKeyInterceptor(api_key, admin_key)] if api_key or admin_key else []
        opts = [("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes), ("grpc.so_reuseport", 0)]
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="k3-grpc"),
                                  interceptors=interceptors, options=opts, maximum_concurrent_rpcs=max_workers - 8)
        pb_grpc.add_SglangSchedulerServicer_to_server(servicer, self.server)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        addr = f"{host}:{port}"
        if tls_cert and tls_key:
            creds = grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])
            self.port = self.server.add_secure_port(addr, creds)
        else:
            self.port = self.server.add_insecure_port(addr)
        if not self.port:
            raise OSError(f"cannot bind {addr}")
        self.host = host
        self.server.start()

    def set_ready(self, loop) -> None:
        self.servicer.set_ready(loop)
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        loop.on_error.append(lambda e: self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))
        if loop.error is not None:  # failed before the listener was in place
            self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def shutdown(self, grace_s: float = 30.0) -> int:
        """Graceful stop: NOT_SERVING, stop admitting, let in-flight requests finish for up to
        ``grace_s`` (then abort them), stop the engine and the server. Returns aborted count."""
        self.health.enter_graceful_shutdown()
        loop = self.servicer.loop
        aborted = loop.drain(grace_s) if loop is not None else 0
        self.server.stop(grace=5).wait(10)
        return aborted
