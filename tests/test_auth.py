"""API-key matching: the bare key or ``Bearer KEY``, nothing else."""
import pytest

from k3serve.server.api.auth import ApiKeyInterceptor, key_matches


@pytest.mark.parametrize("got", ["s3cret", "Bearer s3cret", "bearer s3cret"])
def test_accepts_the_key(got):
    assert key_matches(got, "s3cret")


@pytest.mark.parametrize("got", ["", "s3cre", "s3crett", "Bearer ", "Bearer s3cre", "Basic s3cret", " s3cret", "Bearers3cret"])
def test_refuses_anything_else(got):
    assert not key_matches(got, "s3cret")


def test_empty_key_is_refused():
    with pytest.raises(ValueError):
        ApiKeyInterceptor("")
