"""The planner's count of the layer stacks XLA:TPU re-tiles inside every step program
(``sharding.memory.retiled_per_device``) against what the compiler did.

Why: the compiled K3 step under ``v7-32-decode-dp2`` (``k3serve compile --topology tpu7x:2x2x4
--model k3 --kernels pallas --max-model-len 131072 --max-num-seqs 64``, libtpu 0.0.42.1,
``--xla_dump_to``) converts these 16-bit stacks from the default ``(8, 128)`` tiling to the
matmuls' ``(16, 128)`` before its layer loop, each into a temporary of its own size; the
planner's per-device figure counts them (docs/compile.md). The list below is the compiler's:
the shapes of the ``copy`` ops on parameters in that program's optimized HLO. Since the engine
stores exactly these stacks packed on a TPU (``model.packed_rows``, whose rule this is), the
count is what ``k3serve compile --no-pack-layer-stacks`` adds to the planner's figure;
``test_packed_rows.py`` checks that packed stacks are not copied.
"""
from __future__ import annotations

from collections import Counter

from k3serve.model.config import k3_full
from k3serve.sharding.memory import local_shape, param_inventory, retiled_per_device
from k3serve.sharding.recipe import Recipe

# per-device shapes of the parameter copies in the compiled dp2 step (one entry per copy)
COMPILER_COPIES_DP2 = Counter({
    (69, 768, 7168): 4, (69, 7168, 768): 1, (69, 128, 7168): 1,  # KDA q/k/v/g, o, f_a
    (24, 768, 7168): 1, (24, 7168, 768): 1, (24, 576, 7168): 1, (24, 1536, 7168): 1,  # MLA g, o, kv_a, q_a
    (24, 1536, 512): 1, (24, 1152, 1536): 1,  # MLA kv_b, q_b
    (1, 2112, 7168): 2, (1, 7168, 2112): 1,  # the dense layer's MLP
    (92, 896, 7168): 1, (92, 224, 7168): 1, (92, 7168, 224): 1,  # router, latent down / up
    (92, 384, 7168): 2, (92, 7168, 384): 1,  # shared expert
})


def _counted(recipe: Recipe) -> Counter:
    inv = param_inventory(k3_full())
    out = Counter()
    for path, shape, itemsize in inv:
        local = local_shape(path, shape, recipe)
        if itemsize == 2 and len(shape) >= 3 and local[-2] >= 16 and local[-1] > 128:
            out[local] += 1
    return out


def test_the_planner_counts_the_stacks_the_compiler_retiles():
    recipe = Recipe.parse("v7-32-decode-dp2")
    assert _counted(recipe) == COMPILER_COPIES_DP2
    want = sum(n * 2 * a * b * c for (a, b, c), n in COMPILER_COPIES_DP2.items())
    assert retiled_per_device(param_inventory(k3_full()), recipe) == want
    assert abs(want / 2**30 - 8.09) < 0.01


def test_local_shape_follows_the_placement():
    recipe = Recipe.parse("v7-32-decode")  # EP8 x TP4: an attention group of 32 devices
    assert local_shape("attn.0.self_attn.q_proj.weight", (69, 12288, 7168), recipe) == (69, 384, 7168)
    assert local_shape("attn.0.self_attn.o_proj.weight", (69, 7168, 12288), recipe) == (69, 7168, 384)
    assert local_shape("attn.1.self_attn.kv_a_proj_with_mqa.weight", (24, 576, 7168), recipe) == (24, 576, 7168)
    # the 8-bit expert stacks are not re-tiled (their default tiling is what the kernel reads)
    inv = [("ffn.1.block_sparse_moe.experts.w1_packed", (92, 896, 3072, 1792), 1)]
    assert retiled_per_device(inv, recipe) == 0


def test_the_planner_counts_a_long_steps_activations():
    """``memory.step_activations_per_device``: v7-32-prefill's 8,192-token step (no SP, EP32):
    the residual stream and AttnRes bank (10 fp32 rows of 7,168 a token) and one MoE layer's
    worst-case exchange (16 pairs a token: 3,584 bf16 in, 3,072 bf16 h, 3,584 fp32 out). The
    compiler's largest temporaries there are 9.88 GiB (docs/compile.md); at 64 decode rows the
    term is tens of MiB."""
    from k3serve.sharding.memory import step_activations_per_device

    cfg = k3_full()
    want = 8192 * (10 * 7168 * 4 + 16 * (3584 * 2 + 3072 * 2 + 3584 * 4))
    assert step_activations_per_device(cfg, Recipe.parse("v7-32-prefill"), 8192) == want
    assert abs(want / 2**30 - 5.56) < 0.01
    assert step_activations_per_device(cfg, Recipe.parse("v7-32-decode"), 64) < 40 * 2**20
