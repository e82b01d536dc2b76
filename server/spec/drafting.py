"""The engine's drafters: what ``Engine(speculative=...)`` asks for a decode row's drafts.

A drafter here follows the engine's requests: :meth:`propose` is called with the request
(``server.engine.request.Request``: its ``prompt``, committed ``output``, ``rid`` and tenant
``salt``) and the most drafts its row may carry; :meth:`finish` when the request leaves (done,
aborted or failed). With async scheduling a row may be planned while the request's previous
row is still on the device: then ``propose(req, max_tokens, after=drafts)`` proposes for the
committed tokens followed by that row's drafts (all assumed accepted), and its first token is
taken as the guess of the token that row emits last (``scheduler``; at most ``k + 1``
tokens). The drafter feeds itself the tokens the request committed since its last
call, so the engine never has to tell it what was accepted.

* ``ngram`` (prompt lookup, ``ngram.NgramIndex``): one index per request over prompt + output.
* ``suffix`` (``suffix.SuffixDrafter``): a path-compressed suffix tree per request and one per
  tenant (the prefix cache's tenant: ``cache_salt`` or the API key), never shared across
  tenants. The request's tree is built on its first proposal over the last
  ``max_prompt_tokens`` (131,072; None: all) of the prompt: about 250 bytes and 1.6 us per
  token of non-repeating text, so a 100K-token prompt is indexed whole (~24 MB, ~0.16 s
  once, measured by ``tools/suffix_cost.py``), and a million-token one costs at most ~32 MB.

* ``dspark`` (``dspark_drafting.DSparkEngineDrafter``): the draft model proposes on the device
  after each step; this keeps the last block per request and hands it out.

:func:`make_drafter` builds one from the ``speculative`` settings (``method``,
``num_speculative_tokens`` and the method's options).
"""
from __future__ import annotations

from .ngram import NgramIndex
from .suffix import SuffixDrafter

METHODS = ("ngram", "suffix", "dspark")


class NgramEngineDrafter:
    def __init__(self, num_speculative_tokens: int, max_ngram: int = 4, min_ngram: int = 1) -> None:
        self.k = num_speculative_tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._index: dict[str, tuple[NgramIndex, int]] = {}  # rid -> (index, output tokens fed)

    def propose(self, req, max_tokens: int, after=()) -> list[int]:
        got = self._index.get(req.rid)
        if got is None:
            index = NgramIndex(self.max_ngram, self.min_ngram, self.k)
            index.extend(req.prompt)
            fed = 0
        else:
            index, fed = got
        index.extend(req.output[fed:])
        self._index[req.rid] = (index, len(req.output))
        return index.propose(min(max_tokens, self.k + 1), after)

    def finish(self, req, keep: bool = True) -> None:
        self._index.pop(req.rid, None)


class SuffixEngineDrafter:
    def __init__(self, num_speculative_tokens: int, max_depth: int = 24, max_tenant_sequences: int = 256,
                 min_match: int = 2, max_prompt_tokens: int | None = 131072) -> None:
        self.k = num_speculative_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.drafter = SuffixDrafter(max_depth=max_depth, max_tokens=num_speculative_tokens,
                                     max_tenant_sequences=max_tenant_sequences, min_match=min_match)
        self._fed: dict[str, int] = {}  # rid -> output tokens fed

    def propose(self, req, max_tokens: int, after=()) -> list[int]:
        fed = self._fed.get(req.rid)
        if fed is None:
            prompt = req.prompt if self.max_prompt_tokens is None else req.prompt[-self.max_prompt_tokens:]
            self.drafter.start(req.rid, req.salt.hex(), prompt)
            fed = 0
        if len(req.output) > fed:
            self.drafter.extend(req.rid, req.output[fed:])
        self._fed[req.rid] = len(req.output)
        return self.drafter.propose(req.rid, min(max_tokens, self.k + 1), after)

    def finish(self, req, keep: bool = True) -> None:
        """``keep``: the output joins the tenant's trie (a finished request, not an aborted one)."""
        if self._fed.pop(req.rid, None) is None:
            return
        if keep:
            self.drafter.finish(req.rid)
        else:
            self.drafter.abort(req.rid)


def make_drafter(settings: dict):
    """A drafter for ``settings`` (``{"method": "ngram"|"suffix", "num_speculative_tokens": k,
    ...options}``); raises ``ValueError`` on an unknown method or option."""
    opts = dict(settings)
    method = opts.pop("method", None)
    k = int(opts.pop("num_speculative_tokens", 0))
    opts.pop("max_rows", None)
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    if method == "ngram":
        return NgramEngineDrafter(k, **opts)
    if method == "suffix":
        return SuffixEngineDrafter(k, **opts)
    if method == "dspark":  # the engine loads the draft model itself (``draft_model``)
        from .dspark_drafting import DSparkEngineDrafter

        opts.pop("draft_model", None)
        if opts:
            raise ValueError(f"unknown options for speculative method 'dspark': {sorted(opts)}")
        return DSparkEngineDrafter(k)
    raise ValueError(f"unknown speculative method {method!r}; expected one of {', '.join(METHODS)}")
