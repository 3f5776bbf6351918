"""Secrets from the environment: `os.environ/NAME` and `${NAME}` in configuration values.

Owns the two reference forms operators know from LiteLLM and from shell/compose files,
and resolving them in parsed configuration data before it is validated:

- `os.environ/NAME` as a whole value (LiteLLM's form);
- `${NAME}` anywhere in a string, e.g. `redis://:${REDIS_PASSWORD}@redis:6379/0`;
  `$${` writes a literal `${`.

Every string in the data is resolved, not only fields we think of as secret: a replica
`api_key`, `ratelimit.redis_url`, `admin.token_hash`, a webhook URL, or anything a
deployment wants to vary per environment (`fleet.actuator: ${SEAWALL_ACTUATOR}`).

A resolved value is an `EnvValue`: a `str` whose `repr` names the variable instead of
showing the value, so validation errors (which print `repr` of the offending input) can
never echo a secret. Must not log or print a resolved value anywhere; errors name the
variable and the field, never the value. Must not read files or do other I/O.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

PREFIX = "os.environ/"
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_WHOLE_PREFIX = re.compile(rf"^{re.escape(PREFIX)}({_NAME})$")
# `$${` is an escaped literal; `${NAME}` a reference; any other `${` is a mistake.
_TOKEN = re.compile(rf"\$\$\{{|\$\{{({_NAME})\}}|\$\{{")


class EnvRefError(ValueError):
    """A reference that cannot be resolved. The message names the field and the
    variable, never a value."""


class EnvValue(str):
    """A string that came from the environment (in whole or in part)."""

    names: tuple[str, ...]

    def __new__(cls, value: str, names: tuple[str, ...]) -> EnvValue:
        obj = super().__new__(cls, value)
        obj.names = names
        return obj

    def __repr__(self) -> str:
        return f"<from ${{{', '.join(self.names)}}}>"


def _lookup(name: str, where: str, env: Mapping[str, str]) -> str:
    value = env.get(name)
    if value is None:
        raise EnvRefError(f"{where}: environment variable {name} is not set")
    if value == "":
        # An empty secret is almost always a missing Secret key, not an intended value.
        raise EnvRefError(f"{where}: environment variable {name} is set but empty")
    return value


def resolve_string(value: str, where: str, env: Mapping[str, str] | None = None) -> str:
    """`value` with its references replaced; `value` itself when it has none."""
    env = os.environ if env is None else env
    whole = _WHOLE_PREFIX.match(value)
    if whole is not None:
        name = whole.group(1)
        return EnvValue(_lookup(name, where, env), (name,))
    if value.startswith(PREFIX):
        raise EnvRefError(
            f"{where}: {PREFIX}NAME must be the whole value, with NAME made of letters, "
            "digits and underscores"
        )
    if "$" not in value:
        return value
    names: list[str] = []
    out: list[str] = []
    pos = 0
    for m in _TOKEN.finditer(value):
        out.append(value[pos : m.start()])
        pos = m.end()
        token = m.group(0)
        if token == "$${":
            out.append("${")
        elif m.group(1) is not None:
            names.append(m.group(1))
            out.append(_lookup(m.group(1), where, env))
        else:
            raise EnvRefError(
                f"{where}: '${{' must start a reference like ${{NAME}} (write $${{ for a "
                "literal '${')"
            )
    out.append(value[pos:])
    text = "".join(out)
    return EnvValue(text, tuple(names)) if names else text


def resolve(data: Any, where: str = "", env: Mapping[str, str] | None = None) -> Any:
    """A copy of parsed configuration data with every reference resolved. Mapping keys
    are left alone (they name things; they are not values)."""
    if isinstance(data, EnvValue):
        return data  # resolved already (a config dumped and parsed again)
    if isinstance(data, str):
        return resolve_string(data, where or "(value)", env)
    if isinstance(data, Mapping):
        return {k: resolve(v, f"{where}.{k}" if where else str(k), env) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [resolve(v, f"{where}.{i}" if where else str(i), env) for i, v in enumerate(data)]
    return data


def resolve_config(data: Any, source: str, error: type[Exception]) -> Any:
    """`resolve`, raising `error("<source>: <field>: ...")` for the config loader."""
    try:
        return resolve(data)
    except EnvRefError as e:
        raise error(f"{source}: {e}") from None
