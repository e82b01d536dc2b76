"""How often a sampled DSpark draft equals the target's sample, against the rejection-sampling
rule that would need the draft's distribution (docs/speculative.md, "Acceptance of DSpark's
sampled drafts").

The draft samples each block position with the Gumbel noise plain decoding uses for that token
(``DSparkDraft.sample_block``), and verification keeps a draft while the target's own sample
(same noise) equals it. For a target distribution ``p`` and a draft distribution ``q`` this
accepts with the Gumbel-max coupling's probability; rejection sampling against ``q`` would
accept with ``1 - TV(p, q)``; independent draws would agree with ``sum p q``. Random logits
(``p``) and ``q`` = ``p``'s logits plus Gaussian noise of each scale; one position per row,
temperature 1.

    python tools/dspark_coupling.py [--rows 4000] [--vocab 64]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np


def coupling_rates(p_logits: np.ndarray, q_logits: np.ndarray, seeds: np.ndarray, steps: np.ndarray) -> dict:
    """Per-row means: ``coupled`` (the draft's Gumbel-max token equals the target sampler's),
    ``q_rule`` (``1 - TV``), ``bound`` (``(1 - TV) / (1 + TV)``, the coupling's guarantee),
    ``independent`` (``sum p q``)."""
    from k3serve.checkpoints.dspark_checkpoint import tiny_dspark_config
    from k3serve.model.dspark import DSparkDraft, SampleKeys
    from k3serve.model.dspark_config import DSparkConfig
    from k3serve.server.engine.sampler import build_sampler_inputs, sample, seed_to_u32
    from k3serve.server.engine.sampling_params import SamplingParams

    n, V = p_logits.shape
    draft = DSparkDraft(DSparkConfig.from_dict(tiny_dspark_config(vocab_size=V, draft_vocab_size=V,
                                                                  mask_token_id=V - 1)))
    draft.markov_w2.set_value(jnp.zeros_like(draft.markov_w2[...]))  # no Markov bias: the draft's q is q_logits
    params = [SamplingParams(temperature=1.0, seed=int(s)) for s in seeds]
    inp = build_sampler_inputs(params, None, [int(t) for t in steps], [[0]] * n, [[]] * n, vocab_size=V)
    y = np.asarray(jax.jit(lambda logits, i: sample(logits, i).tokens)(jnp.asarray(p_logits), inp))
    keys = SampleKeys(seed=jnp.asarray([seed_to_u32(int(s)) for s in seeds], jnp.uint32),
                      step=jnp.asarray(steps, jnp.int32), temperature=jnp.ones(n, jnp.float32))
    x = np.asarray(draft.sample_block(jnp.asarray(q_logits)[:, None], jnp.zeros(n, jnp.int32), keys)[0])[:, 0]

    def softmax(a):
        e = np.exp(a - a.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)

    p, q = softmax(p_logits.astype(np.float64)), softmax(q_logits.astype(np.float64))
    tv = 0.5 * np.abs(p - q).sum(1)
    return {"coupled": float(np.mean(x == y)), "q_rule": float(np.mean(1 - tv)),
            "bound": float(np.mean((1 - tv) / (1 + tv))), "independent": float(np.mean((p * q).sum(1)))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--vocab", type=int, default=64)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    p_logits = rng.standard_normal((a.rows, a.vocab)).astype(np.float32) * 2
    seeds, steps = np.arange(a.rows) + 7, rng.integers(0, 1000, a.rows)
    print("| noise | coupled (ours) | 1 - TV (rejection sampling with q) | coupling bound | independent |")
    print("|---|---|---|---|---|")
    for noise in (0.0, 0.25, 0.5, 1.0, 2.0):
        q_logits = p_logits + rng.standard_normal(p_logits.shape).astype(np.float32) * noise
        r = coupling_rates(p_logits, q_logits, seeds, steps)
        print(f"| {noise} | {r['coupled']:.3f} | {r['q_rule']:.3f} | {r['bound']:.3f} | {r['independent']:.3f} |")


if __name__ == "__main__":
    main()
