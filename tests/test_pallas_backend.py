"""The model and the engine with ``kernels="pallas-interpret"``: every Pallas TPU kernel the model
calls (MXFP4 grouped matmul, ragged paged MLA, KDA decode, KDA chunked prefill), run by the
interpreter. The whole model reproduces the golden logits of ``k3-tiny-a`` (K3: bounded gate,
AttnRes, MXFP4 experts) and ``kimi-linear-tiny`` (softplus gate, dense experts); the engine
serves a multi-turn session with prefix caching on exactly as the same model with the
pure-JAX reference ops: same greedy tokens, logprobs within fp32 rounding, the same prefix
hit, every page and slot free at the end.

Interpreted kernels are slow on a CPU (seconds per model step), so the runs are short."""
from __future__ import annotations

import random

import numpy as np
import pytest

from _util import assert_all_free, run_to_end, tiny_text_checkpoint
from k3serve.server.engine.engine import Engine
from k3serve.server.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True, logprobs=3)
KW = dict(max_num_seqs=1, max_num_batched_tokens=8, chunk_size=8, page_size=8, max_model_len=96,
          warmup=False, num_pages=24)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["k3-tiny-a", "kimi-linear-tiny"])
def test_model_reproduces_the_golden_logits(case):
    """A prefill and a cached decode step (each program compiled once) give the golden greedy
    tokens and decode logits within 1e-4."""
    from _util import DATA, golden, rel_err
    from k3serve.checkpoints import load_pretrained

    g = golden(case)
    m = load_pretrained(DATA / case, kernels="pallas-interpret")
    assert m.config.kernels == "pallas-interpret"
    toks, rows = m.greedy(g["input_ids_1"], max_new_tokens=2, return_logits=True)
    assert toks == list(map(int, g["gen_tokens_1"][:2]))
    assert rel_err(np.stack(rows), g["decode_logits_1"][:1]) < 1e-4


@pytest.mark.slow
def test_multi_turn_with_prefix_caching_matches_the_reference(tmp_path):
    from k3serve.checkpoints import load_pretrained

    ckpt = tiny_text_checkpoint(tmp_path)
    ref = Engine(load_pretrained(ckpt, dtype="float32"), **KW)
    pal = Engine(load_pretrained(ckpt, dtype="float32", kernels="pallas-interpret"), **KW)
    assert pal.model.config.kernels == "pallas-interpret" and ref.model.config.kernels == "reference"
    rng = random.Random(0)
    conv = [rng.randrange(5, 4000) for _ in range(21)]
    for turn in range(2):
        outs = [run_to_end(eng, [eng.add_request(conv, GREEDY)], max_steps=100)[0] for eng in (ref, pal)]
        want, got = outs
        assert got.token_ids == want.token_ids, turn
        a = np.array([[lp] + [x for _, x in top] for lp, top in got.logprobs])
        b = np.array([[lp] + [x for _, x in top] for lp, top in want.logprobs])
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), np.abs(a - b).max()
        if turn:
            assert got.cached_tokens == want.cached_tokens > 0
        conv = conv + got.token_ids + [rng.randrange(5, 4000) for _ in range(4)]
    for eng in (ref, pal):
        assert eng.stats()["prefix_hits"] >= 1
        assert_all_free(eng)
