"""``k3serve preshard`` (issue #17): safetensors -> an Orbax checkpoint laid out for a recipe,
restored straight into the shardings of the same or another recipe.

The round trips run in 8-virtual-device children (``_preshard_check.py``): pre-shard for
``ep=8,tp=1`` and restore under it, under ``ep=4,tp=2,dp=2,dcp=4`` and on one device, and the
other way round (each of the four round trips checked). Every parameter must be bit-identical to a safetensors load placed for the
same recipe, with the same sharding, and greedy tokens must be equal. The rest runs here on
one device: resume after an interruption, refusing a complete destination, a corrupted or
truncated part named by its array, a format from another version, a recipe that does not
fit, the CLI, ``LLM`` on a pre-sharded checkpoint. Issue #32: ``--overwrite`` removes only a
pre-shard (never a folder that holds the source or anything else), a resume by another run
(dtype, recipe, source) is refused, and a part stored in another dtype than the model holds
is refused at restore and by ``verify``."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from _util import free_port, run_children

HERE = os.path.dirname(os.path.abspath(__file__))
A, B = "ep=8,tp=1", "ep=4,tp=2,dp=2,dcp=4"


def small_config():
    from k3serve.checkpoints.synthetic import k3_config

    # 5 layers (MLA at 4), 8 MXFP4 experts and 8 heads: every axis of both recipes divides
    return k3_config(vocab_size=256, hidden_size=96, num_hidden_layers=5, full_attn_layers=[4], kda_num_heads=8,
                     kda_head_dim=16, mla_heads=8, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                     qk_rope_head_dim=8, v_head_dim=8, num_experts=8, num_experts_per_token=2,
                     num_shared_experts=1, moe_intermediate_size=32, routed_expert_hidden_size=32,
                     intermediate_size=64, attn_res_block_size=2)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from k3serve.checkpoints.synthetic import generate_checkpoint

    return str(generate_checkpoint(tmp_path_factory.mktemp("pre") / "src", small_config(), seed=7))


# ----------------------------------------------------------------------------- round trips
@pytest.fixture(scope="module")
def trips(src, tmp_path_factory):
    # A -> A last: the other child's B -> A has compiled (and cached) the greedy programs under A
    specs = [{"save": A, "restore": [B, "one", A], "max_memory_gb": 0.0005},  # many small parts
             {"save": B, "restore": [A]}]
    return run_children(os.path.join(HERE, "_preshard_check.py"), [src, tmp_path_factory.mktemp("trips")],
                        specs, 8, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("trip", [f"{A} -> {A}", f"{A} -> {B}", f"{A} -> one", f"{B} -> {A}"])
def test_restore_is_bit_identical_to_a_safetensors_load(trips, trip):
    r = trips[trip]
    assert r["params"] > 50 and r["differ"] == [] and r["sharding_differs"] == [], r
    assert r["tokens"] == r["tokens_src"] and len(r["tokens"]) == 6, r


def run_processes(argvs: list, timeout: float = 600) -> list:
    """Run the commands at once; returns (returncode, last JSON line of stdout or None, stderr)
    per command, killing whatever is left at the end."""
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in argvs]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    res = []
    for p, (out, err) in zip(procs, outs):
        lines = [x for x in out.strip().splitlines() if x.startswith("{")]
        res.append((p.returncode, json.loads(lines[-1]) if lines else None, err))
    return res


def restore_in(n: int, src, dst, recipe) -> list:
    """Restore ``dst`` under ``recipe`` in ``n`` processes of ``8 / n`` devices
    (``_preshard_multiprocess.py``): each process's report."""
    port = free_port()
    res = run_processes([[sys.executable, os.path.join(HERE, "_preshard_multiprocess.py"), src, str(dst), recipe,
                          str(port), str(i), str(n)] for i in range(n)])
    for rc, out, err in res:
        assert rc == 0 and out is not None, err[-3000:]
    return [out for _, out, _ in res]


@pytest.fixture(scope="module")
def one_process_a(src, tmp_path_factory):
    """A pre-shard for ``ep=8,tp=1`` written by one process (the CLI, 8 virtual devices)."""
    dst = tmp_path_factory.mktemp("one_a") / "a"
    r = subprocess.run([sys.executable, "-m", "k3serve.server.cli", "preshard", src, str(dst), "--recipe", A,
                        "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return dst


@pytest.mark.slow
def test_two_processes_restore_and_each_reads_about_its_share(src, one_process_a):
    """Pre-shard for ``ep=8,tp=1`` (the CLI, 8 virtual devices), then restore it under the same
    recipe in two processes of four devices each: every shard equals a safetensors load's,
    and each process's read syscalls return well under the checkpoint (its half, plus
    metadata and the arrays both halves hold)."""
    res = restore_in(2, src, one_process_a, A)
    print(json.dumps(res))
    for x in res:
        assert x["differ"] == 0 and x["arrays"] > 50, x
        assert x["held_bytes"] < 0.6 * x["global_bytes"], x  # ep=8 over two processes: about half each
        assert x["read_bytes"] < 0.85 * x["global_bytes"], x  # measured 0.74 (metadata included)


@pytest.mark.slow
def test_two_processes_write_a_preshard_that_restores_under_any_process_count(src, one_process_a, tmp_path):
    """Issue #36: two processes of four devices write a pre-shard for ``ep=8,tp=1``, each
    reading from the source only its devices' slices; the run is interrupted after its second
    part and resumed by two processes (the CLI). The result restores under one process of
    eight devices and under four of two, every shard bit-identical to a safetensors load for
    that recipe (a restore under another recipe is the round trips' above); it
    holds the same arrays as one process's pre-shard (equal ``sum64`` per array, equal
    fingerprints); ``verify`` on one device passes with the source (every slice a process
    read, and the logits) and names an array whose stored bytes were changed."""
    from k3serve.checkpoints.fingerprint import model_digest
    from k3serve.checkpoints.preshard_format import MANIFEST, PARTS, PreshardError, read_manifest
    from k3serve.checkpoints.preshard_verify import verify

    dst = tmp_path / "two"
    port = free_port()
    first = run_processes([[sys.executable, os.path.join(HERE, "_preshard_write.py"), src, str(dst), A, str(port),
                            str(i), "2", "0.0005", "00001"] for i in range(2)], timeout=300)
    assert [(rc, out) for rc, out, _ in first] == [(3, {"process": i, "stopped_after": "00001"}) for i in range(2)], \
        [err[-2000:] for _, _, err in first]
    assert not (dst / MANIFEST).exists() and sorted(os.listdir(dst / PARTS)) == ["00000", "00001"]
    port = free_port()
    resumed = run_processes([[sys.executable, "-m", "k3serve.server.cli", "preshard", src, str(dst), "--recipe", A,
                              "--max-memory-gb", "0.0005", "--json", "--coordinator", f"127.0.0.1:{port}",
                              "--num-processes", "2", "--process-id", str(i)] for i in range(2)], timeout=300)
    for rc, out, err in resumed:
        assert rc == 0 and out is not None, err[-3000:]
    print(json.dumps([out for _, out, _ in resumed]))
    man = read_manifest(dst)
    assert man["processes"] == 2 and 0 < man["resumed_leaves"] < len(man["leaves"])
    assert {out["resumed_arrays"] for _, out, _ in resumed} == {man["resumed_leaves"]}
    # the resumed run read again only its devices' slices: each process well under the source
    for _, out, _ in resumed:
        assert out["source_bytes_read"] < 0.7 * man["source"]["bytes"], out  # measured 0.51 (ep=8 over 2)
    one = read_manifest(one_process_a)
    assert {k: v["sum64"] for k, v in man["leaves"].items()} == {k: v["sum64"] for k, v in one["leaves"].items()}
    assert all("sha256" not in v for v in man["leaves"].values())  # no process held a whole expert stack
    assert any("[" in k for k in man["source"]["tensors"])  # slices, each hashed by the process that read it
    assert model_digest(dst) == model_digest(one_process_a)

    for n in (1, 4):
        for x in restore_in(n, src, dst, A):
            assert x["differ"] == 0 and x["arrays"] > 50, (n, x)

    out = verify(dst, src)
    assert out["logits_gap"] == 0.0 and out["source_tensors"] > 100, out
    bad = copy_of(dst, tmp_path)
    f = largest_data_file(bad)
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF
    f.write_bytes(bytes(b))
    with pytest.raises(PreshardError, match=r"array '[^']+' \(part \d+\) does not match its recorded hash"):
        verify(bad)


# ----------------------------------------------------------------------------- one device
def params(model) -> dict:
    from flax import nnx

    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(model.params)}


def same_params(a, b) -> bool:
    pa, pb = params(a), params(b)
    return set(pa) == set(pb) and all(pa[k].dtype == pb[k].dtype and np.array_equal(pa[k], pb[k]) for k in pa)


def test_resume_after_an_interruption_writes_only_the_rest(src, tmp_path):
    from k3serve.checkpoints.preshard import preshard
    from k3serve.checkpoints.preshard_format import MANIFEST, PARTS, PreshardError, read_manifest
    from k3serve.checkpoints import load_pretrained

    dst = tmp_path / "dst"

    class Stop(Exception):
        pass

    def stop_after_two(name):
        if name == "00001":
            raise Stop

    with pytest.raises(Stop):
        preshard(src, dst, max_memory_gb=0.0005, on_part=stop_after_two)
    assert not (dst / MANIFEST).exists() and sorted(os.listdir(dst / PARTS)) == ["00000", "00001"]
    with pytest.raises(PreshardError, match="unfinished"):  # not loadable until complete
        read_manifest(dst)
    (dst / PARTS / "00002.orbax-checkpoint-tmp-1").mkdir()  # a part the interruption left half-written
    man = preshard(src, dst, max_memory_gb=0.0005)
    assert 0 < man["resumed_leaves"] < len(man["leaves"])
    assert not (dst / PARTS / "00002.orbax-checkpoint-tmp-1").exists()
    fresh = preshard(src, tmp_path / "fresh", max_memory_gb=0.0005)
    assert {k: v["sha256"] for k, v in man["leaves"].items()} == {k: v["sha256"] for k, v in fresh["leaves"].items()}
    assert same_params(load_pretrained(dst), load_pretrained(src))


def test_a_complete_destination_is_refused_unless_overwrite(src, tmp_path):
    from k3serve.checkpoints.preshard import preshard
    from k3serve.checkpoints.preshard_format import PreshardError

    dst = tmp_path / "dst"
    preshard(src, dst)
    with pytest.raises(PreshardError, match="already there.*--overwrite"):
        preshard(src, dst)
    man = preshard(src, dst, overwrite=True)
    assert man["resumed_leaves"] == 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(PreshardError, match="not a pre-sharded checkpoint"):
        preshard(src, other)
    assert (other / "notes.txt").read_text() == "mine"


def test_overwrite_refuses_a_folder_that_is_not_a_preshard(src, tmp_path):
    from k3serve.checkpoints.preshard import preshard
    from k3serve.checkpoints.preshard_format import PreshardError

    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    (other / "notes.txt").write_text("mine")
    with pytest.raises(PreshardError, match="not a pre-sharded checkpoint.*nothing in it was touched"):
        preshard(src, other, overwrite=True)
    assert sorted(os.listdir(other)) == ["notes.txt", "sub"] and (other / "notes.txt").read_text() == "mine"


def test_a_destination_holding_the_source_is_refused(src, tmp_path):
    from k3serve.checkpoints.preshard import preshard
    from k3serve.checkpoints.preshard_format import PARTS, PreshardError

    root = tmp_path / "root"
    shutil.copytree(src, root / "ckpt")
    (root / PARTS).mkdir()  # looks like an unfinished pre-shard: --overwrite would otherwise remove it all
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    for dst in (root, root / "ckpt"):
        with pytest.raises(PreshardError, match="holds the source"):
            preshard(root / "ckpt", dst, overwrite=True)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before


class Stop(Exception):
    pass


def stop_at(part):
    def on_part(name):
        if name == part:
            raise Stop
    return on_part


def test_resume_with_another_dtype_or_source_is_refused(src, tmp_path):
    """An interrupted float32 run resumed in bfloat16, or from a checkpoint with the same
    files and sizes but other values: refused, naming what differs; the parts stay as they
    were. (Another recipe: ``test_cli_preshard_verify_and_refusal``.)"""
    from k3serve.checkpoints.preshard import preshard
    from k3serve.checkpoints.preshard_format import PARTS, PreshardError
    from k3serve.checkpoints.synthetic import generate_checkpoint

    dst = tmp_path / "dst"
    with pytest.raises(Stop):
        preshard(src, dst, max_memory_gb=0.0005, on_part=stop_at("00000"))
    parts = sorted(os.listdir(dst / PARTS))
    with pytest.raises(PreshardError, match=r"another run \(dtype 'float32' \(earlier run\) vs 'bfloat16' "
                                            r"\(this run\)\)"):
        preshard(src, dst, dtype="bfloat16", max_memory_gb=0.0005)
    assert sorted(os.listdir(dst / PARTS)) == parts
    other = generate_checkpoint(tmp_path / "other", small_config(), seed=8)  # same shapes, other values
    with pytest.raises(PreshardError, match=r"tensor '[^']+' differs from the one the earlier run pre-sharded"):
        preshard(other, dst, max_memory_gb=0.0005)
    assert sorted(os.listdir(dst / PARTS)) == parts


@pytest.fixture(scope="module")
def one(src, tmp_path_factory):
    from k3serve.checkpoints.preshard import preshard

    dst = tmp_path_factory.mktemp("one") / "dst"
    preshard(src, dst, max_memory_gb=0.002)
    return dst


def copy_of(path, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(path, out)
    return out


def largest_data_file(path):
    """The largest OCDBT data file of the checkpoint: array bytes (compression is off)."""
    return max((p for p in path.rglob("*") if p.is_file() and p.parent.name == "d"), key=lambda p: p.stat().st_size)


def test_verify_passes_and_matches_the_source(one, src):
    from k3serve.checkpoints.preshard_verify import verify

    out = verify(one, src)
    assert out["arrays"] > 50 and out["logits_gap"] == 0.0 and out["source_tensors"] > 100


def test_a_corrupted_part_is_named_by_its_array(one, tmp_path):
    from k3serve.checkpoints.preshard_format import PreshardError
    from k3serve.checkpoints.preshard_verify import verify

    bad = copy_of(one, tmp_path)
    f = largest_data_file(bad)
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF  # one flipped byte inside stored data
    f.write_bytes(bytes(b))
    with pytest.raises(PreshardError, match=r"array '[^']+' \(part \d+\)"):
        verify(bad)


def test_a_truncated_part_is_named_by_its_array(one, tmp_path):
    from k3serve.checkpoints.preshard_format import PreshardError
    from k3serve.checkpoints import load_pretrained

    bad = copy_of(one, tmp_path)
    f = largest_data_file(bad)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    with pytest.raises(PreshardError, match=r"array '[^']+' \(part \d+\)"):
        load_pretrained(bad)


def rewrite_part(path, part, cast=None, run=None):
    """Save ``part`` of the pre-shard at ``path`` again, its floating arrays cast to ``cast``
    and/or its recorded run identity replaced (by hand, as a mixed resume would have)."""
    import jax
    import orbax.checkpoint as ocp

    from k3serve.checkpoints.preshard_format import PARTS

    where = path / PARTS / part
    meta = ocp.v1.pytree_metadata(where).custom_metadata
    tree = jax.tree.map(np.asarray, ocp.v1.load_pytree(where))
    if cast is not None:
        tree = jax.tree.map(lambda a: a.astype(cast) if np.issubdtype(a.dtype, np.floating) else a, tree)
    if run is not None:
        meta = dict(meta, run=run)
    shutil.rmtree(where)
    ocp.v1.save_pytree(where, tree, custom_metadata=meta)


def test_a_part_stored_in_another_dtype_is_refused(one, tmp_path):
    """A float32 pre-shard whose first part holds bfloat16 arrays: ``verify`` names the array
    and both dtypes (Orbax alone would cast them to float32 without a word); once the manifest
    records the part's bfloat16, the restore refuses it too (restore checks the manifest,
    verify what the parts store)."""
    import ml_dtypes

    from k3serve.checkpoints.preshard_format import MANIFEST, PreshardError
    from k3serve.checkpoints.preshard_verify import verify
    from k3serve.checkpoints import load_pretrained

    bad = copy_of(one, tmp_path)
    rewrite_part(bad, "00000", cast=ml_dtypes.bfloat16)
    msg = r"array '[^']+' (\(part 00000\) )?is stored as bfloat16, the model expects float32"
    with pytest.raises(PreshardError, match=msg):
        verify(bad)
    man = json.loads((bad / MANIFEST).read_text())
    for v in man["leaves"].values():
        if v["part"] == "00000" and v["dtype"] == "float32":
            v["dtype"] = "bfloat16"
    (bad / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(PreshardError, match=msg):
        load_pretrained(bad)


def test_verify_reports_a_mixed_preshard(one, tmp_path):
    from k3serve.checkpoints.preshard_format import MANIFEST, PreshardError
    from k3serve.checkpoints.preshard_verify import verify

    bad = copy_of(one, tmp_path)
    run = json.loads((bad / MANIFEST).read_text())["run"]
    rewrite_part(bad, "00001", run=dict(run, dtype="bfloat16"))
    with pytest.raises(PreshardError, match=r"mixed pre-shard: part 00001 .*dtype 'bfloat16' \(part 00001\) vs "
                                            r"'float32' \(the manifest\)"):
        verify(bad)


def test_another_format_version_is_refused(one, tmp_path):
    from k3serve.checkpoints.preshard_format import MANIFEST, PreshardError
    from k3serve.checkpoints import load_pretrained

    bad = copy_of(one, tmp_path)
    man = json.loads((bad / MANIFEST).read_text())
    man["format"] = "k3serve-preshard/0"
    (bad / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(PreshardError, match="format 'k3serve-preshard/0'.*pre-shard the checkpoint again"):
        load_pretrained(bad)


def test_a_recipe_that_does_not_fit_gets_the_validate_message(src, tmp_path):
    from k3serve.checkpoints.preshard import preshard
    from k3serve.sharding.recipe import RecipeError

    with pytest.raises(RecipeError, match=r"routed experts \(8\) are not divisible by ep = 3"):
        preshard(src, tmp_path / "dst", recipe="ep=3,tp=1")
    assert not (tmp_path / "dst").exists() or not os.listdir(tmp_path / "dst")


def test_bfloat16_preshard_equals_a_bfloat16_load(src, tmp_path):
    from k3serve.checkpoints.preshard import preshard
    from k3serve.checkpoints import load_pretrained

    preshard(src, tmp_path / "bf", dtype="bfloat16")
    assert same_params(load_pretrained(tmp_path / "bf", dtype="bfloat16"), load_pretrained(src, dtype="bfloat16"))


def test_llm_generates_the_same_tokens_from_a_preshard(one, src):
    from k3serve import LLM, SamplingParams

    kw = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, num_pages=16, page_size=4, warmup=False)
    sp = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    a = LLM(one, **kw).generate([[3, 1, 4, 1, 5]], sp)[0].token_ids
    b = LLM(src, **kw).generate([[3, 1, 4, 1, 5]], sp)[0].token_ids
    assert list(a) == list(b) and len(a) == 5


def test_cli_preshard_verify_and_refusal(src, tmp_path):
    dst = tmp_path / "cli"
    run = lambda *a: subprocess.run([sys.executable, "-m", "k3serve.server.cli", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    r = run("preshard", src, str(dst), "--recipe", "ep=2,tp=1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["recipe"] == "ep=2,tp=1" and out["arrays"] > 50
    assert (dst / "config.json").is_file()  # side files travel with the weights (tokenizer, config)
    r = run("preshard", src, str(dst))
    assert r.returncode == 1 and "--overwrite" in r.stderr
    r = run("preshard", "verify", str(dst), "--json")
    assert r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1])["arrays"] == out["arrays"], r.stderr
    from k3serve.checkpoints.preshard import preshard  # resuming it on one device: another recipe
    from k3serve.checkpoints.preshard_format import MANIFEST, PARTS, PreshardError

    (dst / MANIFEST).unlink()  # as if interrupted before the manifest
    parts = sorted(os.listdir(dst / PARTS))
    with pytest.raises(PreshardError, match=r"another run \(layout 'ep=2,tp=1' \(earlier run\) vs None"):
        preshard(src, dst)
    assert sorted(os.listdir(dst / PARTS)) == parts
    # several processes: refused from the flags before any process joins or reads
    r = run("preshard", src, str(tmp_path / "p"), "--coordinator", "127.0.0.1:1", "--num-processes", "2",
            "--process-id", "0")
    assert r.returncode == 2 and "needs --recipe" in r.stderr, r.stderr
    r = run("preshard", src, str(tmp_path / "p"), "--recipe", "ep=3,tp=1", "--coordinator", "127.0.0.1:1",
            "--num-processes", "2", "--process-id", "0")
    assert r.returncode == 2 and "not a multiple of --num-processes 2" in r.stderr, r.stderr
    assert not (tmp_path / "p").exists()
