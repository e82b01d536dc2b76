"""The engine on a thread: many callers submit, stream and abort; one thread steps.

``Engine`` is single-threaded. ``EngineThread`` owns it: only its thread ever calls the
engine's mutating methods. Callers (gRPC handler threads) never wait on a step:

* ``submit(prompt, params, rid=None, priority=0) -> RequestHandle`` validates at once
  (``Engine.validate`` is pure, so a bad request gets its ``RequestError`` immediately and
  changes nothing) and posts the request on the engine thread's inbox;
* ``RequestHandle.outputs()`` — an iterator of ``RequestOutput`` deltas, the last one
  finished; it blocks on the handle's own queue. If the engine fails it raises
  ``EngineFailed`` (gRPC INTERNAL);
* ``RequestHandle.abort()`` aborts *that* request (never a later one that reuses its id);
  ``EngineThread.abort(rid)`` aborts the live request of that id (the ``Abort`` RPC);
* ``stats()`` returns the snapshot the engine thread publishes after every step;
* ``drain(grace_s)`` — stop admitting, let running requests finish for up to ``grace_s``
  seconds, abort the rest, and stop the thread. ``stop()`` gives every open handle a final
  output, so no consumer is left waiting.

The inbox (a ``queue.SimpleQueue``) carries submits, aborts and calls (``flush_cache``,
``call``); the engine thread drains it at the top of every step and blocks on it when idle.
A small lock guards only the table of open handles; it is never held across a step.
Time-to-first-token and inter-token latency are observed here (``on_output`` hook).
"""
from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
import uuid
from typing import Callable, Iterator

from ..engine.request import RequestError, RequestOutput
from ..engine.sampling_params import SamplingParams

IDLE_WAIT_S = 0.05  # after a step that moved nothing, wait this long for a message before stepping again


class ShuttingDown(RequestError):
    code = "UNAVAILABLE"


class EngineLost(RequestError):
    """The engine cannot go on for a reason outside it (a follower process was lost): gRPC
    UNAVAILABLE — the request may succeed once the deployment is back."""

    code = "UNAVAILABLE"


class RequestFailed(RequestError):
    """An engine call for one request raised something other than a ``RequestError`` (a bug
    or a failing callback): that request ends with gRPC INTERNAL, the engine serves on."""

    code = "INTERNAL"


class EngineFailed(RequestError):
    """The engine failed (a step raised): the request cannot complete. gRPC INTERNAL."""

    code = "INTERNAL"


def _final(h: "RequestHandle", reason: str = "abort") -> RequestOutput:
    return RequestOutput(rid=h.rid, new_token_ids=[], token_ids=[], finished=True, finish_reason=reason,
                         matched_stop=None, prompt_tokens=h.num_prompt, completion_tokens=0)


class RequestHandle:
    def __init__(self, loop: "EngineThread", rid: str, num_prompt: int, q: queue.SimpleQueue | None = None):
        self.loop = loop
        self.rid = rid
        self.num_prompt = num_prompt
        self.submitted = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        # RequestOutput, or an exception to raise (shared by the samples of one n > 1 request)
        self._q: queue.SimpleQueue = q if q is not None else queue.SimpleQueue()
        self.finished = False  # the final output (or an error) has been put
        self.admitted = False  # the engine holds the request
        self.abort_requested = False
        # engine-thread step counts at submit / admission / abort / freeing (latency benchmarks)
        self.submit_step = self.admit_step = self.abort_step = self.freed_step = None

    def outputs(self) -> Iterator[RequestOutput]:
        """Deltas until the finished one; raises ``EngineFailed`` if the engine broke."""
        while True:
            out = self._q.get()
            if isinstance(out, BaseException):
                raise out
            yield out
            if out.finished:
                return

    def abort(self) -> bool:
        """Abort this request if it is still running; False if it already ended (or an abort
        is already on its way)."""
        return self.loop._abort_handle(self)


class HandleGroup:
    """The ``n`` samples of one request (``EngineThread.submit_n``): their outputs on one queue,
    each with its sample index."""

    def __init__(self, handles: list[RequestHandle]):
        self.handles = handles
        self.num_prompt = handles[0].num_prompt
        self._index = {h.rid: i for i, h in enumerate(handles)}

    def outputs(self) -> Iterator[tuple[int, RequestOutput]]:
        """``(sample index, delta)`` until every sample's finished one; raises ``EngineFailed``
        (or the request's error) as :meth:`RequestHandle.outputs` does."""
        left = set(self._index)
        q = self.handles[0]._q
        while left:
            out = q.get()
            if isinstance(out, BaseException):
                raise out
            yield self._index[out.rid], out
            if out.finished:
                left.discard(out.rid)

    def abort(self) -> bool:
        return any([h.abort() for h in self.handles])


class EngineThread:
    def __init__(self, engine, on_output: Callable[[RequestHandle, RequestOutput, float], None] | None = None):
        self.engine = engine
        self.on_output = on_output
        self.on_error: list[Callable[[BaseException], None]] = []  # called once, on the engine thread
        # step exception -> the error callers get instead of EngineFailed (None: keep EngineFailed)
        self.explain_failure: Callable[[BaseException], BaseException | None] | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _handles and _closed only; never held across a step
        self._handles: dict[str, RequestHandle] = {}
        self._closed = False
        self._accepting = True
        self._stop = False
        self.error: BaseException | None = None
        self.num_steps = 0  # steps this thread ran (benchmarks count latencies in steps)
        self._snapshot = self._make_snapshot()
        self._thread = threading.Thread(target=self._run, name="k3serve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers
    def submit(self, prompt, params: SamplingParams | None = None, *, rid: str | None = None,
               priority: int = 0, cache_salt: str | None = None, api_key: str | None = None,
               export: bool = False, on_reserved: Callable[[str], None] | None = None,
               _queue: queue.SimpleQueue | None = None) -> RequestHandle:
        """``export``: a P/D prefill (one token, then the cache on the final output's
        ``handoff``). ``on_reserved``: a P/D decode — the prompt is computed elsewhere; called
        (on the engine thread: it must not block) once a slot and pages are reserved, after
        which :meth:`deliver` hands the engine the ``handoff.Handoff``."""
        if export and on_reserved is not None:
            raise ValueError("a request is either a P/D prefill (export) or a P/D decode (on_reserved)")
        self._check_open()
        ids = self.engine.validate(prompt, params)  # pure: never touches engine state
        rid = rid or f"k3-{uuid.uuid4().hex}"
        h = RequestHandle(self, rid, len(ids), _queue)
        h.submit_step = self.num_steps
        with self._lock:
            self._check_open()
            if rid in self._handles:
                raise RequestError(f"request id {rid!r} is already in use")
            self._handles[rid] = h
            self._inbox.put(("submit", h, (ids, params, priority, cache_salt, api_key, export, on_reserved)))
        return h

    def submit_n(self, prompt, params: SamplingParams, *, rid: str | None = None, **kw) -> HandleGroup:
        """A request for ``params.n`` samples: ``n`` engine requests ``RID#0 .. RID#n-1`` (sample
        ``i``'s params: ``sampling_params.sample_params``), one output queue. The prefix cache
        computes their shared prompt once (the later samples wait for the first). Refused
        whole: a sample that cannot be submitted aborts those before it."""
        from ..engine.sampling_params import sample_params

        self.engine.validate(prompt, params)
        rid = rid or f"k3-{uuid.uuid4().hex}"
        q: queue.SimpleQueue = queue.SimpleQueue()
        handles: list[RequestHandle] = []
        try:
            for i in range(params.n):
                handles.append(self.submit(prompt, sample_params(params, i), rid=f"{rid}#{i}", _queue=q, **kw))
        except BaseException:
            for h in handles:
                h.abort()
            raise
        return HandleGroup(handles)

    def deliver(self, rid: str, handoff) -> None:
        """P/D decode: the handoff of a request submitted with ``on_reserved``."""
        with self._lock:
            h = self._handles.get(rid)
            if h is None or h.finished:
                return
            self._inbox.put(("deliver", h, handoff))

    def fail_request(self, rid: str, err: RequestError) -> bool:
        """End one request with ``err`` (raised by its ``outputs()``; the gRPC status is its
        ``code``) and free what it holds; False if it already ended."""
        with self._lock:
            h = self._handles.get(rid)
            if h is None or h.finished or h.abort_requested:
                return False
            h.abort_requested = True
            self._inbox.put(("abort", h, err))
        return True

    def abort(self, rid: str) -> bool:
        """Abort the live request with this id (or, for an ``n > 1`` request, its samples
        ``RID#i``); False if there is none."""
        with self._lock:
            h = self._handles.get(rid)
            samples = [] if h is not None else [x for r, x in self._handles.items() if r.startswith(rid + "#")]
        if h is not None:
            return h.abort()
        return any([x.abort() for x in samples])

    def _abort_handle(self, h: RequestHandle) -> bool:
        with self._lock:
            if h.finished or h.abort_requested or self._handles.get(h.rid) is not h:
                return False
            h.abort_requested = True
            h.abort_step = self.num_steps
            self._inbox.put(("abort", h, None))
        return True

    def call(self, fn: Callable, timeout: float | None = None):
        """Run ``fn(engine)`` on the engine thread between steps; returns its result."""
        reply: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:  # _close drains the inbox after setting _closed: nothing posted is lost
            if self._closed:
                raise ShuttingDown("the engine thread has stopped")
            self._inbox.put(("call", fn, reply))
        ok, val = reply.get(timeout=timeout)
        if not ok:
            raise val
        return val

    def flush_cache(self) -> int:
        """Drop the cached prefixes (those no running request maps); returns snapshots dropped."""
        return self.call(lambda eng: eng.flush_prefix_cache())

    def in_flight(self, rid: str) -> bool:
        with self._lock:
            return rid in self._handles

    def handle(self, rid: str) -> RequestHandle | None:
        with self._lock:
            return self._handles.get(rid)

    def stats(self) -> dict:
        """The engine's stats as of the last step (published by the engine thread)."""
        return self._snapshot

    @property
    def accepting(self) -> bool:
        return self._accepting

    def _check_open(self) -> None:
        if self.error is not None:
            raise ShuttingDown(f"the engine failed: {self.error!r}")
        if not self._accepting or self._closed:
            raise ShuttingDown("the server is shutting down")

    def drain(self, grace_s: float = 30.0) -> int:
        """Stop admitting; wait up to ``grace_s`` for running requests; abort the rest; stop.
        Returns how many requests had to be aborted."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self._open_handles():
            time.sleep(0.02)
        left = self._open_handles()
        for h in left:
            h.abort()
        t = time.monotonic() + 10.0
        while time.monotonic() < t and self._open_handles() and self._thread.is_alive():
            time.sleep(0.02)
        self.stop()
        return len(left)

    def fail(self, err: BaseException) -> None:
        """Fail the engine from outside its thread (multi-host: a follower was lost). Every
        open handle gets ``err``, new work is refused and the ``on_error`` listeners run. The
        engine thread may be blocked in a collective that never completes: it is not waited
        for (the process exits)."""
        if self.error is not None:
            return
        self.error = err
        self._accepting = False
        self._close(err)
        for cb in list(self.on_error):
            try:
                cb(err)
            except Exception:
                traceback.print_exc()

    def _open_handles(self) -> list[RequestHandle]:
        with self._lock:
            return list(self._handles.values())

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread; every handle still open gets a final ("abort") output."""
        self._stop = True
        self._accepting = False
        self._inbox.put(("stop", None, None))
        if threading.current_thread() is not self._thread:
            # a thread failed from outside (``fail``) may be stuck in a collective: not waited for long
            self._thread.join(timeout=timeout if self.error is None else min(timeout, 1.0))
        self._close()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        eng = self.engine
        idle = False  # the last step launched nothing and output nothing: wait for a message a while
        try:
            while True:
                self._drain_inbox(block=not eng.has_unfinished(), timeout=IDLE_WAIT_S if idle else None)
                if self._stop:
                    for h in self._open_handles():  # the engine may be stepped again by another thread
                        if h.admitted:
                            eng.abort(h.rid)
                    return
                owed = self._apply()  # an applied abort owes its final output: emitted by the next step
                if not (owed or eng.has_unfinished() or eng.has_owed_outputs()):
                    self._publish()
                    continue
                launched, preempted = eng.num_steps, eng.num_preemptions
                outs = eng.step()
                self.num_steps += 1
                self._fail_callbacks()
                now = time.monotonic()
                for out in outs:
                    self._deliver(out, now)
                # e.g. every slot held by P/D reservations waiting for their handoffs while requests
                # queue: nothing moves until a message (deliver, abort) comes
                idle = not outs and eng.num_steps == launched and eng.num_preemptions == preempted \
                    and not eng.has_owed_outputs()
                self._publish()
        except BaseException as e:  # the engine broke: fail every caller, refuse new work
            if self.error is not None:  # already failed from outside (``fail``)
                return
            self.error = e
            self._accepting = False
            print(f"k3serve: engine step failed: {e!r}", file=sys.stderr, flush=True)
            traceback.print_exc()
            err = self.explain_failure(e) if self.explain_failure is not None else None
            self._close(err or EngineFailed(f"the engine failed: {e!r}"))
            try:
                self._publish()
            except Exception:
                pass
            for cb in list(self.on_error):
                try:
                    cb(e)
                except Exception:  # a listener must not hide the engine's error
                    traceback.print_exc()
        finally:
            self._close()

    def _drain_inbox(self, block: bool, timeout: float | None = None) -> None:
        """Take every message posted; ``block``: wait for one first; else ``timeout``: wait up
        to that long for one."""
        self._msgs = []
        if block or timeout is not None:
            try:
                self._msgs.append(self._inbox.get(timeout=None if block else timeout))
            except queue.Empty:
                pass
        while True:
            try:
                self._msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        if any(kind == "stop" for kind, _, _ in self._msgs):
            self._stop = True

    def _apply(self) -> bool:
        """Apply the drained messages, in order, on the engine thread; True if an abort was
        applied (its final output is still owed). A message whose engine call raises fails
        its own request (its ``RequestError``, else ``RequestFailed``) and nothing else: the
        engine's mutating calls between steps either complete or leave it as it was."""
        owed = False
        for kind, h, arg in self._msgs:
            # the engine holds this handle's request (a submit that raised half-way included), not
            # another one of the same id
            ours = kind in ("abort", "deliver") and h.admitted or kind == "submit" and h.rid not in self.engine.requests
            try:
                owed = self._apply_one(kind, h, arg) or owed
            except Exception as e:  # noqa: BLE001 - this message's failure, not the engine's
                owed = self._fail_message(h, e, free=ours) or owed
        self._msgs = []
        return owed

    def _apply_one(self, kind: str, h, arg) -> bool:
        eng = self.engine
        if kind == "submit":
            if h.abort_requested:  # aborted before it ever reached the engine
                self._deliver(_final(h), time.monotonic())
                return False
            ids, params, priority, salt, key, export, on_reserved = arg
            if on_reserved is not None:
                eng.admit_prefilled(ids, params, rid=h.rid, priority=priority, cache_salt=salt, api_key=key,
                                    on_reserved=on_reserved)
            else:
                eng.admit(ids, params, rid=h.rid, priority=priority, cache_salt=salt, api_key=key, export=export)
            h.admitted = True
            h.admit_step = self.num_steps
        elif kind == "abort":
            owed = False
            try:
                if h.admitted and not h.finished and eng.abort(h.rid):
                    h.freed_step = self.num_steps
                    owed = True
            finally:
                if arg is not None:  # fail_request: the caller gets this error, not an abort
                    self._fail(h, arg)
            return owed
        elif kind == "deliver":
            if h.admitted and not h.finished:
                eng.deliver(h.rid, arg)
        elif kind == "call":
            try:
                res = (True, h(eng))
            except Exception as e:
                res = (False, e)
            self._publish()  # the caller sees the call's effect in stats() at once
            arg.put(res)
        return False

    def _fail_message(self, h, err: Exception, free: bool) -> bool:
        """``h``'s message raised ``err``: end that request alone (freed in the engine if it
        got there) with ``err`` if it is a ``RequestError``, else ``RequestFailed``. True if
        the engine owes a final output for it."""
        if not isinstance(err, RequestError):
            print(f"k3serve: request {h.rid!r} failed on the engine thread: {err!r}", file=sys.stderr, flush=True)
            traceback.print_exc()
            err = RequestFailed(f"request {h.rid!r} failed: {err!r}")
        owed = False
        try:
            owed = self.engine.abort(h.rid) if free else False
        except Exception:  # noqa: BLE001 - already failing: the caller gets the first error
            traceback.print_exc()
        self._fail(h, err)
        return owed

    def _fail_callbacks(self) -> None:
        """Requests whose ``on_reserved`` raised in the last step (the engine aborted them)."""
        errs = getattr(self.engine, "callback_errors", None)
        while errs:
            rid, e = errs.popitem()
            h = self.handle(rid)
            if h is not None:
                print(f"k3serve: the reservation callback of {rid!r} failed: {e!r}", file=sys.stderr, flush=True)
                self._fail(h, e if isinstance(e, RequestError) else RequestFailed(f"request {rid!r} failed: {e!r}"))

    def _deliver(self, out: RequestOutput, now: float) -> None:
        with self._lock:
            h = self._handles.get(out.rid)
            if h is None or h.finished:
                return
            if out.finished:
                h.finished = True
                del self._handles[out.rid]
        if out.new_token_ids and h.first_token_at is None:
            h.first_token_at = now
        if self.on_output is not None:
            self.on_output(h, out, now)
        if out.new_token_ids:
            h.last_token_at = now
        h._q.put(out)

    def _fail(self, h: RequestHandle, err: BaseException) -> None:
        with self._lock:
            if h.finished:
                return
            h.finished = True
            if self._handles.get(h.rid) is h:
                del self._handles[h.rid]
        h._q.put(err)

    def _close(self, err: BaseException | None = None) -> None:
        """No more work: every open handle gets ``err`` (raised by its ``outputs()``) or else a
        final "abort" output; pending calls get ``ShuttingDown``."""
        with self._lock:
            self._closed = True
            left = list(self._handles.values())
        while True:  # submits and calls posted after the thread's last drain
            try:
                kind, h, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "call":
                arg.put((False, err or ShuttingDown("the engine thread has stopped")))
        for h in left:
            if err is not None:
                self._fail(h, err)
            else:
                with self._lock:
                    if h.finished:
                        continue
                    h.finished = True
                    self._handles.pop(h.rid, None)
                h._q.put(_final(h))

    def _make_snapshot(self) -> dict:
        with self._lock:
            active = len(self._handles)
        return {**self.engine.stats(), "active_requests": active, "loop_steps": self.num_steps}

    def _publish(self) -> None:
        self._snapshot = self._make_snapshot()  # one reference swap: readers see a whole snapshot
