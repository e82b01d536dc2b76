"""The offline API as a user writes it: ``from k3serve import LLM, SamplingParams``."""
from __future__ import annotations

import numpy as np
import pytest

from _util import DATA, golden


def test_generate_and_stream_on_kimi_linear():
    from k3serve import LLM, SamplingParams

    g = golden("kimi-linear-tiny")
    prompts = [list(map(int, g[f"input_ids_{i}"])) for i in range(3)]
    expect = [list(map(int, g[f"gen_tokens_{i}"])) for i in range(3)]
    llm = LLM(DATA / "kimi-linear-tiny", dtype="float32", max_num_seqs=2, chunk_size=16, page_size=16,
              max_model_len=64)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == expect
    assert [(o.prompt_tokens, o.completion_tokens, o.finish_reason) for o in outs] == [
        (len(p), 12, "length") for p in prompts]

    deltas = list(llm.stream(prompts[1], greedy))
    assert [t for d in deltas for t in d.new_token_ids] == expect[1]
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    st = llm.engine.stats()
    assert st["free_pages"] + st["prefix_pages_held"] == llm.engine.capacity_plan.num_pages

    # one prompt as a numpy array is one request, not one request per id
    (one,) = llm.generate(np.array(prompts[0]), greedy)
    assert one.token_ids == expect[0]
    # two streams stepped in turn: neither loses the other's outputs
    a, b = llm.stream(prompts[0], greedy), llm.stream(prompts[2], greedy)
    got = {0: [], 2: []}
    live = {0: a, 2: b}
    for _ in range(100):
        for i, s in list(live.items()):
            d = next(s)
            got[i] += d.new_token_ids
            if d.finished:
                del live[i]
        if not live:
            break
    assert got == {0: expect[0], 2: expect[2]}

    # a failing step: a clear error, and the engine refuses to go on
    from k3serve.server.engine.request import EngineError

    def boom(*a, **k):
        raise RuntimeError("injected")

    llm.engine.runner.launch = boom
    with pytest.raises(EngineError, match="injected"):
        llm.generate(prompts[:1], greedy)
    with pytest.raises(EngineError, match="broken"):
        llm.generate(prompts[:1], greedy)
