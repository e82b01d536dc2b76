"""The KDA Pallas kernels compile for TPU v7 (``tpu7x``, one device) at K3's shapes, ahead of
time with libtpu on this CPU host (``sharding/tpu_aot.py``): the decode kernel at 96 heads
(the whole model, 64 rows) and the prefill kernel at 24 heads (one device's share at tp=4,
T 512, chunk 64), and one KDA layer's whole program on the pools (``kda_layer_on_pools``: both
kernels and the XLA conv of prefill rows, pools donated) at 96 heads. Each asserts: compiled,
every Mosaic kernel's scoped VMEM used <= its explicit limit <= 64 MiB (a v7x TensorCore's),
and no copy of the state or conv pool (the conv pool in its tile-friendly row layout
``[L, S, (W-1)*3H, d]``; the ``[L, S, W-1, 3P]`` layout gets XLA's default entry layout with the
3 window rows not second-minor, and is copied in and out around the kernel).

Compile only: nothing runs, so speed and DMA ordering are not checked here. Needs libtpu:
without it the tests fail (``require_libtpu``), they are not skipped. Three compiles (measured 7.0 s,
8.8 s, 7.7 s; 25 s for the file on a 2-core host).
"""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from k3serve.model.config import k3_full
from k3serve.sharding import tpu_aot

F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
L = 2  # KDA layers in the pools (the layer index is traced: the count does not change the kernels)
MIB = 2**20


@pytest.fixture(scope="module")
def mesh():
    tpu_aot.require_libtpu()
    return tpu_aot.tpu_mesh("tpu7x:2x2x1")


def _shapes():
    cfg = k3_full()
    return cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size


def _pools(mesh, H, d, W, S):
    state = tpu_aot.placed((L, S, H, d, d), F32, mesh)
    conv = tpu_aot.placed((L, S, (W - 1) * 3 * H, d), F32, mesh)
    return state, conv


def _check(compiled, pools):
    from k3serve.kernels.kda_decode_kernel import VMEM_LIMIT as DEC_LIMIT
    from k3serve.kernels.kda_prefill_kernel import VMEM_LIMIT as PRE_LIMIT

    kernels = tpu_aot.scoped_vmem(compiled)
    assert kernels, "no Mosaic kernel in the program"
    for k in kernels:
        assert 0 < k["used"] <= k["limit"] <= 64 * MIB, kernels
        assert k["limit"] in (DEC_LIMIT, PRE_LIMIT), kernels  # explicit, not the 32 MiB default
    names = ["f32[" + ",".join(map(str, p.shape)) + "]" for p in pools]
    pool_copies = [c for c in tpu_aot.copies(compiled) if any(n in c.split("copy", 1)[0] for n in names)]
    assert not pool_copies, pool_copies[:2]
    return kernels


def test_decode_kernel_compiles_at_k3_heads(mesh):
    from k3serve.kernels.kda_decode_kernel import kda_decode

    H, d, W = _shapes()
    R = T = 64
    P = H * d
    state, conv = _pools(mesh, H, d, W, S=129)
    p = lambda shape, dt: tpu_aot.placed(shape, dt, mesh)  # noqa: E731
    args = [p((T, 3 * P), BF16), p((T, P), BF16), p((T, H), BF16), p((T, P), BF16), state, conv, p((), I32),
            *[p((R,), I32)] * 4, p((R,), jnp.bool_), p((), I32), p((3 * P, W), BF16), p((H,), F32), p((P,), F32),
            p((d,), F32)]
    compiled, _ = tpu_aot.compile_for_tpu(lambda *a: kda_decode(*a), args, mesh, donate_argnums=(4, 5))
    _check(compiled, (state, conv))


def test_prefill_kernel_compiles_at_per_device_heads(mesh):
    from k3serve.kernels.kda_prefill_kernel import kda_prefill

    H, d, W = _shapes()
    H //= 4  # one device's heads at tp=4
    T, R = 512, 8
    state, _ = _pools(mesh, H, d, W, S=65)
    p = lambda shape, dt: tpu_aot.placed(shape, dt, mesh)  # noqa: E731
    args = [*[p((T, H, d), F32)] * 4, p((T, H), F32), state, p((), I32), p((T,), I32), p((R + 1,), I32),
            *[p((R,), I32)] * 4, p((R,), jnp.bool_), *[p((R,), I32)] * 3]
    compiled, _ = tpu_aot.compile_for_tpu(lambda *a: kda_prefill(*a, chunk_size=64), args, mesh,
                                          donate_argnums=(5,))
    _check(compiled, (state,))


def test_layer_on_pools_compiles_without_pool_copies(mesh):
    """A small mixed step (16 tokens: decode and prefill rows) at K3's 96 heads: both kernels
    and the XLA conv of the prefill rows on the donated pools."""
    from k3serve.kernels.kda_pools import kda_layer_on_pools

    H, d, W = _shapes()
    T, R = 16, 4
    P = H * d
    state, conv = _pools(mesh, H, d, W, S=129)
    p = lambda shape, dt: tpu_aot.placed(shape, dt, mesh)  # noqa: E731
    args = [p((T, 3 * P), BF16), p((T, P), BF16), p((T, H), BF16), p((T, P), BF16), p((3 * P, W), BF16),
            p((H,), F32), p((P,), F32), p((d,), F32), state, conv, p((), I32), p((T,), I32), p((R + 1,), I32),
            *[p((R,), I32)] * 4, p((R,), jnp.bool_), *[p((R,), I32)] * 3]
    fn = lambda *a: kda_layer_on_pools(*a, lower_bound=-5.0, eps=1e-5)  # noqa: E731
    compiled, _ = tpu_aot.compile_for_tpu(fn, args, mesh, donate_argnums=(8, 9))
    assert len(_check(compiled, (state, conv))) == 2  # the decode and the prefill kernel
