"""The destination a P/D decode sends with ``AwaitHandoff`` (``engine/cache/deal.py``) is
checked by the prefill before it computes: a malformed or hostile one must never index out of
the export or make the prefill cut more than the prompt holds. Host only."""
from __future__ import annotations

import pytest

from k3serve.server.engine.cache.deal import Destination
from k3serve.server.pd.layout import destination_of, destination_pb


def dest(**kw):
    base = dict(head_count=2, head_starts=(0, 2), page_lists=((0, 2), (1, -1)), first_page=0)
    base.update(kw)
    return Destination(**base)


def test_a_well_formed_destination_passes_and_round_trips():
    d = dest()
    d.check(num_heads=4, prompt_pages=3)
    assert d.sent_ranks == (0, 1) and d.pages_per_block == 2
    assert destination_of(destination_pb(d)) == d
    held = dest(first_page=2, page_lists=((2,), (-1,)))
    held.check(num_heads=4, prompt_pages=3)
    assert held.sent_ranks == (0,)  # a rank with no page the decode lacks gets no piece
    assert held.piece_shapes((3, 4, 8, 8), (3, 3, 96), (1, 4, 16, 24)) == [
        (3, 3, 96), (3, 2, 8, 8), (3, 2, 8, 8), (1, 1, 16, 24)]


@pytest.mark.parametrize("bad,why", [
    (dict(head_starts=(0, 3)), "do not fit"),  # heads 3..4 of 4
    (dict(head_starts=(0, 0)), "overlap"),
    (dict(head_count=0), "do not fit"),
    (dict(head_starts=()), "do not fit"),
    (dict(page_lists=()), "missing"),
    (dict(page_lists=((0, 2), (1,))), "different lengths"),
    (dict(page_lists=((0, 2), (1, 3))), "cover"),  # page 3 of a 3-page prompt
    (dict(page_lists=((0, 2), (2, -1))), "cover"),  # page 2 twice, page 1 never
    (dict(page_lists=((0, -5), (1, 2))), "cover"),
    (dict(first_page=1), "cover"),  # says page 0 is held but asks for it
    (dict(page_lists=((0, 2) + (-1,) * 62, (1,) + (-1,) * 63)), "pads"),
])
def test_a_bad_destination_is_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        dest(**bad).check(num_heads=4, prompt_pages=3)
