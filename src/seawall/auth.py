"""Tenants' API keys: minting, hashing, and turning a request's headers into a tenant.

Owns the key format (`sk-sw-` + 43 url-safe characters = 256 random bits), the stored
form (`sha256:<64 hex>`), and the 401 errors a client sees. It must not log, store or
echo a key: only hashes ever leave this module, and error messages never quote what the
client sent.

Why a fast hash and not bcrypt/scrypt/argon2: slow hashes exist to make guessing
*low-entropy* secrets (passwords) expensive after a leak of the hashes. Our keys are
256 uniformly random bits, so even a leaked hash cannot be brute-forced at any hash
speed, and a slow hash would only cost CPU on every request. SHA-256 of the key is
one-way, lets us look the key up in a dict, and costs about a microsecond.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import Iterable, Mapping

from seawall.errors import ApiError

log = logging.getLogger(__name__)

KEY_PREFIX = "sk-sw-"
HASH_PREFIX = "sha256:"
_HASH_RE = re.compile(r"^sha256:[0-9a-f]{64}$")

# Headers that may carry the key, in the order they are tried. `Authorization: Bearer`
# is what the OpenAI SDK sends; `api-key` is Azure OpenAI's; `x-api-key` is common in
# other gateways. Lower-case, because header names are case-insensitive.
_KEY_HEADERS = ("authorization", "api-key", "x-api-key")

INCORRECT_KEY_MESSAGE = "Incorrect API key provided."
MISSING_KEY_MESSAGE = (
    "Missing API key. Provide it in an Authorization header using Bearer auth "
    "(Authorization: Bearer YOUR_KEY)."
)


def new_key() -> str:
    """A fresh API key: 32 bytes from the OS CSPRNG, url-safe base64 (43 characters)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """The only form in which Seawall stores a key."""
    return HASH_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()


def is_key_hash(value: str) -> bool:
    """True if `value` is a stored key hash (for config validation)."""
    return _HASH_RE.match(value) is not None


def invalid_key_error() -> ApiError:
    return ApiError(
        401,
        INCORRECT_KEY_MESSAGE,
        code="invalid_api_key",
        type="AuthenticationError",
        headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
    )


def missing_key_error() -> ApiError:
    return ApiError(
        401,
        MISSING_KEY_MESSAGE,
        code="missing_api_key",
        type="AuthenticationError",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _bearer_token(authorization_header: str) -> str | None:
    """The credential in `Bearer <key>` (scheme case-insensitive, RFC 6750), "" for a bare
    `Bearer`, None for another scheme."""
    scheme, _, credential = authorization_header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credential.strip()


class KeyStore:
    """Maps key hashes to tenant names and authenticates requests against them."""

    def __init__(self, tenant_by_hash: Mapping[str, str]) -> None:
        for key_hash in tenant_by_hash:
            if not is_key_hash(key_hash):
                raise ValueError(
                    f"not a key hash: {key_hash!r} (expected sha256:<64 hex>; "
                    "create keys with `seawall keys new --tenant NAME`)"
                )
        # hash bytes -> (the stored hash bytes, tenant)
        self._by_hash: dict[bytes, tuple[bytes, str]] = {
            h.encode(): (h.encode(), tenant) for h, tenant in tenant_by_hash.items()
        }

    @classmethod
    def from_tenants(cls, hashes_by_tenant: Mapping[str, Iterable[str]]) -> KeyStore:
        """Build from the config's shape (tenant -> its key hashes); a hash may belong to
        only one tenant, since a key must identify its tenant unambiguously."""
        tenant_by_hash: dict[str, str] = {}
        for tenant, hashes in hashes_by_tenant.items():
            for key_hash in hashes:
                other = tenant_by_hash.setdefault(key_hash, tenant)
                if other != tenant:
                    raise ValueError(
                        f"key hash {key_hash} is listed under both {other!r} and {tenant!r}"
                    )
        return cls(tenant_by_hash)

    def __len__(self) -> int:
        return len(self._by_hash)

    def authenticate(self, authorization_header: str | None) -> str | ApiError:
        """The tenant owning the `Authorization: Bearer <key>` header's key, or a 401."""
        if authorization_header is None or not authorization_header.strip():
            return missing_key_error()
        key = _bearer_token(authorization_header)
        if key is None:
            log.debug("authentication failed: Authorization header is not Bearer")
            return invalid_key_error()
        if not key:
            return missing_key_error()
        return self.authenticate_key(key)

    def authenticate_headers(self, headers: Mapping[str, str]) -> str | ApiError:
        """Like `authenticate`, but also accepts the key in `api-key` or `x-api-key`.

        Works with any mapping (aiohttp's case-insensitive headers or a plain dict):
        header names are compared case-insensitively.
        """
        found: dict[str, str] = {}
        for name, value in headers.items():
            lower = name.lower()
            if lower in _KEY_HEADERS and lower not in found:
                found[lower] = value
        if "authorization" in found:
            return self.authenticate(found["authorization"])
        for name in _KEY_HEADERS[1:]:
            value = found.get(name, "").strip()
            if value:
                return self.authenticate_key(value)
        return missing_key_error()

    def authenticate_key(self, key: str) -> str | ApiError:
        key_hash = hash_key(key).encode()
        entry = self._by_hash.get(key_hash)
        # The dict lookup finds the candidate; the final equality is decided by a
        # constant-time comparison of the stored hash with the computed one, so no
        # early-exit timing depends on how many leading bytes matched. Only hashes are
        # compared, never keys.
        if entry is None or not hmac.compare_digest(key_hash, entry[0]):
            # The hash prefix tells an operator which wrong key a client keeps sending
            # without revealing anything usable.
            log.debug("authentication failed: unknown key %s...", key_hash[:15].decode())
            return invalid_key_error()
        return entry[1]
