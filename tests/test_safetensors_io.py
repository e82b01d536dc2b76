"""safetensors reader/writer: single-file and sharded round trips, format compatibility with
the reference library, and the golden checkpoint's header."""

import json
import struct
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from k3serve.checkpoints.safetensors_io import open_checkpoint, write_checkpoint

GOLDEN = Path(__file__).parent / "data" / "k3-tiny-a"


def _tensors():
    rng = np.random.default_rng(0)
    return {
        "b.bf16": rng.standard_normal((7, 3)).astype(ml_dtypes.bfloat16),
        "a.f32": rng.standard_normal((4, 1, 5)).astype(np.float32),
        "c.u8": rng.integers(0, 256, (13,), dtype=np.uint8),  # odd byte count
        "d.i64": np.arange(3, dtype=np.int64),
        "e.f16": np.linspace(-1, 1, 6, dtype=np.float16),
        "f.scalar": np.array(2.5, dtype=np.float32),
        "g.bool": np.array([True, False, True]),
        "h.noncontig": np.arange(12, dtype=np.float32).reshape(3, 4).T,
    }


def _check_same(ck, tensors):
    assert ck.keys() == sorted(tensors)
    for name, arr in tensors.items():
        got = ck.get(name)
        assert got.dtype == arr.dtype, name
        assert got.shape == arr.shape == ck.shape(name), name
        assert got.tobytes() == arr.tobytes(), name  # bit-exact (C order)
    assert ck.dtype("b.bf16") == "BF16" and ck.dtype("a.f32") == "F32" and ck.dtype("c.u8") == "U8"


def _header(path):
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        return n, json.loads(fh.read(n))


def test_single_file_round_trip(tmp_path):
    tensors = _tensors()
    cfg = {"model_type": "x", "nested": {"a": [1, 2]}}
    out = write_checkpoint(tmp_path / "ck", cfg, tensors)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with open_checkpoint(out) as ck:
        _check_same(ck, tensors)
        assert ck.config == cfg
        assert ck.files == ["model.safetensors"]
        assert "a.f32" in ck and len(ck) == len(tensors)
    # the reference library reads our file, and every tensor is naturally aligned
    ref = safetensors.numpy.load_file(out / "model.safetensors")
    assert sorted(ref) == sorted(tensors)
    n, header = _header(out / "model.safetensors")
    assert n % 8 == 0 and header["__metadata__"] == {"format": "pt"}
    for name, info in header.items():
        if name != "__metadata__":
            assert info["data_offsets"][0] % tensors[name].dtype.itemsize == 0, name


def test_sharded_round_trip_from_generator(tmp_path):
    tensors = _tensors()
    out = write_checkpoint(tmp_path, {"k": 1}, ((k, v) for k, v in tensors.items()), max_shard_bytes=64)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (out / "model.safetensors").exists()
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
    for f in files:  # every shard is a valid file on its own and within the limit (or one tensor)
        part = safetensors.numpy.load_file(out / f)
        assert sum(v.nbytes for v in part.values()) <= 64 or len(part) == 1
    with open_checkpoint(out) as ck:
        _check_same(ck, tensors)
        assert ck.files == files and ck.config == {"k": 1}
    # rewriting the same folder unsharded removes the old shards
    write_checkpoint(out, None, tensors)
    assert not list(out.glob("model-*")) and not (out / "model.safetensors.index.json").exists()
    _check_same(open_checkpoint(out), tensors)


def test_missing_tensor_and_bad_input(tmp_path):
    write_checkpoint(tmp_path, {}, {"x": np.zeros(2, np.float32)})
    ck = open_checkpoint(tmp_path)
    for fn in (ck.get, ck.shape, ck.dtype):
        with pytest.raises(KeyError, match=r"nope.*" + str(tmp_path).replace("/", ".")):
            fn("nope")
    ck.close()
    assert ck.get("x").shape == (2,)  # reopens lazily after close
    with pytest.raises(ValueError, match="duplicate"):
        write_checkpoint(tmp_path / "d", None, [("x", np.zeros(1)), ("x", np.zeros(1))])
    with pytest.raises(ValueError, match="cannot be stored"):
        write_checkpoint(tmp_path / "c", None, {"z": np.zeros(2, np.complex64)})
    with pytest.raises(FileNotFoundError):
        open_checkpoint(tmp_path / "empty-does-not-exist")


def test_golden_header():
    with open_checkpoint(GOLDEN) as ck:
        keys = ck.keys()
        assert len(keys) == 1126 and keys == sorted(keys)
        assert ck.config["model_type"] == "kimi_k3"
        assert ck.config["text_config"]["linear_attn_config"]["full_attn_layers"] == [4, 8, 10]
        assert Counter(ck.dtype(k) for k in keys) == {"U8": 864, "BF16": 211, "F32": 51}  # F32: 7 KDA x 6 + 9 router biases
        e = "language_model.model.layers.1.block_sparse_moe.experts.0."
        assert ck.shape(e + "w1.weight_packed") == (32, 48) and ck.shape(e + "w2.weight_scale") == (96, 1)
        assert ck.shape("language_model.model.layers.0.self_attn.q_conv1d.weight") == (64, 1, 4)
        a_log = ck.get("language_model.model.layers.0.self_attn.A_log")
        assert a_log.dtype == np.float32 and a_log.shape == (16,) and np.all(a_log[4:] == 0)
        emb = ck.get("language_model.model.embed_tokens.weight")
        assert emb.dtype == ml_dtypes.bfloat16 and emb.shape == (512, 64)


def test_lazy_tensor_reads_only_the_rows_it_is_asked_for():
    """``Checkpoint.lazy``: slices equal the whole tensor's, and a leading-axis slice reads just
    its rows (what a multi-process load relies on to read only its own shards)."""
    from _util import DATA

    with open_checkpoint(DATA / "k3-tiny-a") as ck:
        for name in ck.keys():
            whole = ck.get(name)
            lazy = ck.lazy(name)
            assert lazy.shape == whole.shape and lazy.dtype == whole.dtype
            np.testing.assert_array_equal(np.asarray(lazy), whole)
            if whole.ndim >= 2 and whole.shape[0] >= 4 and whole.shape[1] >= 2:
                lazy = ck.lazy(name)
                before = ck.bytes_read
                np.testing.assert_array_equal(lazy[1:3], whole[1:3])
                np.testing.assert_array_equal(lazy[2:3, :], whole[2:3, :])
                assert ck.bytes_read - before == 3 * whole[0].nbytes  # rows only
                # columns: just those bytes of each row
                np.testing.assert_array_equal(lazy[:, 1:2], whole[:, 1:2])
                np.testing.assert_array_equal(lazy[1:3, :1], whole[1:3, :1])
                assert ck.bytes_read - before == 3 * whole[0].nbytes + whole[:, 1:2].nbytes + whole[1:3, :1].nbytes
                # other cuts read the whole tensor once, then serve every such cut
                np.testing.assert_array_equal(lazy[::2], whole[::2])
                np.testing.assert_array_equal(lazy[1], whole[1])
                if whole.ndim >= 3:
                    np.testing.assert_array_equal(lazy[:, :, :1], whole[:, :, :1])
                assert ck.bytes_read - before == (3 * whole[0].nbytes + whole[:, 1:2].nbytes + whole[1:3, :1].nbytes
                                                  + whole.nbytes)
