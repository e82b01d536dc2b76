"""The engine on a thread: many callers submit, stream and abort; one thread steps.

``Engine`` is single-threaded. ``EngineThread`` owns it and runs ``Engine.step()`` on a
background thread whenever there is work, and sleeps on a condition variable when there is
none. Callers (gRPC handler threads) talk to it through:

* ``submit(prompt, params, rid=None, priority=0) -> RequestHandle`` — validates at once
  (raises the engine's ``RequestError`` subclasses, so a bad request changes nothing);
* ``RequestHandle.outputs(timeout)`` — an iterator of ``RequestOutput`` deltas, the last one
  finished; ``RequestHandle.abort()`` / ``EngineThread.abort(rid)``;
* ``drain(grace_s)`` — stop admitting, let running requests finish for up to ``grace_s``
  seconds, abort the rest, and stop the thread.

Engine calls happen under one lock, so a submit waits at most for the current step's host
part. Time-to-first-token and inter-token latency are observed here (``on_output`` hook).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Iterator

from ..engine.request import RequestError, RequestOutput
from ..engine.sampling_params import SamplingParams


class ShuttingDown(RequestError):
    code = "UNAVAILABLE"


class RequestHandle:
    def __init__(self, loop: "EngineThread", rid: str, num_prompt: int):
        self.loop = loop
        self.rid = rid
        self.num_prompt = num_prompt
        self.submitted = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self._q: queue.Queue[RequestOutput] = queue.Queue()
        self.finished = False

    def outputs(self, poll_s: float = 0.1, should_stop: Callable[[], bool] | None = None) -> Iterator[RequestOutput]:
        """Deltas until the finished one. ``should_stop`` (polled) aborts the request, e.g.
        when the gRPC client went away; the abort's final output still arrives."""
        aborted = False
        while True:
            try:
                out = self._q.get(timeout=poll_s)
            except queue.Empty:
                if not aborted and should_stop is not None and should_stop():
                    aborted = True
                    self.abort()
                continue
            yield out
            if out.finished:
                return

    def abort(self) -> bool:
        return self.loop.abort(self.rid)


class EngineThread:
    def __init__(self, engine, on_output: Callable[[RequestHandle, RequestOutput, float], None] | None = None):
        self.engine = engine
        self.on_output = on_output
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._handles: dict[str, RequestHandle] = {}
        self._accepting = True
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="k3serve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers
    def submit(self, prompt, params: SamplingParams | None = None, *, rid: str | None = None,
               priority: int = 0, cache_salt: str | None = None, api_key: str | None = None) -> RequestHandle:
        with self._lock:
            if not self._accepting or self.error is not None:
                raise ShuttingDown("the server is shutting down" if self.error is None
                                   else f"the engine failed: {self.error!r}")
            rid = self.engine.add_request(prompt, params, rid=rid, priority=priority, cache_salt=cache_salt,
                                          api_key=api_key)
            h = RequestHandle(self, rid, len(self.engine.requests[rid].prompt))
            self._handles[rid] = h
            self._wake.notify()
            return h

    def abort(self, rid: str) -> bool:
        with self._lock:
            ok = self.engine.abort(rid)
            self._wake.notify()
            return ok

    def flush_cache(self) -> int:
        """Drop the cached prefixes (those no running request maps); returns snapshots dropped."""
        with self._lock:
            return self.engine.flush_prefix_cache()

    def in_flight(self, rid: str) -> bool:
        with self._lock:
            return rid in self._handles

    def stats(self) -> dict:
        with self._lock:
            return {**self.engine.stats(), "active_requests": len(self._handles)}

    @property
    def accepting(self) -> bool:
        return self._accepting

    def drain(self, grace_s: float = 30.0) -> int:
        """Stop admitting; wait up to ``grace_s`` for running requests; abort the rest; stop.
        Returns how many requests had to be aborted."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._handles:
                    break
            time.sleep(0.02)
        with self._lock:
            left = list(self._handles)
            for rid in left:
                self.engine.abort(rid)
            self._wake.notify()
        t = time.monotonic() + 10.0
        while time.monotonic() < t:
            with self._lock:
                if not self._handles:
                    break
            time.sleep(0.02)
        self.stop()
        return len(left)

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._accepting = False
            self._wake.notify()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stop and not self.engine.has_unfinished() and not self._owed():
                        self._wake.wait()
                    if self._stop:
                        return
                    outs = self.engine.step()
                    now = time.monotonic()
                    for out in outs:
                        h = self._handles.get(out.rid)
                        if h is None:
                            continue
                        if out.new_token_ids:
                            if h.first_token_at is None:
                                h.first_token_at = now
                        if self.on_output is not None:
                            self.on_output(h, out, now)
                        if out.new_token_ids:
                            h.last_token_at = now
                        if out.finished:
                            h.finished = True
                            del self._handles[out.rid]
                        h._q.put(out)
        except BaseException as e:  # the engine broke: fail every caller, refuse new work
            self.error = e
            with self._lock:
                self._accepting = False
                for rid, h in list(self._handles.items()):
                    h._q.put(RequestOutput(rid, [], [], True, "abort", None, h.num_prompt, 0))
                self._handles.clear()
            raise

    def _owed(self) -> bool:
        """An aborted request still owes its final output (emitted by the next step)."""
        return any(r.finished for r in self.engine.requests.values())
