#!/usr/bin/env bash
# Build the transformer-engine-torch wheel (TransformerEngine's PyTorch extension) from the
# package registry's source distribution, against the torch of the Python that runs it.
#
#   bash scripts/build_te.sh                     # wheel under $OUT (default dist/te)
#   PY=/path/to/python TE_VERSION=2.20.2 MAX_JOBS=8 OUT=dist/te bash scripts/build_te.sh
#
# Needs: that Python with torch (CUDA 12 or 13 build) and pip; CUDA's headers and nvcc, either a
# toolkit (nvcc on PATH or CUDA_HOME) or the registry's wheels (nvidia-cuda-nvcc, ...,
# NVTE_BUILD_USE_NVIDIA_WHEELS=1). No GPU: the extension is C++ only (33 sources) compiled against
# torch's and CUDA's headers; it loads TE's core library (the transformer_engine_cu13 /
# transformer_engine_cu12 wheel, prebuilt on the registry) at import time.
# Build-only dependencies (nvidia-cudnn-frontend's headers) go to a scratch folder on PYTHONPATH,
# never into the Python's environment. Install the result with the core wheel:
#   pip install dist/te/transformer_engine_torch-*.whl transformer_engine_cu13==$TE_VERSION
# and check: python -c "import transformer_engine.pytorch"   (docs/install.md)
set -euo pipefail
PY=${PY:-python3}
TE_VERSION=${TE_VERSION:-2.20.2}
OUT=${OUT:-dist/te}
WORK=${WORK:-$(mktemp -d /tmp/build_te.XXXXXX)}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
mkdir -p "$OUT" "$WORK/deps"
OUT=$(cd "$OUT" && pwd)
start=$(date +%s)
echo "build_te: torch $($PY -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)'), TE $TE_VERSION, MAX_JOBS $MAX_JOBS, scratch $WORK"
# CUDA headers: torch's own CUDA wheels (nvidia/cu13/include: runtime, cuBLAS, cuSPARSE, ...) when
# this Python has them (pip-installed torch), so the extension sees exactly torch's CUDA; else a
# full toolkit (CUDA_HOME, or one found below). A toolkit of nvcc + runtime only (e.g. the
# registry's nvidia-cuda-nvcc wheel) is not enough: torch's ATen/cuda headers include cusparse.h.
if [ -z "${CUDA_HOME:-}" ] && [ -z "${NVTE_BUILD_USE_NVIDIA_WHEELS:-}" ]; then
  if $PY -c 'import nvidia, pathlib, sys; sys.exit(0 if [h for p in nvidia.__path__ for h in pathlib.Path(p).glob("cu*/include/cusparse.h")] else 1)' 2>/dev/null; then
    export NVTE_BUILD_USE_NVIDIA_WHEELS=1
  else
    for c in "$($PY -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or "")' 2>/dev/null)" \
             /usr/local/cuda /usr/local/cuda-13.0 /usr/local/cuda-12.9; do
      if [ -n "$c" ] && [ -f "$c/include/cusparse.h" ] && [ -x "$c/bin/nvcc" ]; then export CUDA_HOME=$c; break; fi
    done
  fi
  if [ -z "${CUDA_HOME:-}" ] && [ -z "${NVTE_BUILD_USE_NVIDIA_WHEELS:-}" ]; then
    echo "build_te: no CUDA headers found: neither torch's nvidia CUDA wheels nor a CUDA toolkit with cusparse.h" \
         "(set CUDA_HOME to one)" >&2
    exit 2
  fi
fi
if [ "${NVTE_BUILD_USE_NVIDIA_WHEELS:-0}" = 1 ] && \
   ! $PY -c 'import nvidia, pathlib, sys; sys.exit(0 if [h for p in nvidia.__path__ for h in pathlib.Path(p).glob("*/include/crt/host_defines.h")] else 1)'; then
  # torch's runtime wheel ships cuda_runtime_api.h but not the compiler's crt/ headers it
  # includes; they come with nvcc (a toolkit, or the registry's nvidia-cuda-crt wheel)
  for c in "${CUDA_CRT_INCLUDE:-}" /usr/local/cuda/include /usr/local/cuda-13.0/include /usr/local/cuda-12.9/include; do
    if [ -n "$c" ] && [ -f "$c/crt/host_defines.h" ]; then export CPATH="$c${CPATH:+:$CPATH}"; break; fi
  done
  if [ -z "${CPATH:-}" ]; then
    echo "build_te: no crt/host_defines.h (CUDA compiler headers): pip install nvidia-cuda-crt, or set CUDA_CRT_INCLUDE" >&2
    exit 2
  fi
  echo "build_te: CUDA compiler headers (crt/) from $CPATH"
fi
if ! command -v nvcc >/dev/null && [ ! -x "${CUDA_HOME:-/nonexistent}/bin/nvcc" ]; then
  echo "build_te: no nvcc (TE's setup reads the CUDA version from it): pip install nvidia-cuda-nvcc, or a toolkit" >&2
  exit 2
fi
echo "build_te: CUDA headers from ${CUDA_HOME:-the nvidia CUDA wheels of this torch (NVTE_BUILD_USE_NVIDIA_WHEELS=1)}"
# 1. the sdist, and the build-only headers (cuDNN frontend) beside it
#    (offline machines: put the sdist and an unpacked nvidia-cudnn-frontend in $WORK, $WORK/deps first)
if [ ! -f "$WORK/transformer_engine_torch-$TE_VERSION.tar.gz" ]; then
  $PY -m pip download --no-deps --no-binary :all: --no-build-isolation "transformer-engine-torch==$TE_VERSION" -d "$WORK"
fi
if [ ! -f "$WORK/deps/include/cudnn_frontend.h" ]; then
  $PY -m pip install --no-deps --target "$WORK/deps" "nvidia-cudnn-frontend>=1.29.0"
fi
# 2. the wheel: no build isolation (it must see this torch), build from source (the setup script
#    otherwise tries to download a prebuilt wheel from GitHub)
export PYTHONPATH="$WORK/deps${PYTHONPATH:+:$PYTHONPATH}"
export NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_FRAMEWORK=pytorch
$PY -m pip wheel --no-deps --no-build-isolation -v -w "$OUT" "$WORK/transformer_engine_torch-$TE_VERSION.tar.gz"
end=$(date +%s)
echo "build_te: built in $((end - start)) s:"
ls -la "$OUT"/transformer_engine_torch-*.whl
