"""The deployment's shared secret: loading (file, environment, never too short) and HMAC proofs."""
import pytest

from k3serve.server.shared_secret import ENV, SecretError, load_secret, new_nonce, sign, verify


def test_load_from_file_then_environment(tmp_path):
    f = tmp_path / "secret"
    f.write_text("  0123456789abcdef0123  \n")
    assert load_secret(str(f), environ={}) == b"0123456789abcdef0123"
    assert load_secret(None, environ={ENV: "x" * 20}) == b"x" * 20
    assert load_secret(str(f), environ={ENV: "y" * 20}) == b"0123456789abcdef0123"  # the file wins
    assert load_secret(None, environ={}) is None


def test_refuses_short_or_missing(tmp_path):
    with pytest.raises(SecretError, match="at least 16"):
        load_secret(None, environ={ENV: "short"})
    with pytest.raises(SecretError, match="cannot read"):
        load_secret(str(tmp_path / "absent"), environ={})


def test_sign_verify():
    s = b"s" * 16
    n = new_nonce()
    assert len(n) == 32 and n != new_nonce()
    mac = sign(s, "hello", 1, n)
    assert verify(s, mac, "hello", 1, n)
    assert not verify(s, mac, "hello", 2, n)
    assert not verify(b"t" * 16, mac, "hello", 1, n)
    assert not verify(s, None, "hello", 1, n)
    assert not verify(s, "é" + mac[1:], "hello", 1, n)
    # fields are length-prefixed: moving a boundary changes the proof
    assert sign(s, "ab", "c") != sign(s, "a", "bc")
