"""A request's life in the engine: tokens, progress through the cache, and outputs.

``num_computed`` counts the tokens of ``prompt + output`` whose MLA rows and KDA state are
in the cache. A request in prefill has many uncomputed tokens; in decode exactly one (the
last sampled token). Preemption drops the cache (``num_computed = 0``) and the request is
recomputed later from ``prompt + output`` — generated tokens are kept, never re-sampled.

With async scheduling a sampled token can still be on the device when the next step is
planned: ``pending`` counts such tokens (at most one per in-flight step) and
``sample_row`` names the (step, row) whose device output holds the newest one, so the next
step can feed it as its input without the host ever seeing it first. Under speculative
decoding an in-flight verify row may emit up to ``1 + pending_drafts`` tokens: until it
returns, the request counts them all (``num_tokens``, ``num_generated`` and ``num_computed``
are upper bounds) and the next row's start is corrected on the device (``runner``).
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
import time

from .sampling_params import SamplingParams

_ids = itertools.count()


def next_request_number() -> int:
    """A process-wide increasing number (request order; generated request ids)."""
    return next(_ids)


class RequestError(ValueError):
    """A request the engine refuses; ``code`` names the gRPC status it maps to."""

    code = "INVALID_ARGUMENT"


class OutOfRangeError(RequestError):
    """A value outside what the model or the context allows (token ids, lengths)."""

    code = "OUT_OF_RANGE"


class CapacityError(RequestError):
    """The request cannot fit the engine's KV budget even alone."""

    code = "RESOURCE_EXHAUSTED"


class HandoffLost(RequestError):
    """A P/D handoff's arrays did not reach this engine (a prefill process died mid-transfer)."""

    code = "UNAVAILABLE"


class EngineError(RuntimeError):
    """A step failed, or the engine is broken by an earlier failed step (an internal error,
    not the request's fault: ``code`` is the gRPC status it maps to)."""

    code = "INTERNAL"


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    rid: str = ""
    priority: int = 0  # lower value is served first; FCFS among equals
    seed: int = 0
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    order: int = dataclasses.field(default_factory=lambda: next(_ids))
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)  # per output token: (lp, [(id, lp), ...])
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None
    num_preemptions: int = 0
    emitted: int = 0  # output tokens already handed to the caller
    pending: int = 0  # sampled tokens not yet back on the host (async scheduling)
    sample_row: tuple[int, int] | None = None  # (step number, row) of the newest pending token
    # speculative + async: drafts on the in-flight row, counted as accepted until its step returns
    # (an optimistic ``num_computed`` and ``num_tokens``; the next row's start is corrected on the device)
    pending_drafts: int = 0
    inflight_drafts: tuple = ()  # the drafts of the newest in-flight row (a host drafter proposes after them)
    follow_guess: tuple | None = None  # (step, drafts, token, row) a launched follow row assumed of that step's row
    # how often its verify rows accepted every draft (an average over the last few, from 1): a
    # guess of an in-flight row's outcome needs that; below ``scheduler.FOLLOW_MIN_FULL_RATE``
    # the next row waits for the verify row to return (async speculation with a host drafter)
    spec_full_rate: float = 1.0
    salt: bytes = b""  # prefix-cache tenant (prefix.tenant_salt): requests of two tenants share nothing
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache at first admission
    boundaries: set = dataclasses.field(default_factory=set)  # extra snapshot boundaries (prefix cache)
    read_slot: int | None = None  # a prefix hit: the snapshot slot the next step reads its KDA state from
    chain: object = None  # prefix keys over the known tokens (prefix.PrefixChain), grown lazily
    chain_len: int = 0  # tokens the chain has consumed
    stop_text: object = None  # [incremental detokenizer, last max(len(stop)) - 1 chars] (stop strings)
    export: bool = False  # P/D prefill: hand the cache over after the first token (handoff.py)
    handoff: object = None  # the exported handoff.Handoff, on the final output
    prefilled: object = None  # P/D decode: the handoff.Handoff to write into the reservation
    awaiting: bool = False  # P/D decode: holds (or waits for) a reservation, no handoff taken yet
    spec_fold: int = 0  # speculative: drafts accepted by the last step, committed at the start of the next
    spec_draft_tokens: int = 0  # drafts verified for this request
    spec_accepted_tokens: int = 0  # drafts accepted
    grammar: object = None  # constrained decoding: its structured.grammar.Matcher, advanced per token
    id_logprobs: list = dataclasses.field(default_factory=list)  # token_ids_logprob: per output token [(id, lp)]

    def __post_init__(self):
        if not self.rid:
            self.rid = f"req-{self.order}"

    @property
    def tokens(self) -> list[int]:
        """``prompt + output`` as a new list: O(L), so not for per-step paths (use
        :meth:`token_slice`)."""
        return self.prompt + self.output

    def token_slice(self, a: int, b: int) -> list[int]:
        """Tokens ``a:b`` of ``prompt + output`` without building the whole sequence: O(b - a)."""
        P = len(self.prompt)
        if b <= P:
            return self.prompt[a:b]
        if a >= P:
            return self.output[a - P:b - P]
        return self.prompt[a:] + self.output[:b - P]

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens, counting those still on the device (an in-flight verify
        row's drafts as if all were accepted: at most this many)."""
        return len(self.prompt) + len(self.output) + self.pending + self.pending_drafts

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host has (the first ``num_known`` of the sequence)."""
        return len(self.prompt) + len(self.output)

    @property
    def num_generated(self) -> int:
        return len(self.output) + self.pending + self.pending_drafts

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def sort_key(self):
        return (self.priority, self.order)


@dataclasses.dataclass
class RequestOutput:
    """What the engine reports for a request after a step: the tokens (and logprobs) new since
    its last output, and on the final output (``finished``) the whole output as well. Per step
    the cost is proportional to the new tokens, never to the sequence."""

    rid: str
    new_token_ids: list[int]
    token_ids: list[int] | None  # every output token; only on the finished output (else None)
    finished: bool
    finish_reason: str | None
    matched_stop: int | str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list | None = None  # finished output: per output token (logprob, [(id, logprob), ...])
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    new_logprobs: list | None = None  # the logprobs of ``new_token_ids`` (when logprobs were asked)
    handoff: object = None  # P/D prefill: the final output's handoff.Handoff
    spec_draft_tokens: int = 0  # speculative decoding: drafts verified so far
    spec_accepted_tokens: int = 0  # and accepted
    # token_ids_logprob: per output token [(id, logprob), ...], for ``new_token_ids`` (and, on the
    # finished output, ``id_logprobs`` for every output token)
    new_id_logprobs: list | None = None
    id_logprobs: list | None = None
