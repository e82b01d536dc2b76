"""The MXFP4 grouped-matmul kernel compiles for TPU v7 (``tpu7x``, one device) at K3's
routed-expert shapes, ahead of time with libtpu and no TPU (``sharding/tpu_aot.py``).

Interpret mode ignores Mosaic's tiling, alignment and VMEM rules, so only a real compile shows
that the stored layout (repacked nibbles, scales padded to 128 columns) and the blocks chosen
from the VMEM budget are legal. Cases: the gate/up pair fused at decode rows (tm 8) on the
per-device shapes of ``v7-32-decode`` (112 local experts, N split over tp=4), and the down
projection at prefill rows (tm 128) over the whole width (``v7-32-prefill``: 28 local experts).
Each compile takes ~1-2 s. Fails (does not skip) without libtpu."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from k3serve.kernels.gmm_mxfp4 import choose_blocks, mxfp4_gmm, scale_groups
from k3serve.model.config import k3_full
from k3serve.sharding import tpu_aot

LAYERS = k3_full().num_hidden_layers - k3_full().first_k_dense_replace  # MoE layers: the stack's rows


def _compile(E: int, N: int, K: int, M: int, tm: int, fused: bool):
    tpu_aot.require_libtpu()
    mesh = tpu_aot.tpu_mesh("tpu7x:2x2x1")
    nw = 2 if fused else 1
    blocks = choose_blocks(K, N, tm, weights=nw)
    w = [tpu_aot.placed((LAYERS * E, N, K // 2), jnp.uint8, mesh),
         tpu_aot.placed((LAYERS * E, N, scale_groups(K)), jnp.uint8, mesh)] * nw
    args = [tpu_aot.placed((M, K), jnp.bfloat16, mesh), tpu_aot.placed((E,), jnp.int32, mesh), *w]

    def fn(x, sizes, p, s, *up):
        kw = dict(up=tuple(up), act=lambda g, u: jax.nn.silu(g) * u) if fused else {}
        return mxfp4_gmm(x, p, s, sizes, 7, num_experts=E, blocks=blocks, **kw)

    compiled, _ = tpu_aot.compile_for_tpu(fn, args, mesh)
    return compiled, w


@pytest.mark.parametrize("E,N,K,M,tm,fused", [
    (112, 3072 // 4, 3584, 256, 8, True),   # v7-32-decode: gate/up fused, 8-row tiles
    (28, 3584, 3072, 512, 128, False),      # v7-32-prefill: down, 128-row tiles
])
def test_gmm_compiles_for_tpu7x_within_its_vmem_and_copies_no_weights(E, N, K, M, tm, fused):
    compiled, weights = _compile(E, N, K, M, tm, fused)
    kernels = tpu_aot.scoped_vmem(compiled)
    assert len(kernels) == 1
    assert 0 < kernels[0]["used"] <= kernels[0]["limit"] <= 64 * 2**20, kernels
    stacks = {f"u8[{','.join(map(str, a.shape))}]" for a in weights}
    copied = [line for line in tpu_aot.copies(compiled) if any(s in line for s in stacks)]
    assert not copied, copied  # a weight stack re-laid out around the kernel would be copied whole


def test_the_compiled_kernel_reports_the_expert_tiles_it_reads():
    """XLA cannot see into the kernel: the bytes and FLOPs of a program around it come from the
    kernel's cost estimate (``kernels/cost_estimates.py``). Without it a grouped matmul over
    112 experts counted as its small operands."""
    E, N, K, M = 112, 3072 // 4, 3584, 256
    compiled, _ = _compile(E, N, K, M, 8, True)
    cost = tpu_aot.cost(compiled)
    per_expert = N * K // 2 + N * scale_groups(K)  # packed nibbles + scales, one stack
    visited = E * (1 - (1 - 1 / E) ** M)  # 256 rows over 112 experts: ~100 visited
    assert cost["bytes_accessed"] >= 2 * visited * per_expert  # gate and up stacks
    assert cost["flops"] >= 2 * M * K * N * 2
