"""The engine: requests in, tokens out, one jitted step at a time.

``Engine.step()`` asks the scheduler for a plan (continuous batching with chunked prefill and
preemption), runs it through the runner (one jitted model step + batched sampling), then
appends sampled tokens, advances each request through the cache and finishes requests on
``max_new_tokens``, stop token ids (the config's eos — K3's ``<|end_of_msg|>`` — unless
``ignore_eos``), ``max_model_len``, or abort. Finished and aborted requests return their
pages and slot at once.

Stop strings need a tokenizer; the engine matches them when given ``detokenizer`` (a factory
of incremental detokenizers, e.g. ``tokenizer.detokenizer``): each request's new tokens are
decoded as they arrive, and a stop string is looked for only in the new text plus the last
``max(len(stop)) - 1`` characters before it, from ``min_new_tokens`` on (a stop string
wholly inside the first ``min_new_tokens`` tokens does not count). As in SGLang, the output
ids keep the token that completed the stop string (and nothing after it); trimming the text
is the detokenizing side's business.

Per step, host work is proportional to the new tokens, not to the sequences: outputs carry
deltas (the whole output only on the final one), prefix keys grow by the new tokens only,
penalties read a device-resident token table (runner), and requests that owe a final output
(aborted between steps) are kept in a list instead of being searched for.

Async scheduling (the default): ``step()`` plans and launches step N+1 *before* it waits for
the results of step N, so the host's planning, input packing and output handling overlap
the device's work. Decode rows of step N+1 take their input token straight from step N's
device output. The price is that a finish by a stop token or stop string is seen one step
late: the finished request may have run one more (discarded) decode row, and every
output reaches the caller one ``step()`` call later. Finishes by length are known ahead and
cost nothing. ``async_scheduling=False`` waits for each step before planning the next.

``recipe`` places the model on a mesh (``sharding/``). Every kernel backend serves under every
recipe: with ``kernels="pallas"`` the MLA, KDA and MXFP4 expert kernels run per rank inside
the recipe's ``shard_map``s, on the rank's pages, slots, heads and experts (docs/sharding.md,
"Pallas kernels under a recipe"). The backend is the model's (``load_pretrained(...,
kernels=...)``): Pallas on TPU, the reference elsewhere.
"""
from __future__ import annotations

import copy
import dataclasses
import random
import threading
import time
from typing import Any, Callable

import numpy as np

from .cache import CacheManager, plan_capacity
from .request import (CapacityError, EngineError, HandoffLost, OutOfRangeError, Request, RequestError, RequestOutput,
                      Status, next_request_number)
from .runner import Runner
from .sampling_params import SamplingParams
from .scheduler import Scheduler


class Engine:
    def __init__(self, model, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 256,
                 chunk_size: int | None = None, page_size: int = 16, kv_memory_bytes: int | None = None,
                 num_pages: int | None = None, max_model_len: int = 2048, max_logprobs: int = 20,
                 warmup: bool = True, detokenizer: Callable[[], Any] | None = None,
                 compilation_cache_dir: str | None = None, async_scheduling: bool = True,
                 recipe=None, devices=None,
                 enable_prefix_caching: bool = True, prefix_unit: int | None = None, prefix_interval: int = 0,
                 prefix_second_hit: bool = True, prefix_output_end: bool = True,
                 prefix_snapshots: int | None = None, prefix_cache_bytes: int | None = None,
                 prefix_host_bytes: int = 1 << 30, bucket_growth: int = 8, dispatch=None, pd_handoff_bytes: int = 0,
                 pd_role: str | None = None, abstract: bool = False, speculative: dict | None = None,
                 drafter=None, tokenizer=None, max_n: int = 8, pack_layer_stacks: bool | None = None):
        """``abstract``: build the engine for compiling only (``aot_build``, ``k3serve compile``):
        ``model.params`` are ``ShapeDtypeStruct``s already placed on ``devices`` (by the recipe's
        ``placement_for``, or on ``devices[0]``), the cache and the runner's arrays are made as
        ``ShapeDtypeStruct``s there too, and nothing is allocated, placed, compiled or run
        (no warm-up): the programs are lowered from ``self.runner`` and ``self.cache_mgr``.

        ``speculative`` (``docs/speculative.md``): ``{"method": "ngram"|"suffix",
        "num_speculative_tokens": k, "max_rows": N (optional: no drafts while more than N
        requests run), ...the method's options}``. Decode rows carry up to ``k`` drafts, verified
        in the step; emitted tokens are exactly those of plain decoding (greedy, and seeded
        sampling too). ``drafter`` (tests): an object with ``propose(req, max_tokens, after=())``
        and ``finish(req, keep)`` used instead of the method's. Speculation runs under every
        recipe (attention DP: each group journals in its own block of entries), with async or
        synchronous scheduling (async: ``spec_follow.py``).

        ``pack_layer_stacks`` (default: on a TPU): store the 16-bit layer stacks as ``uint32``
        row pairs, the tiling XLA:TPU's matmuls read (``model.packed_rows``), so that no step
        re-tiles them. Lossless; the caller's model takes the packed stacks too (it reads
        them as before), so no stack is held twice."""
        from .dispatch import LocalDispatch

        caller = model  # the model given (a DSpark pool or a recipe copies it below)
        cfg = model.config
        spec_k, spec_rows = 0, None
        draft = None
        if speculative is not None:
            spec_k = int(speculative.get("num_speculative_tokens", 0))
            spec_rows = speculative.get("max_rows")
            if speculative.get("method") == "dspark":  # its context rows live in the target's pages
                from ..spec.dspark_drafting import abstract_draft, load_draft, with_draft_pool

                if not speculative.get("draft_model"):
                    raise ValueError("speculative method 'dspark' needs draft_model (a DSpark checkpoint directory)")
                # an abstract engine (``k3serve compile``) reads the draft's config only
                draft = (abstract_draft if abstract else load_draft)(speculative["draft_model"], cfg, model.dtype,
                                                                      spec_k)
                model = with_draft_pool(model, draft)
                cfg = model.config
            if drafter is None:
                from ..spec.drafting import make_drafter

                drafter = make_drafter(speculative)
            elif spec_k < 1:
                raise ValueError(f"num_speculative_tokens must be >= 1, got {spec_k}")
        self.drafter = drafter if spec_k else None
        self.spec_k = spec_k
        self.spec_method = (speculative or {}).get("method") if spec_k else None  # GetServerInfo
        self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.spec_accept_counts = [0] * (spec_k + 1)  # decode rows with drafts, by drafts accepted
        # async: rows whose host drafts assumed the outcome of an in-flight verify row, and how
        # many of those guesses held (the others verified no drafts)
        self.spec_guess_rows = self.spec_guess_held = 0
        self.sync_steps = 0  # async: steps planned after the previous one returned (``Scheduler.prefers_sync``)
        # the device calls made while serving, by name (server.cluster: replayed on followers)
        self.dispatch = dispatch if dispatch is not None else LocalDispatch()
        if compilation_cache_dir:  # process-global; entry points normally set it (compile_cache.py)
            from ...compile_cache import enable_compile_cache

            enable_compile_cache(compilation_cache_dir)
        self.model = model
        self.recipe = self.mesh = self.par = None
        if recipe is not None:  # place the parameters on a mesh (sharding/ recipes)
            import jax

            from ...sharding.mesh import build_mesh, shard_params
            from ...sharding.recipe import Recipe

            devs = list(jax.devices() if devices is None else devices)
            self.recipe = Recipe.parse(recipe).validate(cfg, num_devices=len(devs))
            self.mesh = build_mesh(self.recipe, devs)
            model = copy.copy(model)  # the caller's model keeps its own (unsharded) parameters
            self.model = model
            model.params = shard_params(model.params, self.mesh)
            from ...sharding.parallel import StepParallel

            self.par = StepParallel(self.recipe, self.mesh)
        if pack_layer_stacks is None:
            import jax

            pack_layer_stacks = (list(devices) if devices else jax.devices())[0].platform == "tpu"
        self.packed_layer_stacks = bool(pack_layer_stacks)
        if pack_layer_stacks:
            from ...model.packed_rows import adopt_packed
            from ...model.packed_rows import pack_layer_stacks as pack

            before, model.params = model.params, pack(model.params)
            if caller is not model:  # what it shared with the engine's model, it now shares packed
                caller.params = adopt_packed(caller.params, before, model.params)
            del before  # the 16-bit stacks go with the last state that held them, before the cache is made
        dp, dcp = (self.recipe.dp, self.recipe.dcp) if self.recipe is not None else (1, 1)
        self.max_model_len = max_model_len
        if detokenizer is None and tokenizer is not None:
            detokenizer = lambda: tokenizer.detokenizer(keep_text=False)  # noqa: E731
        self.tokenizer = tokenizer  # constrained decoding compiles grammars against its vocabulary
        self.max_n = max_n  # parallel samples one request may ask for (the API layers fan them out)
        self._grammars = None  # structured.grammar.GrammarCompiler, built at the first constraint
        self._grammars_lock = threading.Lock()
        self.detokenizer = detokenizer  # () -> object with .add(ids) -> new text
        self.detokenize = detokenizer  # the API layer checks this name (stop strings need it)
        self.async_scheduling = async_scheduling
        self._inflight = None  # the launched step whose results are not processed yet
        if kv_memory_bytes is None and num_pages is None:
            num_pages = max_num_seqs * -(-max_model_len // page_size)
            num_pages = -(-num_pages // (dp * dcp)) * dp * dcp  # whole blocks per DP group / DCP rank
        if prefix_snapshots is None:
            prefix_snapshots = 2 * max_num_seqs if enable_prefix_caching else 0
        if enable_prefix_caching and prefix_snapshots < 1:
            raise ValueError("prefix caching needs prefix_snapshots >= 1")
        # the P/D handoff bound is per process (server/pd/budget.py): set aside once per process of the mesh
        processes = len({d.process_index for d in self.mesh.devices.flat}) if self.mesh is not None else 1
        self.capacity_plan = plan_capacity(cfg, page_size=page_size, dtype=model.dtype, kv_memory_bytes=kv_memory_bytes,
                                  max_num_seqs=max_num_seqs, num_pages=num_pages, dp=dp, dcp=dcp,
                                  snapshot_slots=prefix_snapshots if enable_prefix_caching else 0,
                                  handoff_bytes=pd_handoff_bytes * processes, num_speculative_tokens=spec_k,
                                  conv_groups=1 if self.par is None else self.par.conv_groups(cfg.kda_num_heads))
        self.cache_mgr = CacheManager(cfg, self.capacity_plan, model.dtype, allocate=self.par is None and not abstract,
                                      dispatch=self.dispatch)
        if abstract:
            self.cache_mgr.device_cache = self._abstract_cache(devices)
        elif self.par is not None:  # allocated straight into its shards
            import jax

            from ...model.cache import Cache, allocate_cache

            p = self.capacity_plan
            self.cache_mgr.device_cache = jax.jit(lambda: allocate_cache(cfg, p.num_slots, p.num_pages, p.page_size, model.dtype,
                                                                         p.conv_groups),
                                       out_shardings=Cache(**self.par.cache_shardings(cfg.kda_num_heads)))()
        chunk_size = min(chunk_size or max_num_batched_tokens, max_num_batched_tokens)
        self.prefix_cache = None
        if enable_prefix_caching:
            from .cache.prefix_cache import PrefixCache

            self.prefix_cache = PrefixCache(self.cache_mgr, unit=prefix_unit, interval=prefix_interval,
                                      second_hit=prefix_second_hit, output_end=prefix_output_end,
                                      max_bytes=prefix_cache_bytes, host_bytes=prefix_host_bytes)
        self.scheduler = Scheduler(self.cache_mgr, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, chunk_size=chunk_size,
                                   max_model_len=max_model_len, prefix_cache=self.prefix_cache,
                                   drafter=self.drafter, max_drafts=spec_k, spec_max_rows=spec_rows)
        self.runner = Runner(model, self.cache_mgr, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                             max_logprobs=max_logprobs, par=self.par, bucket_growth=bucket_growth,
                             dispatch=self.dispatch, abstract=abstract, num_speculative_tokens=spec_k,
                             draft=draft)
        self.requests: dict[str, Request] = {}
        self.broken: BaseException | None = None  # a step failed: the state is half-updated, no more steps
        self._owed: dict[str, Request] = {}  # finished outside a step (abort): final output owed
        self._fresh: dict[str, Request] = {}  # got tokens outside a step (a P/D handoff): output owed
        self._on_reserved: dict[str, Callable[[str], None]] = {}  # P/D decode: rid -> callback
        self._reserved_calls: list[tuple[Request, Callable[[str], None]]] = []  # run after the step
        self.callback_errors: dict[str, Exception] = {}  # rid -> what its on_reserved raised (taken by the caller)
        self.warmup_s = 0.0
        self.num_steps = 0
        self.num_preemptions = 0
        self.prompt_tokens_computed = 0  # prompt tokens run through the model (recomputes included)
        self.tokens_computed = 0
        self.prefix_bytes_peak = 0
        self.step_s = 0.0  # wall time inside step(), host work included
        # "prefill" / "decode": the P/D side this engine serves (its handoff programs are warmed)
        self.pd_role = pd_role if pd_role in ("prefill", "decode") else None
        # multi-host P/D: each process's part of every handoff (cache/handoff_plane.py), set by
        # whoever builds the engine (api/engine_args.py) on every process alike
        self.handoff_plane = None
        if warmup and not abstract:
            from .warm_programs import warm_small_programs

            t = time.perf_counter()
            self.runner.warmup()
            warm_small_programs(self, self.pd_role)
            self.warmup_s = time.perf_counter() - t

    def _abstract_cache(self, devices):
        """The device cache as placed ``ShapeDtypeStruct``s: the recipe's cache shardings, or
        the first of ``devices`` (an abstract engine allocates nothing)."""
        import jax

        from ...model.cache import Cache, cache_shapes

        p, cfg = self.capacity_plan, self.model.config
        shapes = cache_shapes(cfg, p.num_slots, p.num_pages, p.page_size, self.model.dtype, p.conv_groups)
        if self.par is not None:
            where = self.par.cache_shardings(cfg.kda_num_heads)
        else:
            if not devices:
                raise ValueError("an abstract engine without a recipe needs devices (its first one holds the cache)")
            one = jax.sharding.SingleDeviceSharding(list(devices)[0])
            where = {k: one for k in shapes}
        return Cache(**{k: jax.ShapeDtypeStruct(s, d, sharding=where[k]) for k, (s, d) in shapes.items()})

    # ------------------------------------------------------------------ requests
    def validate(self, prompt, params: SamplingParams | None = None) -> list[int]:
        """Check a request against the model, the context and the KV capacity; returns its
        token ids. Pure: reads only what is fixed at construction, so any thread may call it
        while another steps the engine. Raises a ``RequestError`` subclass."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = _token_ids(prompt)
        V = self.model.config.vocab_size
        if not ids:
            raise RequestError("prompt must contain at least one token id")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise OutOfRangeError(f"token id {bad[0]} out of range [0, {V})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < V]
        if bad:
            raise OutOfRangeError(f"stop token id {bad[0]} out of range [0, {V})")
        bad = [t for t in (params.logit_bias or ()) if t >= V] + [t for t in params.token_ids_logprob if t >= V]
        if bad:
            raise OutOfRangeError(f"token id {bad[0]} (logit_bias / token_ids_logprob) out of range [0, {V})")
        if params.constraint is not None:
            self._compile_grammar(params.constraint)
        if params.n > self.max_n:
            raise RequestError(f"n={params.n} exceeds this engine's limit of {self.max_n} samples per request")
        if params.logprobs is not None and params.logprobs > self.runner.max_logprobs:
            raise RequestError(f"logprobs {params.logprobs} exceeds this engine's max_logprobs "
                               f"{self.runner.max_logprobs}")
        if len(ids) >= self.max_model_len:
            raise OutOfRangeError(f"prompt of {len(ids)} tokens does not fit max_model_len {self.max_model_len}")
        if params.max_new_tokens > self.max_model_len:
            raise OutOfRangeError(f"max_new_tokens {params.max_new_tokens} exceeds max_model_len {self.max_model_len}")
        total = min(len(ids) + params.max_new_tokens, self.max_model_len)  # generation stops at max_model_len
        if total > self.capacity_plan.max_tokens_per_request:
            raise CapacityError(f"prompt + max_new_tokens = {total} tokens exceeds the KV capacity "
                                f"({self.capacity_plan.max_tokens_per_request} tokens)")
        return ids

    def grammar_compiler(self):
        """The engine's ``structured.grammar.GrammarCompiler`` (built at the first constrained
        request: the vocabulary's bytes from ``tokenizer``, the model's eos as the stop id)."""
        from ..structured.grammar import GrammarCompiler
        from ..structured.xgrammar_native import Unavailable

        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise RequestError("constrained decoding needs the checkpoint's tokenizer (this engine has none)")
                eos = self.model.config.eos_token_id
                try:
                    self._grammars = GrammarCompiler.from_tokenizer(self.tokenizer, self.model.config.vocab_size,
                                                                    [] if eos is None else [int(eos)])
                except Unavailable as e:
                    raise RequestError(str(e)) from None
            return self._grammars

    def _compile_grammar(self, constraint):
        from ..structured.grammar import GrammarError

        try:
            return self.grammar_compiler().compile(constraint)
        except GrammarError as e:
            raise RequestError(str(e)) from None

    def _matcher(self, params: SamplingParams, prompt=()):
        """A request's grammar matcher (its stop ids: the model's eos unless ``ignore_eos``, and
        its ``stop_token_ids``), or None. A prompt that opens a think block gets a gated matcher:
        the grammar starts with the answer (``text.chat.thinking_gate``); structural tags (smg's
        tool calls) carry their own triggers and are not gated."""
        c = params.constraint
        if c is None:
            return None
        from ..structured.grammar import GrammarError
        from ..text.chat import thinking_gate

        eos = self.model.config.eos_token_id
        stops = ([] if eos is None or params.ignore_eos else [int(eos)]) + list(params.stop_token_ids)
        gate = thinking_gate(self.tokenizer, prompt) if c.kind != "structural_tag" else None
        try:
            return self.grammar_compiler().matcher(c, stops, gate=gate)
        except GrammarError as e:
            raise RequestError(str(e)) from None

    def add_request(self, prompt, params: SamplingParams | None = None, *, rid: str | None = None,
                    priority: int = 0, cache_salt: str | None = None, api_key: str | None = None) -> str:
        """Queue a request (``validate`` + ``admit``). ``cache_salt`` (or else ``api_key``) names
        its prefix-cache tenant: requests of different tenants never share cached pages or states."""
        ids = self.validate(prompt, params)
        return self.admit(ids, params, rid=rid, priority=priority, cache_salt=cache_salt, api_key=api_key)

    def admit(self, ids: list[int], params: SamplingParams | None = None, *, rid: str | None = None,
              priority: int = 0, cache_salt: str | None = None, api_key: str | None = None,
              export: bool = False) -> str:
        """Queue a request whose ``ids`` came from ``validate``. Refuses an id in use; without
        one, generates an id that no live request has. ``export`` (a P/D prefill,
        ``handoff.py``): generate one token, then hand the cache over on the final output."""
        params = params if params is not None else SamplingParams()
        if export:
            params = prefill_leg_params(params)
        return self._queue(ids, params, rid, priority, cache_salt, api_key, export=export)

    def admit_prefilled(self, ids: list[int], params: SamplingParams | None, handoff=None, *, rid: str,
                        priority: int = 0, cache_salt: str | None = None, api_key: str | None = None,
                        on_reserved: Callable[[str], None] | None = None) -> str:
        """Queue a request whose prompt a P/D prefill engine computes (``handoff.py``; ``ids``
        from ``validate``). It waits like any request until a slot and pages for ``prompt + 1``
        tokens are free and reserves them; then the handoff (given here, or later by
        :meth:`deliver`; ``on_reserved(rid)`` is called on reservation) is written into them
        and it decodes on from the handoff's first token, its first output."""
        if handoff is not None:
            self._check_handoff(ids, handoff)
        if rid in self.requests:  # checked before the callback is registered under the id
            raise RequestError(f"request id {rid!r} is already in use")
        if on_reserved is not None:
            self._on_reserved[rid] = on_reserved
        return self._queue(ids, params if params is not None else SamplingParams(), rid, priority, cache_salt,
                           api_key, prefilled=handoff, awaiting=True)

    def _queue(self, ids, params: SamplingParams, rid: str | None, priority: int, cache_salt, api_key,
               **fields) -> str:
        if params.n != 1:
            raise RequestError(f"the engine runs one sample per request (n={params.n}): submit each sample "
                               "(sampling_params.sample_params), as LLM and the gRPC server do")
        if rid is not None and rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        if rid is None:
            rid = f"req-{next_request_number()}"
            while rid in self.requests:  # a caller chose this name: take the next
                rid = f"req-{next_request_number()}"
        seed = params.seed if params.seed is not None else random.getrandbits(31)
        from .cache.prefix_keys import tenant_salt

        req = Request(prompt=list(ids), params=params, rid=rid, priority=priority, seed=seed,
                      salt=tenant_salt(cache_salt, api_key), grammar=self._matcher(params, ids), **fields)
        self.requests[req.rid] = req
        self.scheduler.add(req)
        return req.rid

    def deliver(self, rid: str, handoff) -> bool:
        """The handoff of a request queued by :meth:`admit_prefilled`: written into its
        reservation now, or when it gets one. False if the request is gone (aborted)."""
        req = self.requests.get(rid)
        try:
            if req is None or req.finished or not req.awaiting:
                if handoff.key is not None and self.handoff_plane is not None:  # nobody takes it: free it everywhere
                    self.handoff_plane.drop(handoff.key)
                return False
            self._check_handoff(req.prompt, handoff)
            if handoff.destination is not None and (
                    req.rid not in self.cache_mgr
                    or self.cache_mgr.handoff_target(req.rid, handoff.prompt_len).dest != handoff.destination):
                raise RequestError("the handoff was cut for another reservation than this request holds")
        except RequestError:
            if handoff.key is not None and self.handoff_plane is not None:
                self.handoff_plane.drop(handoff.key)
            raise
        req.prefilled = handoff
        if req.rid in self.cache_mgr:  # reserved
            self._take_handoff(req)
        return True

    def _check_handoff(self, ids, handoff) -> None:
        if handoff.prompt_len != len(ids):
            raise RequestError(f"the handoff covers {handoff.prompt_len} tokens, the prompt has {len(ids)}")
        if not 0 <= handoff.first_token < self.model.config.vocab_size:
            raise OutOfRangeError(f"first token {handoff.first_token} out of range")

    def _take_handoff(self, req: Request) -> None:
        """Write the handoff into the request's reservation; its first token is its first output."""
        h = req.prefilled
        if h.key is not None:  # multi-host: every process loads the pieces it pulled, or none does
            if self.handoff_plane is None or not self.handoff_plane.load(req.rid, h.key, h.prompt_len):
                req.prefilled = None
                raise HandoffLost("the KV transfer did not reach every process of this server in time (a prefill "
                                  "process may have died)")
        else:
            self.cache_mgr.import_request(req.rid, h.arrays, h.prompt_len, h.destination)
        req.prefilled, req.awaiting = None, False
        req.cached_tokens = h.cached_tokens
        req.output.append(int(h.first_token))
        if req.grammar is not None:
            req.grammar.accept(int(h.first_token))
        if req.params.token_ids_logprob and h.id_logprobs is not None:
            req.id_logprobs.append([(int(a), float(b)) for a, b in h.id_logprobs])
        if req.params.logprobs is not None and h.logprob is not None:
            lp, top = h.logprob
            req.logprobs.append((float(lp), [(int(a), float(b)) for a, b in top[:req.params.logprobs]]))
        self._fresh[req.rid] = req
        self._check_stop(req, req.output[0])

    def abort(self, rid: str) -> bool:
        req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        self._finish(req, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def has_owed_outputs(self) -> bool:
        """Some request finished outside a step (abort) or got its first token from a P/D
        handoff, and the next step owes its output."""
        return bool(self._owed or self._fresh)

    def _finish(self, req: Request, reason: str, matched=None) -> None:
        self._on_reserved.pop(req.rid, None)
        if self.drafter is not None:
            self.drafter.finish(req, keep=reason != "abort")
        req.prefilled = None
        self.scheduler.remove(req)
        self.runner.release(req.rid)
        self._owed[req.rid] = req
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.matched_stop = matched

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that progressed or ended.

        A step that raises leaves scheduler, cache and device state half-updated (part of a
        split step may already have run), so the engine is marked ``broken`` and every later
        ``step()`` raises ``EngineError``: build a new engine."""
        if self.broken is not None:
            raise EngineError(f"the engine is broken: an earlier step failed ({self.broken!r}); its state is "
                              "half-updated and cannot be stepped again (build a new Engine)")
        t0 = time.perf_counter()
        try:
            outputs = self._step()
        except BaseException as e:
            self.broken = e
            raise
        finally:
            self.step_s += time.perf_counter() - t0
        self._run_reserved_calls()
        return outputs

    def _run_reserved_calls(self) -> None:
        """``on_reserved`` callbacks of this step's reservations, run after the step so that one
        that raises cannot leave the step half-done: its request alone is aborted (its final
        output is owed to the next step) and the error kept in ``callback_errors``."""
        calls, self._reserved_calls = self._reserved_calls, []
        for req, cb in calls:
            if req.finished:
                continue
            try:
                cb(req.rid)
            except Exception as e:  # noqa: BLE001 - the callback's failure is its request's alone
                self.callback_errors[req.rid] = e
                self._finish(req, "abort")

    def _step(self) -> list[RequestOutput]:
        # requests aborted since the last step still owe their final output
        touched: dict[str, Request] = dict(self._owed)
        if self._inflight is not None and (self.scheduler.prefers_sync() or any(
                r.req.grammar is not None and not r.req.finished for r in self._inflight.rows)):
            # speculation whose guesses would mostly fail, or a grammar whose matcher needs the
            # token in flight before the next is sampled: this step is planned synchronously
            done, self._inflight = self._inflight, None
            self._process(done, touched)
            self.sync_steps += 1
        step_plan = self.scheduler.schedule()
        for req in step_plan.reserved:  # P/D decode: a slot and pages wait for the handoff
            cb = self._on_reserved.pop(req.rid, None)
            if req.prefilled is not None:
                self._take_handoff(req)
            elif cb is not None:
                self._reserved_calls.append((req, cb))
        touched.update(self._fresh)
        self._fresh.clear()
        self.num_preemptions += len(step_plan.preempted)
        for req in step_plan.preempted:
            self.runner.release(req.rid)  # its token table row is rebuilt when it runs again
            req.spec_fold = 0  # its slot is gone with the drafts it had accepted
        launched = None
        self.cache_mgr.flush_copies()  # prefix hits: shared tail page -> own copy; host-tier reloads
        if step_plan.rows:
            snaps = self.prefix_cache.plan_snapshots(step_plan.rows, self.runner.snap_capacity(step_plan.rows)) \
                if self.prefix_cache is not None else []
            launched = self.runner.launch(step_plan.rows, self._inflight, snaps)
            if self.prefix_cache is not None:
                self.prefix_cache.after_launch(step_plan.rows)
            self.num_steps += 1
            for i, row in enumerate(step_plan.rows):
                req = row.req
                self.tokens_computed += row.num_tokens
                self.prompt_tokens_computed += max(0, min(row.start + row.num_tokens, len(req.prompt)) - row.start)
                req.num_computed += row.num_tokens
                touched[req.rid] = req
                if row.samples:
                    if row.guess >= 0:  # its drafts assume the in-flight row's outcome
                        req.follow_guess = (req.sample_row[0], row.assumed, row.guess, row)
                    req.pending += 1
                    req.pending_drafts += len(row.drafts)
                    req.inflight_drafts = row.drafts
                    req.sample_row = (launched.step, int(launched.index[i]))
        if self.async_scheduling:
            done, self._inflight = self._inflight, launched
        else:
            done, self._inflight = launched, None
        if done is not None:
            self._process(done, touched)
        if self.prefix_cache is not None:
            self.prefix_cache.events.publish()  # this step's stored/removed blocks, one numbered batch
            self.prefix_bytes_peak = max(self.prefix_bytes_peak, self.prefix_cache.bytes_held())
            if self.prefix_cache.host is not None:
                self.cache_mgr.drain_host()  # finished offload copies: device arrays -> host memory
        outputs = []
        for req in touched.values():
            n, fin = len(req.output), req.finished
            if n == req.emitted and not fin:
                continue
            lp = req.params.logprobs is not None
            # the finished request leaves the engine, so its lists are handed over, not copied
            outputs.append(RequestOutput(req.rid, req.output[req.emitted:], req.output if fin else None, fin,
                                         req.finish_reason, req.matched_stop, len(req.prompt), n,
                                         req.logprobs if fin and lp else None, req.cached_tokens or 0,
                                         req.logprobs[req.emitted:] if lp else None,
                                         req.handoff if fin else None, req.spec_draft_tokens,
                                         req.spec_accepted_tokens,
                                         req.id_logprobs[req.emitted:] if req.params.token_ids_logprob else None,
                                         req.id_logprobs if fin and req.params.token_ids_logprob else None))
            req.emitted = n
            if fin:
                del self.requests[req.rid]
                self._owed.pop(req.rid, None)
        return outputs

    def _process(self, done, touched: dict) -> None:
        """Take a finished step's sampled tokens: append them, check stops."""
        out = done.result()
        for i, row in enumerate(done.rows):
            req = row.req
            if not row.samples:
                continue
            req.pending -= 1
            req.pending_drafts -= len(row.drafts) - row.dropped
            if req.finished:  # finished (stop seen late, or aborted) while this step ran: drop it
                continue
            touched[req.rid] = req
            if out.accepted is not None:  # speculative: the accepted drafts and one token more
                self._take_verified(req, row, out, i, done.step)
                if out.drafts is not None and not req.finished:  # DSpark: the block proposed after them
                    self.drafter.offer(req, out.drafts[i])
                continue
            tok = int(out.tokens[i])
            self._check_guess(req, done.step, 0, tok)
            self._append(req, tok, out, i)
            if req.export:  # P/D prefill: read the cache out before it is freed (handoff.py)
                self._export(req, tok)
                continue
            self._check_stop(req, tok)
            if self.prefix_cache is not None and not req.finished:
                self.prefix_cache.register_ready(req)  # snapshots waiting for this token to be keyed

    def _append(self, req: Request, tok: int, out, i: int, j: int | None = None) -> None:
        """Append sampled token ``tok`` (row ``i``'s, verify position ``j`` of a speculative step)."""
        req.output.append(tok)
        if req.grammar is not None:
            req.grammar.accept(tok)
        at = (i,) if j is None else (i, j)
        if req.params.token_ids_logprob:
            ids = req.params.token_ids_logprob
            req.id_logprobs.append([(int(t), float(v)) for t, v in zip(ids, out.id_logprobs[at][:len(ids)])])
        if req.params.logprobs is not None:
            n = req.params.logprobs
            req.logprobs.append((float(out.logprob[at]),
                                 [(int(a), float(b)) for a, b in zip(out.top_ids[at][:n], out.top_logprobs[at][:n])]))

    def _take_verified(self, req: Request, row, out, i: int, step: int) -> None:
        """A speculative step's row: emit the target's tokens at positions ``0 .. accepted``
        (drafts kept while they equal them, then the correction or the bonus token), checking
        stops after each — a stop id or string, ``max_new_tokens`` or ``max_model_len`` inside
        the block ends the request there and drops the rest. The cache keeps only committed
        tokens: ``num_computed`` loses the rejected drafts (their MLA rows are overwritten
        later) and the next step folds the accepted ones into the KDA state.

        Async scheduling: a row planned after this one while it ran (``req.sample_row`` names a
        later step) already folded the accepted drafts on the device, and a row of a request
        preempted since (``row.epoch``) commits nothing to a cache it no longer has."""
        d = len(row.drafts) - row.dropped
        a = int(out.accepted[i]) if row.decode else 0
        self._check_guess(req, step, a, int(out.tokens[i, a]))
        if row.decode and d:
            req.spec_full_rate = 0.7 * req.spec_full_rate + 0.3 * (a == d)
            self.spec_draft_tokens += d
            self.spec_accepted_tokens += a
            req.spec_draft_tokens += d
            req.spec_accepted_tokens += a
            self.spec_accept_counts[a] += 1
        if row.epoch == req.num_preemptions:
            req.num_computed -= d - a
            followed = req.sample_row is not None and req.sample_row[0] != step
            req.spec_fold = a if row.decode and not followed else 0
        for j in range(a + 1):
            tok = int(out.tokens[i, j])
            self._append(req, tok, out, i, j)
            if req.export:
                self._export(req, tok)
                return
            self._check_stop(req, tok)
            if req.finished:
                return
        if self.prefix_cache is not None:
            self.prefix_cache.register_ready(req)

    def _check_guess(self, req: Request, step: int, accepted: int, last: int) -> None:
        """Step ``step``'s row of ``req`` accepted ``accepted`` drafts and emitted ``last`` last.
        If a row in flight after it carries host drafts that assumed another outcome, the
        device drops them (``spec_follow``): that row will emit one token, so it counts no
        drafts from now on and the row after it is planned exactly."""
        g = req.follow_guess
        if g is None or g[0] != step:
            return
        req.follow_guess = None
        _, assumed, guess, nxt = g
        held = accepted == assumed and last == guess
        self.spec_guess_rows += 1
        self.spec_guess_held += held
        if not held and nxt.epoch == req.num_preemptions:
            nxt.dropped = len(nxt.drafts)
            req.num_computed -= nxt.dropped
            req.pending_drafts -= nxt.dropped
            req.inflight_drafts = ()  # that row is the newest in flight (one step runs at a time)

    def _export(self, req: Request, tok: int) -> None:
        from .handoff import Handoff

        key = arrays = None
        if self.handoff_plane is not None:  # multi-host: every process keeps its copy under a key
            key, arrays = self.handoff_plane.export(req.rid, len(req.prompt)), ()
        else:
            arrays = self.cache_mgr.export_request(req.rid, len(req.prompt))
        req.handoff = Handoff(len(req.prompt), tok, req.logprobs[0] if req.logprobs else None,
                              req.cached_tokens or 0, arrays,
                              id_logprobs=req.id_logprobs[0] if req.id_logprobs else None, key=key)
        self._finish(req, "length")

    def _check_stop(self, req: Request, tok: int) -> None:
        p = req.params
        g = req.grammar
        if g is not None and (g.terminated or g.rejected is not None):
            # the grammar ended on a stop id, or could not take the token (every id it allowed was
            # suppressed, e.g. eos before min_new_tokens): the request ends here
            return self._finish(req, "stop", tok)
        text = None
        if p.stop and self.detokenizer is not None:  # every token goes through the detokenizer
            st = req.stop_text
            if st is None:
                st = req.stop_text = [self.detokenizer(), ""]
            text = st[1] + st[0].add([tok])  # the new text and the chars a stop could start in
            keep = max(map(len, p.stop)) - 1
            st[1] = text[-keep:] if keep else ""
        if len(req.output) >= p.min_new_tokens:
            eos = self.model.config.eos_token_id
            if tok in p.stop_token_ids or (eos is not None and tok == eos and not p.ignore_eos):
                return self._finish(req, "stop", tok)
            if text:
                for s in p.stop:
                    if s in text:
                        return self._finish(req, "stop", s)
        if len(req.output) >= p.max_new_tokens or req.num_known >= self.max_model_len:
            self._finish(req, "length")

    # ------------------------------------------------------------------ introspection
    @property
    def num_compiles(self) -> int:
        """Programs compiled: the engine's own (``runner.num_compiles``) and, with a P/D role,
        the process's handoff cuts (``deal.PROGRAMS``: module functions, shared)."""
        from .cache import deal

        return self.runner.num_compiles + (deal.PROGRAMS.count if self.pd_role else 0)

    def stats(self) -> dict:
        evictable = self.prefix_cache.index.num_evictable_pages() if self.prefix_cache is not None else 0
        return {
            "num_compiles": self.num_compiles,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            "spec_accept_counts": list(self.spec_accept_counts),
            "spec_guess_rows": self.spec_guess_rows,  # async: rows whose drafts assumed an in-flight row's outcome
            "spec_guess_held": self.spec_guess_held,  # and whose assumption held
            "sync_steps": self.sync_steps,  # async: steps planned synchronously (low full-acceptance)
            "spec_steps": self.runner.spec_steps,  # on the speculative program; the other steps ran the plain one
            "num_steps": self.num_steps,
            "num_preemptions": self.num_preemptions,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "free_pages": self.cache_mgr.num_free_pages,
            # pages only the prefix cache holds (evictable) vs pages at least one request maps
            "evictable_pages": evictable,
            "request_pages": self.capacity_plan.num_pages - self.cache_mgr.num_free_pages - evictable,
            "waiting_uncached_tokens": sum(r.remaining for r in self.scheduler.waiting),
            # P/D decodes queued for a slot and pages (smg's decode_prealloc_queue_reqs)
            "waiting_prefilled": sum(1 for r in self.scheduler.waiting if r.awaiting),
            "free_slots": self.cache_mgr.num_free_slots,
            "warmup_s": self.warmup_s,
            "step_s": self.step_s,
            "launch_s": self.runner.launch_s,
            "wait_s": self.runner.wait_s,
            "async_scheduling": self.async_scheduling,
            "prefix_caching": self.prefix_cache is not None,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "tokens_computed": self.tokens_computed,
            "prefix_bytes_peak": self.prefix_bytes_peak,
            **(self.prefix_cache.stats() if self.prefix_cache is not None else {}),
            **self.cache_mgr.capacity(),
        }

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix (pages and snapshots not in use); returns snapshots dropped."""
        if self.prefix_cache is None:
            return 0
        n = self.prefix_cache.flush()
        self.prefix_cache.events.publish()
        return n

    def check_invariants(self) -> None:
        """Pools, per-request holdings and the prefix cache agree (tests)."""
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()
        else:
            self.cache_mgr.check_invariants()


def prefill_leg_params(params: SamplingParams) -> SamplingParams:
    """The settings a P/D prefill (``export``) runs with: one token. smg sends the decode's
    settings to both legs, so ``min_new_tokens`` is clamped to that one token too (the first
    token still may not be a stop id or eos when the request asked for at least one). Stop
    ids and stop strings are kept as they are and never checked here: the export finishes on
    its one token, and the decode checks the first token's stops itself."""
    return dataclasses.replace(params, max_new_tokens=1, min_new_tokens=min(params.min_new_tokens, 1))


def _token_ids(prompt) -> list[int]:
    """Token ids as Python ints: a sequence of ints or an integer numpy array. Floats (even
    integral ones), bools and strings are refused rather than truncated."""
    msg = "prompt must be a sequence of integer token ids"
    if isinstance(prompt, (str, bytes)):
        raise RequestError(msg)
    if isinstance(prompt, np.ndarray):
        if prompt.dtype.kind not in "iu":
            raise RequestError(f"{msg}, got an array of {prompt.dtype}")
        return [int(t) for t in prompt.reshape(-1)]
    try:
        items = list(prompt)
    except TypeError:
        raise RequestError(msg) from None
    for t in items:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise RequestError(f"{msg}, got {t!r}")
    return [int(t) for t in items]
