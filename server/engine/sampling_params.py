"""Per-request sampling settings, validated once when a request arrives.

Why a separate, plain dataclass: the API layers (gRPC, CLI, tests) build one of these per
request and the engine keeps it for the request's lifetime. Validating here, in
``__post_init__``, means a bad value is rejected with a clear ``ValueError`` at the door
instead of surfacing as NaNs or an index error inside a jitted batch step shared with
other requests. The fields that only the engine interprets (``max_new_tokens``,
``min_new_tokens``, ``stop``, ``stop_token_ids``, ``ignore_eos``) live here too, so a
request carries one settings object; ``server.sampler`` reads the numeric ones.

Conventions (vLLM / OpenAI style):
  * ``temperature == 0`` means greedy (argmax of the penalized logits); so does any
    temperature below ``GREEDY_TEMPERATURE`` (1e-5).
  * ``top_k`` of 0 or -1 turns top-k off.
  * ``logprobs`` is the number of top alternatives to report per generated token
    (0 reports only the chosen token's log-prob); ``None`` reports nothing.
  * ``seed`` of ``None`` lets the engine pick one; any Python int is accepted (the sampler
    folds it to 32 bits).
  * ``logit_bias`` maps token ids to an additive bias in [-100, 100] (OpenAI's range; at most
    ``MAX_LOGIT_BIAS`` ids), applied after the penalties: -100 removes an id in practice, +100
    forces it. Reported logprobs stay the model's (before the bias).
  * ``token_ids_logprob`` lists ids (at most ``MAX_TOKEN_IDS_LOGPROB``) whose log-probs are
    reported at every generated position, whatever was sampled.
  * ``regex`` / ``json_schema`` / ``ebnf`` / ``structural_tag`` (at most one): the output must
    match it (``server/structured``); a grammar that ends stops the request.
  * ``n`` samples of one prompt (parallel sampling): the API layers (``LLM``, the gRPC
    server) run them as ``n`` requests (:func:`sample_params`), whose shared prompt the prefix
    cache computes once; the engine itself serves ``n == 1``.
"""
from __future__ import annotations

import dataclasses
import math

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # ids one request may bias (the sampler's token table holds them)
LOGIT_BIAS_RANGE = 100.0
MAX_TOKEN_IDS_LOGPROB = 32  # ids one request may ask log-probs of at every position
PENALTY_RANGE = 2.0
# Temperatures below this are treated as greedy (as vLLM does): dividing by a tiny
# temperature only amplifies rounding noise, and the result is argmax anyway.
GREEDY_TEMPERATURE = 1e-5


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_new_tokens: int = 0
    logit_bias: dict | None = None
    token_ids_logprob: tuple[int, ...] = ()
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    n: int = 1

    def __post_init__(self):
        # integers
        for name in ("max_new_tokens", "top_k", "min_new_tokens", "n"):
            v = getattr(self, name)
            if not _is_int(v):
                raise ValueError(f"{name} must be an int, got {v!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must be <= "
                             f"max_new_tokens ({self.max_new_tokens})")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")

        # reals (ints accepted, stored as float); NaN fails every range check below
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _is_real(v):
                raise ValueError(f"{name} must be a number, got {v!r}")
            setattr(self, name, float(v))
        if not (0.0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), "
                             f"got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0.0 < self.repetition_penalty < math.inf):
            raise ValueError(f"repetition_penalty must be finite and > 0, "
                             f"got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not (-PENALTY_RANGE <= v <= PENALTY_RANGE):
                raise ValueError(f"{name} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], "
                                 f"got {v}")

        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.logprobs is not None:
            if not _is_int(self.logprobs) or not (0 <= self.logprobs <= MAX_LOGPROBS):
                raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                                 f"got {self.logprobs!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

        # sequences: accept any iterable except a bare string, store as tuples
        if isinstance(self.stop, str):
            raise ValueError("stop must be a sequence of strings, not a single string "
                             f"(did you mean stop=({self.stop!r},)?)")
        try:
            self.stop = tuple(self.stop)
            self.stop_token_ids = tuple(self.stop_token_ids)
        except TypeError as e:
            raise ValueError(f"stop and stop_token_ids must be sequences: {e}") from None
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {t!r}")

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias has {len(self.logit_bias)} ids; at most {MAX_LOGIT_BIAS}")
            bias = {}
            for t, b in self.logit_bias.items():
                if not _is_int(t) or t < 0:
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {t!r}")
                if not _is_real(b) or not (-LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE):
                    raise ValueError(f"logit_bias values must be numbers in [-{LOGIT_BIAS_RANGE:g}, "
                                     f"{LOGIT_BIAS_RANGE:g}], got {b!r} for id {t}")
                bias[int(t)] = float(b)
            self.logit_bias = bias or None
        if isinstance(self.token_ids_logprob, (str, bytes)):
            raise ValueError("token_ids_logprob must be a sequence of token ids")
        try:
            self.token_ids_logprob = tuple(self.token_ids_logprob)
        except TypeError as e:
            raise ValueError(f"token_ids_logprob must be a sequence of token ids: {e}") from None
        if len(self.token_ids_logprob) > MAX_TOKEN_IDS_LOGPROB:
            raise ValueError(f"token_ids_logprob has {len(self.token_ids_logprob)} ids; "
                             f"at most {MAX_TOKEN_IDS_LOGPROB}")
        for t in self.token_ids_logprob:
            if not _is_int(t) or t < 0:
                raise ValueError(f"token_ids_logprob must be non-negative ints, got {t!r}")
        kinds = [k for k in ("regex", "json_schema", "ebnf", "structural_tag") if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise ValueError(f"at most one constraint per request, got {kinds}")
        if kinds:
            from ..structured.grammar import Constraint

            Constraint(kinds[0], getattr(self, kinds[0]))  # validates kind, type, size

    @property
    def constraint(self):
        """The request's :class:`~k3serve.server.structured.grammar.Constraint`, or None."""
        from ..structured.grammar import Constraint

        for k in ("regex", "json_schema", "ebnf", "structural_tag"):
            if getattr(self, k) is not None:
                return Constraint(k, getattr(self, k))
        return None

    @property
    def greedy(self) -> bool:
        """True when the sampler takes the argmax (temperature 0, or below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE


def sample_params(params: SamplingParams, i: int) -> SamplingParams:
    """Sample ``i`` of a request with ``n`` samples: the same settings, ``n = 1``, and its own
    seed stream (``seed + i`` when the request is seeded; else the engine draws one per sample)."""
    q = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
    q.stop_token_ids = params.stop_token_ids  # as the caller holds them (the gRPC layer: a set)
    return q
