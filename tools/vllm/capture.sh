#!/usr/bin/env bash
# Capture vLLM 0.33.0's truth (schemas, responses, error texts) into tests/data/vllm/.
#
# Builds a throwaway venv OUTSIDE the repo (default ~/.cache/seawall/vllm-0.33.0; override
# with SEAWALL_VLLM_VENV), installs vllm==0.33.0 with --no-deps, CPU torch 2.13.0 (pip takes
# it from this machine's disk; vLLM pins 2.14.0 but imports fine on 2.13), and exactly the
# packages the import chain of vLLM's HTTP server needs, each constrained to the range
# vLLM's own metadata requires. Then runs capture.py, which serves vLLM's real app with a
# stand-in engine core (harness.py) and writes the fixtures. Nothing of vLLM is committed:
# only what its code answered. About 2 minutes warm, 5-10 fresh; ~2 GB of venv.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="${SEAWALL_VLLM_VENV:-$HOME/.cache/seawall/vllm-0.33.0}"
OUT="${1:-$REPO/tests/data/vllm}"
PY="$VENV/bin/python"
# The import chain of vllm.entrypoints (app, serving classes, AsyncLLM, renderers), found by
# importing until nothing is missing; vLLM's --no-deps install leaves all of them out.
NEEDED=(
  packaging pydantic regex numpy cbor2 psutil pyzmq urllib3 requests transformers tokenizers
  aiohttp oss-harmony openai fastapi starlette uvicorn pillow pybase64 cachetools
  prometheus_client prometheus-fastapi-instrumentator msgspec cloudpickle uvloop py-cpuinfo
  partial_json_parser xgrammar llguidance lm-format-enforcer orjson watchfiles
  model-hosting-container-standards
)

if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
fi
if ! "$PY" -c 'import vllm' 2>/dev/null; then
  "$PY" -m pip install -q --no-deps vllm==0.33.0
fi
if ! "$PY" -c 'import torch' 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0  # the CPU wheel on disk; never a CUDA build
fi
CONSTRAINTS="$VENV/vllm-constraints.txt"
"$PY" -m pip install -q packaging  # to read vLLM's requirements below
"$PY" - >"$CONSTRAINTS" <<'PYEOF'
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("vllm"):
    req = Requirement(line)
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name in ("torch", "torchaudio", "torchvision") or not str(req.specifier):
        continue
    print(f"{req.name}{req.specifier}")
PYEOF
# torch==2.13.0 stays: pin it so nothing upgrades it to a CUDA build
"$PY" -m pip install -q -c "$CONSTRAINTS" torch==2.13.0 "${NEEDED[@]}"
cd "$HERE"
"$PY" capture.py --out "$OUT"
echo "wrote $OUT/captured.json, schemas.json, versions.json"
