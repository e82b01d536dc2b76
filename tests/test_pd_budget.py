"""The bound on P/D handoff memory (issue #32, ``server/pd/budget.py``), host only: a handoff
that does not fit waits, in order of arrival, until others give their bytes back; one larger
than the whole bound is refused at once (RESOURCE_EXHAUSTED); a wait ends at its deadline or
when its caller leaves. The capacity plan sets the bound aside before the pages. The servers'
side (a prefill and a decode refusing a handoff over the bound) is in ``test_pd_server.py``."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from k3serve.server.pd.budget import HandoffBudget
from k3serve.server.pd.errors import HandoffError


def test_a_handoff_waits_for_memory_and_a_too_large_one_is_refused():
    b = HandoffBudget(100)
    with pytest.raises(HandoffError, match="more than the whole") as e:
        b.acquire(101, deadline=time.monotonic() + 10)
    assert e.value.code == "RESOURCE_EXHAUSTED" and b.in_use == 0
    b.acquire(60, deadline=time.monotonic() + 1)
    order = []

    def take(n, name):
        b.acquire(n, deadline=time.monotonic() + 10)
        order.append(name)

    first = threading.Thread(target=take, args=(50, "first"))
    first.start()
    while b.waiting < 1:
        time.sleep(0.01)
    second = threading.Thread(target=take, args=(10, "second"))  # would fit now, but queues behind the first
    second.start()
    time.sleep(0.3)
    assert order == [] and b.waiting == 2 and b.in_use == 60
    b.release(60)
    first.join(5)
    second.join(5)
    assert order == ["first", "second"] and b.in_use == 60 and b.peak == 60
    with pytest.raises(HandoffError, match="waited too long") as e:
        b.acquire(50, deadline=time.monotonic() + 0.2)
    assert e.value.code == "RESOURCE_EXHAUSTED"
    with pytest.raises(HandoffError) as e:
        b.acquire(50, deadline=time.monotonic() + 10, alive=lambda: False)
    assert e.value.code == "CANCELLED" and b.waiting == 0 and b.in_use == 60


def test_the_bound_is_per_process_on_a_multi_host_side():
    """Issue #36: a side of 3 processes books each handoff's share per process; one fits
    when every process's share fits beside what that process holds, and one whose share on
    any process is over the bound is refused naming that process."""
    from k3serve.server.pd.budget import Share

    b = HandoffBudget(100, processes=3)
    with pytest.raises(HandoffError, match="on process 2, more than the whole") as e:
        b.acquire(Share((10, 10, 101)), deadline=time.monotonic() + 10)
    assert e.value.code == "RESOURCE_EXHAUSTED" and b.in_use == 0
    b.acquire(Share((90, 10, 0)), deadline=time.monotonic() + 1)
    b.acquire(Share((10, 90, 100)), deadline=time.monotonic() + 1)  # 300 bytes held, 100 a process
    assert b.in_use_per_process == [100, 100, 100] and b.in_use == 100
    with pytest.raises(HandoffError, match="waited too long"):  # only process 0's share does not fit
        b.acquire(Share((1, 0, 0)), deadline=time.monotonic() + 0.2)
    b.release(Share((90, 10, 0)))
    b.acquire(Share((80, 0, 0)), deadline=time.monotonic() + 1)
    assert b.in_use_per_process == [90, 90, 100] and b.peak_per_process == [100, 100, 100]
    with pytest.raises(ValueError, match="a share of 2 processes"):
        b.acquire(Share((1, 1)), deadline=time.monotonic() + 1)
    with pytest.raises(ValueError, match="shares of 3 and 2"):
        Share((1, 2, 3)) + Share((1, 2))


def test_the_capacity_plan_sets_the_handoff_memory_aside():
    from _util import DATA
    from k3serve.model.config import K3Config
    from k3serve.server.engine.cache.planning import plan_capacity

    cfg, dtype = K3Config.from_json_file(DATA / "k3-tiny-a" / "config.json"), "float32"
    base = plan_capacity(cfg, page_size=16, dtype=dtype, kv_memory_bytes=8 << 20, max_num_seqs=4)
    held = plan_capacity(cfg, page_size=16, dtype=dtype, kv_memory_bytes=8 << 20, max_num_seqs=4, handoff_bytes=2 << 20)
    assert held.handoff_bytes == 2 << 20 and held.num_slots == base.num_slots
    assert held.num_pages == base.num_pages - (2 << 20) // base.bytes_per_page
    assert held.total_bytes + held.handoff_bytes <= 8 << 20
    with pytest.raises(ValueError, match="P/D handoffs"):
        plan_capacity(cfg, page_size=16, dtype=dtype, kv_memory_bytes=8 << 20, max_num_seqs=4, handoff_bytes=8 << 20)


def test_a_bound_too_small_for_the_longest_prompt_is_named():
    from types import SimpleNamespace

    from _util import DATA
    from k3serve.model.config import K3Config
    from k3serve.server.pd.budget import bound_warning, nbytes_of
    from k3serve.server.pd.layout import export_specs

    cfg = K3Config.from_json_file(DATA / "k3-tiny-a" / "config.json")
    eng = SimpleNamespace(model=SimpleNamespace(config=cfg, dtype="float32"),
                          capacity_plan=SimpleNamespace(page_size=16), max_model_len=128)
    full = 2 * nbytes_of(export_specs(eng, 127))
    assert bound_warning(eng, None) is None and bound_warning(eng, full) is None
    why = bound_warning(eng, full - 1)
    assert "up to about 64 tokens" in why, why  # the rows double past 4 pages (powers of two)
    assert f"--pd-handoff-memory-gb {-(-full * 100 // 2**30) / 100:g} holds the longest" in why, why
    # a multi-host prefill holds the export whole on each of its devices until it is cut: 4 per process here
    devs = [SimpleNamespace(process_index=p) for p in (0, 0, 0, 0, 1, 1, 1, 1)]
    mh = SimpleNamespace(**vars(eng), pd_role="prefill",
                         handoff_plane=SimpleNamespace(mesh=SimpleNamespace(devices=np.array(devs, dtype=object))))
    five = 5 * nbytes_of(export_specs(eng, 127))
    assert bound_warning(mh, five) is None
    assert "whole on each of 4 devices" in bound_warning(mh, five - 1)
