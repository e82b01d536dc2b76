"""Layer stacks stored as ``uint32`` row pairs (``model/packed_rows.py``): the word layout a
TPU matmul's 16-bit tile has, lossless, read by the model exactly as the plain stacks, stored
so by the engine when asked (and on a TPU by default), under a recipe too.

What the packing buys on a TPU (no whole-stack copy in the compiled step) is checked where
the programs are compiled for tpu7x: ``test_compile_cli.py``."""
from __future__ import annotations

import copy
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _util import run_children, run_to_end
from k3serve.checkpoints import load_pretrained
from k3serve.demo import demo_checkpoint
from k3serve.model.packed_rows import (pack_layer_stacks, pack_rows, packable_shape, packed_paths, unpack_rows)

HERE = os.path.dirname(__file__)


def test_word_i_of_a_column_holds_rows_2i_and_2i_plus_1():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 16, (3, 32, 200), dtype=np.uint16)  # every pattern: NaNs, infs, -0
    a = jnp.asarray(bits.view(jnp.bfloat16))
    w = np.asarray(pack_rows(a))
    assert w.shape == (3, 16, 200) and w.dtype == np.uint32
    assert (w & 0xFFFF == bits[:, 0::2]).all() and (w >> 16 == bits[:, 1::2]).all()
    back = np.asarray(unpack_rows(jnp.asarray(w), jnp.bfloat16)).view(np.uint16)
    assert (back == bits).all()


def test_which_stacks_are_packed():
    assert packable_shape((69, 384, 7168), 2)
    assert packable_shape((24, 1536, 512), 2)
    assert not packable_shape((69, 384, 7168), 4)  # f32: its default tiling is the matmuls'
    assert not packable_shape((69, 384, 7168), 1)  # the 8-bit expert stacks
    assert not packable_shape((384, 7168), 2)  # not a layer stack
    assert not packable_shape((69, 8, 7168), 2)  # fewer than 16 rows
    assert not packable_shape((69, 384, 128), 2)  # one lane tile wide
    assert not packable_shape((69, 17, 7168), 2)  # odd rows


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return demo_checkpoint(tmp_path_factory.mktemp("demo"))


def test_a_packed_model_gives_the_same_numbers(demo_dir):
    m = load_pretrained(demo_dir, dtype="bfloat16")
    paths = packed_paths(m.params)
    # the demo's q/k/v/o/g of KDA, MLA's down projections, the dense MLP, the router, the
    # latent down projection and the shared expert; never the routed experts
    assert len(paths) == 16 and not any(".experts." in p for p in paths)
    ids = [5, 7, 9, 11, 300, 17]
    want_logits, _, want_rec = m.trace(ids)  # decoding on packed stacks: the engine tests below
    packed = copy.copy(m)
    packed.params = pack_layer_stacks(m.params)
    stored = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(packed.params)}
    for p in paths:
        plain = {".".join(map(str, q)): v.get_value() for q, v in nnx.to_flat_state(m.params)}[p]
        assert stored[p].dtype == jnp.uint32 and stored[p].shape == (*plain.shape[:-2], plain.shape[-2] // 2,
                                                                    plain.shape[-1])
    got_logits, _, got_rec = packed.trace(ids)
    assert (got_logits == want_logits).all()  # bit for bit, and every layer's record
    flat_w, flat_g = jax.tree.leaves(want_rec), jax.tree.leaves(got_rec)
    assert len(flat_w) == len(flat_g) and all((np.asarray(a) == np.asarray(b)).all() for a, b in zip(flat_w, flat_g))
    again = pack_layer_stacks(packed.params)  # packed stacks are kept as they are
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(packed.params)))


def test_the_engine_packs_when_asked_and_the_callers_model_takes_the_packed_stacks(demo_dir):
    from k3serve.server.engine.engine import Engine
    from k3serve.server.engine.sampling_params import SamplingParams

    kw = dict(max_num_seqs=2, max_num_batched_tokens=64, page_size=16, max_model_len=128, warmup=False,
              async_scheduling=False)
    prompts = [[5, 7, 9, 11, 300, 17], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    sp = SamplingParams(max_new_tokens=5, temperature=0.0)

    def run(engine):
        rids = [engine.add_request(p, sp) for p in prompts]
        return [out.token_ids for out in run_to_end(engine, rids)]

    plain_model = load_pretrained(demo_dir, dtype="bfloat16")
    plain = Engine(plain_model, **kw)  # CPU: not packed unless asked
    assert not plain.packed_layer_stacks and packed_paths(plain_model.params)
    want = run(plain)
    caller = load_pretrained(demo_dir, dtype="bfloat16")
    before = packed_paths(caller.params)
    eng = Engine(caller, pack_layer_stacks=True, **kw)
    assert eng.packed_layer_stacks and packed_paths(eng.model.params) == []  # uint32 now: nothing left to pack
    assert packed_paths(caller.params) == []  # the caller's model holds the packed stacks, not the old ones
    assert run(eng) == want
    assert before == packed_paths(plain_model.params)


def test_packed_stacks_under_a_recipe_give_the_unpacked_tokens(demo_dir):
    """4 virtual devices, EP4 x DP2 x DCP2 (attention DP; the attention group splits the
    stacks' rows over 4 devices): the stacks are packed per device in their shardings, the
    engine's greedy tokens equal the same recipe's unpacked, and a model loaded into the
    recipe's shards (as ``LLM`` loads it) takes the packed arrays the engine holds."""
    got = run_children(os.path.join(HERE, "_packed_recipe_check.py"), [demo_dir],
                       [{"recipe": "ep=4,tp=1,dp=2,dcp=2"}], 4, timeout=900)
    res = got["ep=4,tp=1,dp=2,dcp=2"]
    assert res["packed"] >= 10 and res["local_rows_split"] and res["caller_adopted"], res
    assert res["tokens_equal"], res


def test_a_tpu_step_on_packed_stacks_copies_none_of_them():
    """Compiled for tpu7x (8 devices, the demo model under ``test-8-dp2``, Pallas kernels): with
    16-bit stacks the step copies each into the matmuls' tiling before its layer loop (a
    temporary per stack); packed, none of the packed stacks is copied and the temporaries
    shrink by at least their bytes. Fails, not skips, without libtpu (``tpu_aot.require_libtpu``)."""
    from k3serve.server.cli_compile import model_config
    from k3serve.server.engine.aot_build import abstract_engine
    from k3serve.sharding import tpu_aot

    tpu_aot.require_libtpu()
    cfg, _ = model_config("demo")
    devices = tpu_aot.topology_devices("tpu7x:2x2x1")
    got = {}
    for pack in (True, False):
        eng = abstract_engine(cfg, devices=devices, recipe="test-8-dp2", dtype="bfloat16", kernels="pallas",
                              max_num_seqs=4, max_num_batched_tokens=16, max_model_len=512, prefix_host_bytes=0,
                              pack_layer_stacks=pack)
        run = eng.runner
        with tpu_aot.abstract_mesh(eng.mesh):
            lowered = run._jit(1).lower(eng.model.params, eng.cache_mgr.device_cache, *run._padding_args(1))
        compiled = lowered.compile()
        if pack:  # the packed stacks as the 16-bit step sees them: bf16[L, rows, cols] per device
            local = [a.sharding.shard_shape(a.shape) for a in jax.tree.leaves(eng.model.params) if a.dtype == jnp.uint32]
            packed = {f"bf16[{l[0]},{2 * l[1]},{l[2]}]" for l in local}
            packed_bytes = sum(4 * math.prod(l) for l in local)
        copied = {c.split(" = ", 1)[1].split("{", 1)[0] for c in tpu_aot.copies(compiled) if "copy(%input" in c}
        got[pack] = (tpu_aot.memory(compiled)["temp"], copied & packed)
    (temp_packed, copied_packed), (temp_plain, copied_plain) = got[True], got[False]
    assert len(packed) >= 8 and copied_plain == packed and not copied_packed, (packed, copied_plain, copied_packed)
    assert temp_packed <= temp_plain - packed_bytes, (temp_plain, temp_packed, packed_bytes)
