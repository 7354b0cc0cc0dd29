#!/usr/bin/env bash
# Build DeepEP (>= 2: deep_ep.ElasticBuffer, what torchtitan 0.3.0's deepep backend needs) into a wheel
# on a GPU machine without network, install it into the stack's folder, and check the import.
# NOT YET RUN ON A GPU MACHINE: every step below is from reading DeepEP's setup.py, find_pkgs.py and
# deep_ep/__init__.py at the pinned commit (scripts/deepep_source.sh), not from a build that worked.
#
#   # here, once (needs the fetched mirrors; writes the gitignored .deepep/):
#   bash scripts/deepep_source.sh
#   # on the GPU machine (run with carry [".deepep"]), after the apiary stack is in /tmp/gpu-site:
#   export PYTHONPATH=/tmp/gpu-site:$PWD
#   bash scripts/build_deepep.sh            # SRC=.deepep/src.tar.gz SITE=/tmp/gpu-site OUT=/tmp/deepep-dist
#
# What the build needs, and where this script takes it from:
# - torch: the one on PYTHONPATH (SITE), compiled against with no build isolation;
# - nvcc (CUDA >= 12.3; the machines have 13.0): CUDA_HOME, else nvcc on PATH, else /usr/local/cuda.
#   DeepEP adds /usr/local/cuda/include/cccl (CUDA 13 moved CUB/Thrust/libcu++ there); another
#   CUDA_HOME's include/cccl goes on CPATH. nvcc is needed again at run time: DeepEP compiles its
#   EPv2 kernels just in time (deep_ep finds CUDA through CUDA_HOME or `which nvcc`);
# - NVSHMEM headers and libraries (include/, lib/libnvshmem_host.so.3, lib/libnvshmem_device.a): the
#   nvidia-nvshmem-cu13 wheel's nvidia/nvshmem folder (the image has it; torch's CUDA 13 stack also
#   pins it). setup.py links the legacy (v1) kernels against it, even though ElasticBuffer uses NCCL;
# - NCCL >= 2.30.4 headers and library: torch's nvidia-nccl-cu13 wheel (nvidia/nccl/{include,lib}),
#   the very library torch loads: deep_ep checks at import that the loaded libnccl is the linked
#   one, and before NCCL 2.31 that compile- and run-time versions agree (torch 2.14.1: NCCL 2.30.7).
#   EP_NCCL_ROOT_DIR is baked into the installed package (deep_ep/envs.py) for the JIT;
# - libcuda.so to link (-lcuda): the toolkit's stubs, else the driver's libcuda.so.1 via a symlink;
# - setuptools (bdist_wheel) and ninja (parallel compiles, MAX_JOBS): the image's, else the wheels
#   scripts/deepep_source.sh put in .deepep/wheels (installed into a scratch folder, not the stack);
# - rdma-core's <infiniband/mlx5dv.h> (NVSHMEM's IBGDA header includes it): /usr/include, else the
#   headers scripts/deepep_source.sh unpacked into .deepep/include;
# - TORCH_CUDA_ARCH_LIST=9.0 (H100/H200; DeepEP's default).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-python3}
case $PY in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; *) PY=$(command -v "$PY") ;; esac  # absolute: the build runs in the unpacked source
SRC=${SRC:-$ROOT/.deepep/src.tar.gz}
SITE=${SITE:-/tmp/gpu-site}
WORK=${WORK:-/tmp/deepep-build}
OUT=${OUT:-/tmp/deepep-dist}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export EP_JIT_CACHE_DIR=${EP_JIT_CACHE_DIR:-/tmp/deep_ep_jit}
start=$(date +%s)
say() { echo "build_deepep: $*"; }
die() { echo "build_deepep: $*" >&2; exit 2; }
[ -f "$SRC" ] || die "no source tarball $SRC (make it with scripts/deepep_source.sh and carry .deepep)"
case ":${PYTHONPATH:-}:" in *":$SITE:"*) ;; *) export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" ;; esac
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
tar -xzf "$SRC" -C "$WORK"
cat "$WORK/deepep/APIARY_SOURCE" 2>/dev/null || true
$PY -c 'import torch; print("build_deepep: torch", torch.__version__, "CUDA", torch.version.cuda, "from", torch.__file__)'

# build helpers
if ! $PY -c 'import setuptools' 2>/dev/null || ! command -v ninja >/dev/null; then
  [ -d "$ROOT/.deepep/wheels" ] || die "setuptools or ninja missing and no .deepep/wheels to install them from"
  $PY -m pip install -q --no-index --no-deps --target "$WORK/helpers" "$ROOT"/.deepep/wheels/*.whl
  export PYTHONPATH="$PYTHONPATH:$WORK/helpers" PATH="$WORK/helpers/bin:$WORK/helpers/ninja/data/bin:$PATH"
fi
say "setuptools $($PY -c 'import setuptools; print(setuptools.__version__)'), ninja $(ninja --version 2>/dev/null || echo 'none: serial compile')"

# CUDA
if [ -z "${CUDA_HOME:-}" ]; then
  if command -v nvcc >/dev/null; then CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); fi
  [ -n "${CUDA_HOME:-}" ] && [ -f "$CUDA_HOME/include/cuda_runtime.h" ] || CUDA_HOME=/usr/local/cuda
fi
export CUDA_HOME
[ -x "$CUDA_HOME/bin/nvcc" ] || die "no nvcc under CUDA_HOME=$CUDA_HOME (set CUDA_HOME to the CUDA toolkit)"
[ -f "$CUDA_HOME/include/cuda_runtime.h" ] || die "no CUDA headers under $CUDA_HOME/include"
export PATH="$CUDA_HOME/bin:$PATH"
say "CUDA_HOME=$CUDA_HOME: $("$CUDA_HOME/bin/nvcc" --version | grep -o 'release [0-9.]*')"
if [ -d "$CUDA_HOME/include/cccl" ]; then export CPATH="$CUDA_HOME/include/cccl${CPATH:+:$CPATH}"; fi
# headers a toolkit of nvcc + runtime lacks (torch's ATen/cuda includes cusparse.h, cublas_v2.h): torch's
# own CUDA wheels' include folder, searched after CUDA_HOME's (CPATH comes after the -I folders)
wheel_inc=$($PY -c 'import os, sys; print(next((os.path.abspath(d) for p in sys.path for d in [os.path.join(p or ".", "nvidia", "cu13", "include")] if os.path.isfile(os.path.join(d, "cusparse.h"))), ""))')
if [ -n "$wheel_inc" ] && [ ! -f "$CUDA_HOME/include/cusparse.h" ]; then export CPATH="${CPATH:+$CPATH:}$wheel_inc"; say "CUDA library headers from $wheel_inc"; fi
if [ ! -f /usr/include/infiniband/mlx5dv.h ]; then  # NVSHMEM's IBGDA header includes it (found building on CPU)
  [ -f "$ROOT/.deepep/include/infiniband/mlx5dv.h" ] || die "no infiniband/mlx5dv.h: install libibverbs-dev, or carry .deepep/include (scripts/deepep_source.sh)"
  export CPATH="${CPATH:+$CPATH:}$ROOT/.deepep/include"; say "verbs headers from $ROOT/.deepep/include"
fi
libcuda=""
for d in ${LIBCUDA_DIR:-} "$CUDA_HOME/lib64/stubs" "$CUDA_HOME/targets/x86_64-linux/lib/stubs" /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/nvidia/lib64; do
  if [ -e "$d/libcuda.so" ]; then libcuda=$d; break; fi
done
if [ -z "$libcuda" ]; then
  so1=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
  [ -n "$so1" ] || die "no libcuda.so (driver or toolkit stubs) to link against"
  mkdir -p "$WORK/lib" && ln -sf "$so1" "$WORK/lib/libcuda.so" && libcuda="$WORK/lib"
fi
export LIBRARY_PATH="$libcuda${LIBRARY_PATH:+:$LIBRARY_PATH}"
say "libcuda.so from $libcuda"

# NVSHMEM and NCCL: the wheels' folders, first on sys.path (the stack's before the image's)
read -r nvshmem nccl < <($PY - <<'PY'
import os, sys
def first(name, header):
    for p in sys.path:
        d = os.path.join(p or ".", "nvidia", name)
        if os.path.isfile(os.path.join(d, "include", header)):
            return os.path.abspath(d)
    return "-"
print(first("nvshmem", "nvshmem.h"), first("nccl", "nccl.h"))
PY
)
export EP_NVSHMEM_ROOT_DIR=${EP_NVSHMEM_ROOT_DIR:-$nvshmem} EP_NCCL_ROOT_DIR=${EP_NCCL_ROOT_DIR:-$nccl}
[ -d "$EP_NVSHMEM_ROOT_DIR/include" ] || die "no NVSHMEM (nvidia/nvshmem/include/nvshmem.h) on sys.path: the nvidia-nvshmem-cu13 wheel, or set EP_NVSHMEM_ROOT_DIR"
[ -f "$EP_NVSHMEM_ROOT_DIR/lib/libnvshmem_device.a" ] || die "no $EP_NVSHMEM_ROOT_DIR/lib/libnvshmem_device.a"
ls "$EP_NVSHMEM_ROOT_DIR"/lib/libnvshmem_host.so* >/dev/null || die "no libnvshmem_host.so* in $EP_NVSHMEM_ROOT_DIR/lib"
[ -f "$EP_NCCL_ROOT_DIR/include/nccl.h" ] || die "no NCCL headers (nvidia/nccl/include/nccl.h) on sys.path: torch's nvidia-nccl-cu13 wheel, or set EP_NCCL_ROOT_DIR"
# DeepEP's setup.py links -l:libnccl.so.2 with an rpath but no -L to NCCL's lib folder (found building on CPU:
# "ld: cannot find -l:libnccl.so.2"): put it on the linker's search path
export LIBRARY_PATH="$EP_NCCL_ROOT_DIR/lib:$LIBRARY_PATH"
say "NVSHMEM $EP_NVSHMEM_ROOT_DIR ($(ls "$EP_NVSHMEM_ROOT_DIR"/lib/libnvshmem_host.so* | xargs -n1 basename | tr '\n' ' '))"
say "NCCL $EP_NCCL_ROOT_DIR ($(grep -E '#define NCCL_(MAJOR|MINOR|PATCH) ' "$EP_NCCL_ROOT_DIR/include/nccl.h" | awk '{printf "%s.", $3}' | sed 's/\.$//'))"

# the wheel (no build isolation: it must see this torch); then install into the stack and check
cd "$WORK/deepep"
rc=0; $PY setup.py bdist_wheel --dist-dir "$OUT" > "$WORK/build.log" 2>&1 || rc=$?
grep -E "^ > " "$WORK/build.log" | grep -v "^ > Sources" || true
[ "$rc" = 0 ] || { grep -E -m 20 "error|Error" "$WORK/build.log" || true; tail -20 "$WORK/build.log"; die "setup.py failed ($rc); full log: $WORK/build.log"; }
whl=$(ls -t "$OUT"/deep_ep-*.whl 2>/dev/null | head -1)
[ -n "$whl" ] || { tail -40 "$WORK/build.log"; die "no wheel built (full log: $WORK/build.log)"; }
say "built $(basename "$whl") ($(du -h "$whl" | cut -f1)) in $(( $(date +%s) - start )) s"
$PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$whl"
so=$(ls "$SITE"/deep_ep/_C*.so)
say "$(basename "$so") links: $(ldd "$so" | grep -E 'nvshmem|nccl|cuda\.so|not found' | awk '{print $1, $2, $3}' | tr '\n' ';')"
cd /tmp
$PY -c 'import torch, deep_ep; print("build_deepep: import ok: deep_ep", deep_ep.__version__, deep_ep.ElasticBuffer)'
say "done in $(( $(date +%s) - start )) s; at run time export CUDA_HOME=$CUDA_HOME (the JIT's nvcc)"
