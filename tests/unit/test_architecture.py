"""The house rules about who may import whom, checked by walking the source's imports.

Every import counts, wherever it is written (module level, inside a function, under
`TYPE_CHECKING`): a lazy import is still a dependency, and a cycle hidden behind one is
still a cycle that stops a module being understood or tested on its own.

Rules:
- no import cycle among `src/seawall` modules;
- `policy/` (pure decisions) imports only the standard library, `policy/` and the value
  record (`seawall.values`);
- `protocol/` (sans-I/O OpenAI) imports only the standard library, `protocol/`, the
  OpenAI error shape (`seawall.errors`) and its codecs (orjson for JSON, tokenizers for
  counting) and the value record; `seawall.errors` and `seawall.values` import nothing
  of Seawall's;
- `fleet/` (the monitor, off the request path) never imports `gateway/` (the request
  path): the gateway reads the fleet's snapshot, never the other way round.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
STDLIB = set(sys.stdlib_module_names)


def modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in (SRC / "seawall").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = modules()


def _resolve(name: str) -> str:
    """The module (in MODULES) that `name` (a module or a name inside one) belongs to."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports(module: str) -> Iterator[str]:
    """Every top-level package or `seawall` module that `module` imports, anywhere."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield _resolve(alias.name) if alias.name.startswith("seawall") else alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if not target.startswith("seawall"):
                yield target
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                yield full if full in MODULES else _resolve(target)


def seawall_imports(module: str) -> set[str]:
    return {m for m in imports(module) if m.startswith("seawall") and m != module}


def third_party(module: str) -> set[str]:
    return {
        m.split(".")[0]
        for m in imports(module)
        if not m.startswith("seawall") and m.split(".")[0] not in STDLIB
    }


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_walk_sees_the_modules_and_their_imports() -> None:
    # A guard for the checks below: a walker that found nothing would pass them all.
    assert len(MODULES) > 50
    assert "seawall.policy.token_bucket" in seawall_imports("seawall.policy.retry_budget")
    assert "seawall.gateway.inflight" in seawall_imports("seawall.gateway.replicas")


def test_no_import_cycles() -> None:
    graph = {m: seawall_imports(m) for m in MODULES}
    # Tarjan's strongly connected components; any component of two or more is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_policy_is_pure() -> None:
    for m in MODULES:
        if in_package(m, "seawall.policy"):
            assert third_party(m) == set(), m
            outside = {
                i
                for i in seawall_imports(m)
                if not in_package(i, "seawall.policy") and i != "seawall.values"
            }
            assert outside == set(), f"{m} imports {outside}"


def test_protocol_is_sans_io() -> None:
    allowed_seawall = {"seawall.errors", "seawall.values"}
    allowed_third_party = {"orjson", "tokenizers"}
    for m in MODULES:
        if in_package(m, "seawall.protocol"):
            assert third_party(m) <= allowed_third_party, (m, third_party(m))
            outside = {
                i
                for i in seawall_imports(m)
                if not in_package(i, "seawall.protocol") and i not in allowed_seawall
            }
            assert outside == set(), f"{m} imports {outside}"
    assert seawall_imports("seawall.errors") == set()
    assert seawall_imports("seawall.values") == set()


def test_the_fleet_never_imports_the_request_path() -> None:
    for m in MODULES:
        if in_package(m, "seawall.fleet"):
            gateway = {i for i in seawall_imports(m) if in_package(i, "seawall.gateway")}
            assert gateway == set(), f"{m} imports {gateway}"
