"""Continuous batching: which requests run this step, with how many tokens.

Each step has a token budget (``max_num_batched_tokens``) and a row limit
(``max_num_seqs``). Running requests are served first, oldest (by priority, then arrival)
first: a decode row takes one token, a prefill takes a chunk of at most ``chunk_size``
tokens — so one step mixes prefill chunks and decode rows. Waiting requests are then
admitted FCFS while a KDA slot, pages and budget remain.

Prefix caching (``prefix``, a ``cache.prefix_cache.PrefixCache``): an admitted request
starts from the longest cached prefix that has both pages and a KDA snapshot (snapshots are
taken inside the step, so chunks ignore boundaries), and cached prefixes are evicted (LRU)
before any running request is preempted for pages. A request whose prefix another running request is
still computing waits for it (see ``prefix_cache``), without holding back those behind it.

When pages run out for a running request, the newest running requests not yet scheduled in
this step are preempted (their pages and slot freed; they are recomputed later from
prompt + output). The oldest running request therefore always makes progress, and since a
request is only accepted if it fits the whole KV cache on its own, nothing deadlocks.

With async scheduling the plan for step N+1 is made while step N runs: a request whose
token of step N is still on the device counts it (``Request.pending``) and gets a decode
row for it; a request that has generated all it may (``max_new_tokens`` or
``max_model_len``, pending tokens included) is not scheduled again.

Speculative decoding with async scheduling: a verify row in flight emits between 1 and
``1 + d`` tokens, unknown until its step returns. The request counts all ``d`` drafts as
accepted meanwhile (``Request.pending_drafts``): its next row starts where they would end,
takes pages for that worst case, and the step corrects the row's start on the device from
the accepted count (``runner``). Its drafts are proposed after the in-flight drafts and a
guessed last token (the drafter's ``propose(..., after=...)``: the first proposed token is the
guess), and the device drops them unless the in-flight row accepted every draft and emitted
that token; a drafter that proposes on the device (DSpark, ``on_device``) needs no guess: the
row takes the block the previous step proposed after the tokens it actually emitted.
"""
from __future__ import annotations

import bisect
import dataclasses

from .request import Request, Status


# async + speculation with a host drafter: while a running request's verify rows accept all their
# drafts less often than this (``Request.spec_full_rate``), the engine plans the next step after
# the one in flight returns (``Scheduler.prefers_sync``) rather than on guesses of its outcome. A
# failed guess costs a verify row that emits one token; a held one saves the host's share of a
# step (about a fifth on the CPU demo model: plain async decoding runs ~1.2x synchronous), so
# guessing pays when it holds more than ~3 times in 4.
FOLLOW_MIN_FULL_RATE = 0.9


@dataclasses.dataclass
class ScheduledRow:
    req: Request
    start: int  # first token position computed in this step (= req.num_computed)
    num_tokens: int
    samples: bool  # the chunk reaches the end of the request's tokens: sample a new token
    decode: bool = False  # a decode row: the request's last token (plus drafts), never a prefill chunk
    drafts: tuple = ()  # speculative: proposed tokens after the last one (counted in num_tokens)
    # speculative + async, a decode row whose input is still on the device: the in-flight row's
    # drafts its start counts as accepted (the device subtracts the rejected ones) ...
    assumed: int = 0
    guess: int = -1  # ... and the token that row must emit last for ``drafts`` to stand (-1: any)
    device_drafts: bool = False  # the drafts are the previous step's block on the device (DSpark)
    epoch: int = 0  # the request's preemptions when planned (a row of a preempted request commits nothing)
    dropped: int = 0  # drafts the host learnt the device drops (the guess failed) while the row was in flight


@dataclasses.dataclass
class StepPlan:
    rows: list[ScheduledRow]
    preempted: list[Request]
    reserved: list[Request] = dataclasses.field(default_factory=list)  # P/D decode: slot + pages held

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


class Scheduler:
    def __init__(self, cache_mgr, *, max_num_seqs: int, max_num_batched_tokens: int, chunk_size: int,
                 max_model_len: int | None = None, prefix_cache=None, drafter=None, max_drafts: int = 0,
                 spec_max_rows: int | None = None):
        """``drafter`` (speculative decoding): ``propose(req, max_tokens) -> list[int]``, asked for
        every decode row while at most ``spec_max_rows`` requests run (None: always); a row
        carries at most ``max_drafts`` drafts, fewer near ``max_new_tokens``, ``max_model_len``
        or the end of the token budget, none when its pages would not fit them."""
        self.drafter = drafter
        self.max_drafts = max_drafts
        self.spec_max_rows = spec_max_rows
        self.cache_mgr = cache_mgr
        self.prefix_cache = prefix_cache
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        keys = [r.sort_key() for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, req.sort_key()), req)

    def has_work(self) -> bool:
        """Something to admit or to run (a P/D reservation waiting for its handoff is neither)."""
        return bool(self.waiting) or any(not r.awaiting for r in self.running)

    def remove(self, req: Request) -> None:
        """Take a request out (finish or abort) and free what it holds."""
        if req in self.running:
            self.running.remove(req)
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def _complete(self, req: Request) -> bool:
        """All tokens are generated; the last ones are still on their way back from the device."""
        return req.num_generated >= req.params.max_new_tokens or (
            self.max_model_len is not None and req.num_tokens >= self.max_model_len)

    def _release(self, req: Request) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.release(req)
        self.cache_mgr.release(req.rid)

    def _unadmit(self, req: Request) -> None:
        """Give back what an admission in progress took; the request stays waiting."""
        self._release(req)
        req.num_computed = 0

    def _grow(self, req: Request, total: int) -> bool:
        """ensure_tokens, evicting cached prefixes of the request's group first."""
        while not self.cache_mgr.ensure_tokens(req.rid, total):
            if self.prefix_cache is None or not self.prefix_cache.reclaim(self.cache_mgr.group_of(req.rid)):
                return False
        return True

    def _drafts(self, req: Request, budget: int) -> tuple[tuple, int, bool]:
        """The drafts of ``req``'s decode row, the token they assume the in-flight row emits
        last (-1: none assumed) and whether they are the device's block (DSpark): what the
        drafter proposes, cut so that the row fits the budget and the emitted tokens (at most
        drafts + 1) stay within ``max_new_tokens`` and ``max_model_len`` (counting the in-flight
        drafts as accepted). With the row's input still on the device, a host drafter proposes
        after the in-flight drafts: its first token is the guessed input, the rest the drafts."""
        if req.grammar is not None:  # its matcher must see each token before the next is sampled
            return (), -1, False
        room = min(self.max_drafts, budget - 1, req.params.max_new_tokens - req.num_generated - 1)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - req.num_tokens - 1)
        if room <= 0:
            return (), -1, False
        if not req.pending:
            return tuple(int(t) for t in self.drafter.propose(req, room)[:room]), -1, False
        if getattr(self.drafter, "on_device", False):
            return (0,) * room, -1, True
        got = [int(t) for t in self.drafter.propose(req, room + 1, after=req.inflight_drafts)[:room + 1]]
        if len(got) < 2:
            return (), -1, False
        return tuple(got[1:]), got[0], False

    def prefers_sync(self) -> bool:
        """Async scheduling with a host drafter: some running request would be planned on a
        guess of its in-flight verify row that would mostly fail (``FOLLOW_MIN_FULL_RATE``), so
        the next step is better planned once the step in flight has returned."""
        if self.drafter is None or getattr(self.drafter, "on_device", False):
            return False
        if self.spec_max_rows is not None and len(self.running) > self.spec_max_rows:
            return False
        return any(r.pending and r.spec_full_rate < FOLLOW_MIN_FULL_RATE and not self._complete(r)
                   for r in self.running)

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.spec_fold = 0  # the slot's state is dropped with the journal's pending drafts
        req.num_preemptions += 1
        plan.preempted.append(req)
        self.add(req)

    def schedule(self) -> StepPlan:
        plan = StepPlan([], [])
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        speculate = self.drafter is not None and (self.spec_max_rows is None or len(self.running) <= self.spec_max_rows)
        # decode rows first (one token each), then prefill chunks from what is left of the
        # budget, oldest first within each: a long prefill never delays a decoding request
        for req in sorted(self.running, key=lambda r: (r.remaining > 1, r.sort_key())):
            if req.status is not Status.RUNNING or req.awaiting or len(plan.rows) >= self.max_num_seqs or budget <= 0:
                continue
            if self._complete(req):
                continue
            n = min(req.remaining, self.chunk_size, budget)
            decode = req.remaining == 1
            drafts, guess, on_dev = self._drafts(req, budget) if decode and speculate else ((), -1, False)
            if drafts and not self._grow(req, req.num_computed + 1 + len(drafts)):
                drafts = ()  # no pages for the drafts: decode without them (no preemption for a guess)
            n += len(drafts)
            if req.pending_drafts and not self._grow(req, req.num_computed + n):
                continue  # pages for in-flight drafts that may be rejected: wait for the step, preempt no one
            while not self._grow(req, req.num_computed + n):
                # only a request of the same attention DP group frees pages this one can use
                group = self.cache_mgr.group_of(req.rid)
                # (not one whose last token is on its way back: it is about to leave anyway, and a
                # P/D prefill must still read its cache out)
                victims = [r for r in self.running if r.rid not in scheduled and r is not req
                           and self.cache_mgr.group_of(r.rid) == group and not self._complete(r)
                           and not r.awaiting]
                victim = max(victims + [req], key=Request.sort_key)  # the newest request yields
                self._preempt(victim, plan)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            plan.rows.append(ScheduledRow(req, req.num_computed, n, req.num_computed + n - len(drafts) == req.num_tokens,
                                          decode, drafts, req.pending_drafts if decode else 0,
                                          guess if drafts else -1, on_dev and bool(drafts), req.num_preemptions))
            scheduled.add(req.rid)
            budget -= n
        # admit waiting requests (not ones preempted in this very step)
        for req in list(self.waiting):
            if len(plan.rows) >= self.max_num_seqs or budget <= 0 or plan.preempted:
                break
            pre = req.awaiting  # P/D decode: the prompt is computed elsewhere, its cache arrives
            hit = None
            if self.prefix_cache is not None:  # a P/D decode maps only pages held on the device, never waits
                hit = self.prefix_cache.lookup_pages(req) if pre else self.prefix_cache.lookup(req)
            if hit == "wait":
                continue  # another running request is computing this prefix: resume from it later
            if hit is not None and hit.group is not None and not self.cache_mgr.admit(req.rid, group=hit.group,
                                                                                  rank0=hit.rank0):
                hit = None  # the hit's DP group is full: compute it elsewhere
            if req.rid not in self.cache_mgr and not self.cache_mgr.admit(req.rid):
                break
            if self.prefix_cache is not None and not self.prefix_cache.start(req, hit):
                self._unadmit(req)
                break
            # a P/D decode reserves its prompt and first token and gets no row until its handoff is in
            n = 0 if pre else min(req.remaining, self.chunk_size, budget)
            if pre:
                req.num_computed = len(req.prompt)
            if not self._grow(req, req.num_computed + max(n, 1)):
                self._unadmit(req)
                break
            self.waiting.remove(req)
            self.running.append(req)
            req.status = Status.RUNNING
            if pre:
                plan.reserved.append(req)
                continue
            plan.rows.append(ScheduledRow(req, req.num_computed, n, req.num_computed + n == req.num_tokens,
                                          epoch=req.num_preemptions))
            budget -= n
        return plan
