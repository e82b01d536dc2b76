"""The ragged paged MLA kernel compiles for a TPU v7x device (libtpu, no TPU) at K3's MLA shapes.

Two compiles (~12 + ~16 s on 2 cores), each a program that writes the step's rows and attends
on a donated pool, on one device of ``tpu7x:2x2x1``; asserts the kernel compiled with its scoped
VMEM use within its ``vmem_limit_bytes`` <= 64 MiB (a v7x TensorCore's VMEM) and no copy of the
pool in the compiled HLO (the pool is updated in place):

* decode at one device's share of the ``v7-32-decode`` recipe: 96 heads / tp 4 = 24, 64 rows of
  one token, 16-token pages, 131072 context = 8192 pages per sequence, dealt over dcp = 32 ranks
  (256 table columns with page ordinals per rank); K3's 576-wide rows (512 + 64) in a pool whose
  layout is pinned row-major (the TPU's default layout for a 576-wide bf16 pool puts the page axis
  minor, and XLA then copies the whole pool around any Mosaic kernel);
* prefill of a 512-token chunk over 8 rows at all 96 heads, 256-token pages, 131072 context, the
  rows padded to 640 lanes (a 128-multiple: the default layout is then row-major already).

Fails (not skips) without libtpu: ``tpu_aot.require_libtpu()``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from k3serve.kernels.mla_ragged_kernel import mla_ragged_attention_kernel
from k3serve.sharding import tpu_aot

LAT, RR, CTX = 512, 64, 131072  # K3: kv_lora_rank, rope head dim, context
MiB = 2**20


def _compile(H, T, R, ps, P, NP, W, *, dcp_ords, pin_layout):
    tpu_aot.require_libtpu()
    mesh = tpu_aot.tpu_mesh("tpu7x:2x2x1")
    f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    rep = NamedSharding(mesh, PartitionSpec())
    pool_sh = rep
    if pin_layout:
        from jax.experimental.layout import Format, Layout

        pool_sh = Format(Layout(major_to_minor=(0, 1, 2, 3)), rep)
    pool_shape = (2, NP, ps, W)
    at = lambda s, d: tpu_aot.placed(s, d, mesh)  # noqa: E731
    args = [jax.ShapeDtypeStruct(pool_shape, bf16, sharding=pool_sh), at((T, W), bf16), at((T, H, LAT), f32),
            at((T, H, RR), bf16), at((R, P), i32), at((R, P), i32), at((T,), i32), at((T,), i32), at((R,), i32),
            at((R + 1,), i32), at((R,), i32)]

    def step(pool, rows, q_lat, q_rope, table, ords, tok_row, pos, kv_lens, cu, q_lens):
        return mla_ragged_attention_kernel(q_lat, q_rope, rows, pool, jnp.int32(1), table, tok_row, pos, kv_lens, cu,
                                           q_lens, 0.07, LAT, page_ordinals=ords if dcp_ords else None)

    compiled, seconds = tpu_aot.compile_for_tpu(step, args, mesh, donate_argnums=(0,),
                                                out_shardings=(rep, rep, pool_sh))
    pool_hlo = "bf16[" + ",".join(map(str, pool_shape)) + "]"
    pool_copies = [c for c in tpu_aot.copies(compiled) if pool_hlo in c]
    return compiled, seconds, pool_copies


def _check(compiled, pool_copies):
    kernels = tpu_aot.scoped_vmem(compiled)
    assert len(kernels) == 1, kernels
    used, limit = kernels[0]["used"], kernels[0]["limit"]
    assert 0 < used <= limit <= 64 * MiB, kernels
    assert pool_copies == [], pool_copies[:2]
    print(f"scoped VMEM {used / MiB:.1f} of {limit / MiB:.0f} MiB")


def test_decode_at_one_device_of_v7_32_decode():
    dcp, ps = 32, 16
    P = CTX // ps // dcp  # table columns per DCP rank
    NP = 64 * P  # this rank's pages: 64 full-context rows
    compiled, s, pool_copies = _compile(96 // 4, 64, 64, ps, P, NP, LAT + RR, dcp_ords=True, pin_layout=True)
    print(f"decode compiled in {s:.1f} s")
    _check(compiled, pool_copies)


def test_prefill_chunk_at_all_heads():
    ps = 256
    P = CTX // ps
    compiled, s, pool_copies = _compile(96, 512, 8, ps, P, 8 * P, 640, dcp_ords=False, pin_layout=False)
    print(f"prefill compiled in {s:.1f} s")
    _check(compiled, pool_copies)
