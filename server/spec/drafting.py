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
  tenants. The request's tree holds the last
  ``max_prompt_tokens`` (131,072; None: all) of the prompt: about 250 bytes and 1.6 us per
  token of non-repeating text, so a 100K-token prompt is indexed whole (~24 MB, ~0.16 s,
  measured by ``tools/suffix_cost.py``), and a million-token one costs at most ~32 MB. The
  indexing is spread over the request's first proposals, ``index_tokens_per_call`` (16,384)
  tokens each (at most 44 ms a piece against 204 ms whole for 100K random tokens, measured on
  a 2-core box), so no step waits for a whole long prompt.

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
                 min_match: int = 2, max_prompt_tokens: int | None = 131072,
                 index_tokens_per_call: int | None = 16384) -> None:
        """``index_tokens_per_call``: a long prompt is indexed in pieces of at most this many
        tokens, one piece per proposal (each on the engine thread, between steps: ~2 us a
        token), proposing nothing until the whole prompt is in; None: all of
        it on the first proposal."""
        if index_tokens_per_call is not None and index_tokens_per_call < 1:
            raise ValueError(f"index_tokens_per_call must be >= 1 or None, got {index_tokens_per_call}")
        self.k = num_speculative_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.index_tokens_per_call = index_tokens_per_call
        self.drafter = SuffixDrafter(max_depth=max_depth, max_tokens=num_speculative_tokens,
                                     max_tenant_sequences=max_tenant_sequences, min_match=min_match)
        self._fed: dict[str, int] = {}  # rid -> output tokens fed
        self._prompt_left: dict[str, list[int]] = {}  # rid -> prompt tokens not indexed yet

    def propose(self, req, max_tokens: int, after=()) -> list[int]:
        fed = self._fed.get(req.rid)
        step = self.index_tokens_per_call
        if fed is None:
            prompt = req.prompt if self.max_prompt_tokens is None else req.prompt[-self.max_prompt_tokens:]
            first = prompt if step is None else prompt[:step]
            self.drafter.start(req.rid, req.salt.hex(), first)
            if len(first) < len(prompt):
                self._prompt_left[req.rid] = prompt[len(first):]
            fed = self._fed[req.rid] = 0
        elif req.rid in self._prompt_left:  # the next piece of a long prompt
            left = self._prompt_left.pop(req.rid)
            self.drafter.extend(req.rid, left[:step], prompt=True)
            if len(left) > step:
                self._prompt_left[req.rid] = left[step:]
        if req.rid in self._prompt_left:  # the output follows the whole prompt in the tree
            return []
        if len(req.output) > fed:
            self.drafter.extend(req.rid, req.output[fed:])
        self._fed[req.rid] = len(req.output)
        return self.drafter.propose(req.rid, min(max_tokens, self.k + 1), after)

    def finish(self, req, keep: bool = True) -> None:
        """``keep``: the output joins the tenant's trie (a finished request, not an aborted one).
        A request whose prompt was not wholly indexed yet is dropped as if aborted (its output
        never entered its tree)."""
        left = self._prompt_left.pop(req.rid, None)
        if self._fed.pop(req.rid, None) is None:
            return
        if keep and left is None:
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
