"""API keys: a tenant's key authenticates as that tenant; anything else is an OpenAI 401."""

from __future__ import annotations

import logging

import pytest

from seawall import cli
from seawall.auth import KeyStore, hash_key, is_key_hash, new_key
from seawall.errors import ApiError


@pytest.fixture
def keys() -> tuple[str, str, KeyStore]:
    acme, globex = new_key(), new_key()
    store = KeyStore.from_tenants({"acme": [hash_key(acme)], "globex": [hash_key(globex)]})
    return acme, globex, store


def test_key_format_is_prefixed_256_random_bits() -> None:
    a, b = new_key(), new_key()
    assert a.startswith("sk-sw-") and len(a) == len("sk-sw-") + 43
    assert a != b
    assert is_key_hash(hash_key(a))
    assert hash_key(a) != hash_key(b)


def test_bearer_key_authenticates_as_its_tenant(keys: tuple[str, str, KeyStore]) -> None:
    acme, globex, store = keys
    assert store.authenticate(f"Bearer {acme}") == "acme"
    assert store.authenticate(f"bearer  {globex} ") == "globex"


def test_alternative_headers_are_accepted_case_insensitively(
    keys: tuple[str, str, KeyStore],
) -> None:
    acme, globex, store = keys
    assert store.authenticate_headers({"Authorization": f"Bearer {acme}"}) == "acme"
    assert store.authenticate_headers({"API-Key": globex}) == "globex"
    assert store.authenticate_headers({"x-api-key": acme}) == "acme"


@pytest.mark.parametrize("header", [None, "", "   ", "Bearer", "Bearer   "])
def test_missing_key_is_401_in_openai_shape(
    keys: tuple[str, str, KeyStore], header: str | None
) -> None:
    result = keys[2].authenticate(header)
    assert isinstance(result, ApiError)
    body = result.body()["error"]
    assert result.status == 401
    assert body["type"] == "AuthenticationError"
    assert body["message"].startswith("Missing API key")
    assert result.headers["WWW-Authenticate"] == "Bearer"


def test_no_key_header_at_all_is_missing(keys: tuple[str, str, KeyStore]) -> None:
    result = keys[2].authenticate_headers({"Content-Type": "application/json"})
    assert isinstance(result, ApiError) and result.status == 401
    assert result.message.startswith("Missing API key")


@pytest.mark.parametrize(
    "header",
    ["Bearer sk-sw-not-a-real-key", "Basic dXNlcjpwYXNz", "Bearer " + "x" * 49],
)
def test_unknown_key_is_401_incorrect(keys: tuple[str, str, KeyStore], header: str) -> None:
    result = keys[2].authenticate(header)
    assert isinstance(result, ApiError)
    assert result.status == 401
    assert result.body()["error"] == {
        "message": "Incorrect API key provided.",
        "type": "AuthenticationError",
        "param": None,
        "code": "invalid_api_key",
    }
    assert result.headers["WWW-Authenticate"].startswith("Bearer")


def test_key_differing_in_one_character_is_rejected(keys: tuple[str, str, KeyStore]) -> None:
    acme, _, store = keys
    flipped = acme[:-1] + ("A" if acme[-1] != "A" else "B")
    assert isinstance(store.authenticate(f"Bearer {flipped}"), ApiError)


def test_keys_never_reach_logs_or_errors(
    keys: tuple[str, str, KeyStore], caplog: pytest.LogCaptureFixture
) -> None:
    acme, _, store = keys
    wrong = new_key()
    caplog.set_level(logging.DEBUG)
    results = [
        store.authenticate(f"Bearer {acme}"),
        store.authenticate(f"Bearer {wrong}"),
        store.authenticate(f"Token {wrong}"),
        store.authenticate_headers({"x-api-key": wrong}),
    ]
    assert any(isinstance(r, ApiError) for r in results)
    logged = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert caplog.records, "failed authentications should leave a debug trace"
    for secret in (acme, wrong, acme[6:20], wrong[6:20]):
        assert secret not in logged
        for r in results:
            if isinstance(r, ApiError):
                assert secret not in r.json_bytes().decode()


def test_store_rejects_plaintext_keys_and_shared_hashes() -> None:
    key = new_key()
    with pytest.raises(ValueError, match="not a key hash"):
        KeyStore({key: "acme"})
    with pytest.raises(ValueError, match="both"):
        KeyStore.from_tenants({"a": [hash_key(key)], "b": [hash_key(key)]})


def test_keys_new_prints_a_working_key_and_pasteable_yaml(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import yaml

    assert cli.main(["keys", "new", "--tenant", "acme: corp"]) == 0
    out = capsys.readouterr().out
    key = next(line.split()[1] for line in out.splitlines() if line.startswith("key:"))
    key_hash = next(line.split()[1] for line in out.splitlines() if line.startswith("hash:"))
    assert key_hash == hash_key(key)
    config = yaml.safe_load(out[out.index("tenants:") :])
    hashes = config["tenants"]["acme: corp"]["api_key_hashes"]
    store = KeyStore.from_tenants({"acme: corp": hashes})
    assert store.authenticate(f"Bearer {key}") == "acme: corp"
