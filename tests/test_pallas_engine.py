"""The engine on a model loaded with ``kernels="pallas-interpret"`` (the Pallas TPU kernels the
model calls, run by the interpreter) serves a multi-turn session with prefix caching on
exactly as the same model with the pure-JAX reference ops: same greedy tokens, logprobs
within fp32 rounding, a prefix hit on every later turn, every page and slot free at the end.

Interpreted kernels are slow on a CPU (seconds per step), so the session is short."""
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
def test_multi_turn_with_prefix_caching_matches_the_reference(tmp_path):
    from k3serve.model import load_pretrained

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
