"""What a prefill engine hands a decode engine (P/D disaggregation, issue #16).

A request admitted with ``export=True`` runs its prompt, samples its **first token itself**
and, in the same engine step that takes that token, has its cache read out: the KDA state and
conv window of every KDA layer (its slot) and the MLA rows of its prompt's pages
(``CacheManager.export_request``). It then finishes with ``"length"`` and frees its pages and
slot at once; the :class:`Handoff` rides on its final ``RequestOutput``.

A decode engine takes it with ``Engine.admit_prefilled``: the request waits like any other
until a slot and pages for ``prompt + 1`` tokens are free, the arrays are written into them
(``CacheManager.import_request``), and it continues from the first token as if it had
prefilled the prompt itself — the last prompt token is never recomputed and the first token is
applied to the KDA state exactly once (by the decode's first step, which takes it as input).
Between engines of different layouts (recipes, devices) the arrays are cut into one piece per
distinct need of the decode's devices and put together there (``cache/deal.py``); in one
process ``import_request`` does both. The first token is the decode's first output; its stop checks (eos, stop ids, stop strings,
``max_new_tokens``) are the decode's. Sampling draws from ``(seed, output position)``, so a
seeded request samples the same tokens as on a unified engine.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Handoff:
    prompt_len: int  # tokens the arrays cover (the whole prompt)
    first_token: int
    logprob: tuple | None  # (logprob, [(id, logprob), ...]) of the first token, when asked for
    cached_tokens: int  # prompt tokens the prefill side served from its prefix cache
    # as exported (CacheManager.export_request): kda_state [nK, H, dk, dv], kda_conv [nK, W-1, C],
    # mla_rows [nM, P', page_size, W] in page order; or, with ``destination``, the decode's load
    # inputs assembled from pieces cut for it (cache/deal.py)
    arrays: tuple
    destination: object = None  # cache.deal.Destination the arrays were dealt for, or None
    id_logprobs: list | None = None  # token_ids_logprob: the first position's [(id, logprob), ...]
    # multi-host (cache/handoff_plane.py): the arrays stay in every process under this key
    # (a prefill's export; a decode's pulls), ``arrays`` is empty
    key: int | None = None
