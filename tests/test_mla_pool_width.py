"""MLA pool rows wider than one 128-lane vreg are stored padded to whole vregs
(``K3Config.mla_pool_width``; K3: 576 -> 640, so XLA:TPU keeps the pool row-major and does not
copy it around the kernels every step). The padding is zeros that nothing reads: a model whose
latent row is 120 + 16 = 136 wide (pool 256) gives the same prefill logits and greedy tokens
as the same model with an unpadded pool, on the reference path and through the Pallas MLA
kernel in interpret mode."""
from __future__ import annotations

import numpy as np
import pytest

from k3serve.model.config import K3Config


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    from k3serve.checkpoints.synthetic import generate_checkpoint, k3_config

    cfg = k3_config(vocab_size=256, hidden_size=64, num_hidden_layers=2, full_attn_layers=[2], kda_num_heads=2,
                    kda_head_dim=16, mla_heads=2, q_lora_rank=16, kv_lora_rank=120, qk_nope_head_dim=8,
                    qk_rope_head_dim=16, v_head_dim=8, num_experts=4, num_experts_per_token=2,
                    num_shared_experts=1, moe_intermediate_size=32, routed_expert_hidden_size=32,
                    intermediate_size=64, attn_res_block_size=2)
    return generate_checkpoint(tmp_path_factory.mktemp("wide") / "w", cfg, seed=7)


def _run(path, kernels):
    from k3serve.checkpoints import load_pretrained

    m = load_pretrained(path, kernels=kernels)
    ids = np.random.default_rng(0).integers(0, 256, 21).tolist()
    return m, m.logits(ids), m.greedy(ids, 6)


@pytest.mark.parametrize("kernels", ["reference", "pallas-interpret"])
def test_padded_pool_rows_change_nothing(wide_ckpt, kernels, monkeypatch):
    m, logits, tokens = _run(wide_ckpt, kernels)
    cfg = m.config
    assert (cfg.mla_cache_width, cfg.mla_pool_width) == (136, 256)
    cache = m.new_cache(1, 2)
    assert cache.mla_kv.shape[-1] == 256
    monkeypatch.setattr(K3Config, "mla_pool_width", property(lambda self: self.mla_cache_width))
    m2, logits2, tokens2 = _run(wide_ckpt, kernels)
    assert m2.new_cache(1, 2).mla_kv.shape[-1] == 136
    np.testing.assert_allclose(logits, logits2, rtol=1e-5, atol=1e-5)
    assert tokens == tokens2
