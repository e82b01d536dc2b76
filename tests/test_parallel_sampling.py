"""n > 1 (parallel sampling) through LLM: n outputs per prompt, the prompt computed once (the
prefix cache: the later samples wait for the first and resume from its snapshot), each sample
its own seed stream (sample i of seed s = a single request seeded s + i), greedy samples equal,
and the same with preemption forced by a small page pool."""
from __future__ import annotations

import pytest

from _util import assert_all_free, tiny_text_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_text_checkpoint(tmp_path_factory.mktemp("ckpt"))


def _sp(**kw):
    from k3serve.server.engine.sampling_params import SamplingParams

    return SamplingParams(**kw)


def test_n_samples_compute_the_prompt_once(ckpt):
    from k3serve.server.engine.llm import LLM
    from k3serve.server.engine.request import RequestError

    llm = LLM(ckpt, max_num_seqs=4, max_num_batched_tokens=64, chunk_size=32, page_size=16, max_model_len=256,
              max_n=4)
    eng = llm.engine
    prompt = eng.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it runs far away " * 2)
    before = eng.prompt_tokens_computed
    greedy = llm.generate(prompt, _sp(n=4, max_new_tokens=12, temperature=0, ignore_eos=True))[0]
    computed = eng.prompt_tokens_computed - before
    assert len(greedy) == 4 and all(o.token_ids == greedy[0].token_ids for o in greedy)
    unit = eng.prefix_cache.unit
    # the first sample computes the prompt, each other one at most the unit before its end
    assert computed <= len(prompt) + 3 * unit, (computed, len(prompt))
    assert greedy[0].cached_tokens == 0 and all(o.cached_tokens >= len(prompt) - unit for o in greedy[1:])
    sampled = llm.generate(prompt, _sp(n=3, max_new_tokens=10, temperature=1.0, seed=40, ignore_eos=True))[0]
    for i, o in enumerate(sampled):
        alone = llm.generate(prompt, _sp(max_new_tokens=10, temperature=1.0, seed=40 + i, ignore_eos=True))[0]
        assert o.token_ids == alone.token_ids, i
    assert len({tuple(o.token_ids) for o in sampled}) > 1  # their own streams
    with pytest.raises(RequestError):
        llm.generate(prompt, _sp(n=5))
    mixed = llm.generate([prompt, prompt[:9]], [_sp(n=2, max_new_tokens=4, temperature=0), _sp(max_new_tokens=4)])
    assert isinstance(mixed[0], list) and len(mixed[0]) == 2 and not isinstance(mixed[1], list)
    assert_all_free(eng)


def test_n_samples_survive_preemption(ckpt):
    """A page pool too small for the four samples' outputs: requests are preempted and resumed,
    and the greedy samples still equal an unpressured run's."""
    from k3serve.server.engine.llm import LLM

    kw = dict(max_num_seqs=4, max_num_batched_tokens=64, chunk_size=32, page_size=16, max_model_len=256)
    prompt = list(range(100, 140))
    roomy = LLM(ckpt, **kw).generate(prompt, _sp(max_new_tokens=60, temperature=0, ignore_eos=True))[0].token_ids
    llm = LLM(ckpt, num_pages=12, **kw)
    outs = llm.generate(prompt, _sp(n=4, max_new_tokens=60, temperature=0, ignore_eos=True))[0]
    assert llm.engine.num_preemptions > 0
    assert all(o.token_ids == roomy for o in outs)
    assert_all_free(llm.engine)
