"""Issue #32: the processes of a multi-host deployment must serve the same weights. The digest
a follower sends at hello covers the model (``checkpoints/fingerprint.py``), not only the
engine flags: the same checkpoint at two paths gives one digest; another config, a weight
file of another size, or the same files with other values give another; a pre-shard is
named by its arrays' hashes. The leader's refusal (driven over a local socket pair, no JAX
processes) says the model differs, not just "flags". Host-only and small: tiny safetensors
files written here."""
from __future__ import annotations

import argparse
import json
import shutil
import socket

import numpy as np
import pytest

from k3serve.checkpoints.fingerprint import model_digest
from k3serve.checkpoints.safetensors_io import write_checkpoint
from k3serve.server.api.multihost import check_digest, engine_digest, leader_dispatch
from k3serve.server.cluster import wire

CONFIG = {"model_type": "kimi_k3", "hidden_size": 96, "num_hidden_layers": 5}


def checkpoint(path, *, config=CONFIG, seed=0, rows=64, shard_bytes=None):
    rng = np.random.default_rng(seed)
    tensors = {"embed_tokens.weight": rng.standard_normal((rows, 96), np.float32),
               "lm_head.weight": rng.standard_normal((rows, 96), np.float32)}
    return write_checkpoint(path, config, tensors, max_shard_bytes=shard_bytes)


def test_same_checkpoint_at_two_paths_has_one_digest(tmp_path):
    a = checkpoint(tmp_path / "a", shard_bytes=30_000)
    b = shutil.copytree(a, tmp_path / "elsewhere" / "b")
    (b / "config.json").write_text(json.dumps(CONFIG))  # same content, other formatting
    assert model_digest(a) == model_digest(b)


@pytest.mark.parametrize("change", ["config", "file_size", "values"])
def test_another_model_has_another_digest(tmp_path, change):
    a = checkpoint(tmp_path / "a")
    kw = {"config": dict(CONFIG, num_hidden_layers=6)} if change == "config" else \
        {"rows": 65} if change == "file_size" else {"seed": 1}  # values: same files, sizes and headers
    b = checkpoint(tmp_path / "b", **kw)
    if change == "values":
        sizes = [[f.stat().st_size for f in c.glob("*.safetensors")] for c in (a, b)]
        assert sizes[0] == sizes[1]
    assert model_digest(a) != model_digest(b)


def test_a_preshard_is_named_by_its_arrays(tmp_path):
    from k3serve.checkpoints.preshard_format import FORMAT, MANIFEST, TRANSFORMS_VERSION

    def preshard_dir(path, sha, recipe):
        path.mkdir()
        (path / MANIFEST).write_text(json.dumps({
            "format": FORMAT, "transforms_version": TRANSFORMS_VERSION, "config": CONFIG, "dtype": "float32",
            "recipe": recipe, "leaves": {"embed_tokens": {"shape": [64, 96], "dtype": "float32", "sha256": sha,
                                                          "part": "00000" if recipe else "00003"}}}))
        return path

    a = preshard_dir(tmp_path / "a", "0" * 64, {"spec": "ep=8,tp=1"})
    b = preshard_dir(tmp_path / "b", "0" * 64, None)  # laid out for another recipe: the same weights
    c = preshard_dir(tmp_path / "c", "1" * 64, None)
    assert model_digest(a) == model_digest(b) != model_digest(c)


def args_for(model, **flags):
    return argparse.Namespace(model=str(model), control_host=None, heartbeat_timeout=5.0, **flags)


def test_check_digest_says_what_differs(tmp_path):
    a, b = checkpoint(tmp_path / "a"), checkpoint(tmp_path / "b", seed=1)
    mine = engine_digest(args_for(a, dtype="float32"))
    check_digest(1, "digest", [engine_digest(args_for(a, dtype="float32"))], mine)
    with pytest.raises(ValueError, match=r"process 1 was started with another model \(its config or weights"):
        check_digest(1, "digest", [engine_digest(args_for(b, dtype="float32"))], mine)
    with pytest.raises(ValueError, match=r"process 2 was started with other engine flags") as e:
        check_digest(2, "digest", [engine_digest(args_for(a, dtype="bfloat16"))], mine)
    assert "another model" not in str(e.value)


def test_leader_refuses_a_follower_on_another_model(tmp_path, monkeypatch):
    """``leader_dispatch`` with the control channel's accept replaced by a socket pair: the
    follower's hello digest names another checkpoint, so the leader refuses to start and
    closes the channel; the same checkpoint at another path is accepted."""
    import k3serve.server.cluster.runtime as runtime

    a = checkpoint(tmp_path / "a")
    copy = shutil.copytree(a, tmp_path / "copy")
    other = checkpoint(tmp_path / "other", seed=1)
    for follower_model, ok in ((copy, True), (other, False)):
        lead, fol = socket.socketpair()
        monkeypatch.setattr(runtime, "accept_followers", lambda *a, **k: {1: lead})
        wire.send(fol, "digest", [engine_digest(args_for(follower_model))])
        if ok:
            d = leader_dispatch(args_for(a), cluster=None)
            assert d.followers == {1: lead}
        else:
            with pytest.raises(ValueError, match="process 1 was started with another model"):
                leader_dispatch(args_for(a), cluster=None)
            assert lead.fileno() == -1  # closed
        fol.close()
        lead.close()
