#!/usr/bin/env bash
# Prepare DeepEP's source for a GPU machine that has no network: a tarball in the gitignored
# .deepep/ folder, carried with the working tree (`run` carry: [".deepep"]) and built there by
# scripts/build_deepep.sh. Run on a machine that has the public repositories as git mirrors
# (this workplace's `fetch` tool puts them under /work/.mirror/OWNER+NAME/repo), or clones:
#
#   bash scripts/deepep_source.sh                                   # the pinned commits below
#   DEEPEP_GIT=/path/to/DeepEP/.git FMT_GIT=/path/to/fmt/.git DEEPEP_COMMIT=<sha> bash scripts/deepep_source.sh
#
# Writes .deepep/src.tar.gz (DeepEP at DEEPEP_COMMIT as deepep/, with its one submodule, fmt, at the
# commit DeepEP pins, under deepep/third-party/fmt: `git archive` leaves submodules empty) and
# .deepep/wheels/ (ninja, setuptools, wheel for CPython 3.12: the build's helpers, which the GPU
# machines' image may lack; NO_WHEELS=1 skips them) and .deepep/include/infiniband (below). Nothing of DeepEP is committed to this repository.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEEPEP_GIT=${DEEPEP_GIT:-/work/.mirror/deepseek-ai+DeepEP/repo}
FMT_GIT=${FMT_GIT:-/work/.mirror/fmtlib+fmt/repo}
# DeepEP main, 2026-07-14, deep_ep.__version__ 2.1.0: ElasticBuffer (EPv2, introduced in b306af0,
# 2026-04-30) with the dispatch/combine/get_buffer_size_hint API torchtitan 0.3.0's deepep backend
# calls, and the SM90 fix 60d4403 (2026-07-09) the H200s need.
DEEPEP_COMMIT=${DEEPEP_COMMIT:-dd758caf451848bd150e1046af3d0a73e5fff38d}
OUT=${OUT:-$ROOT/.deepep}
PY=${PY:-python3}
mkdir -p "$OUT"
work=$(mktemp -d /tmp/deepep_src.XXXXXX)
trap 'rm -rf "$work"' EXIT
git --git-dir="$DEEPEP_GIT" cat-file -e "$DEEPEP_COMMIT^{commit}" || {
  echo "deepep_source: $DEEPEP_GIT has no commit $DEEPEP_COMMIT (fetch github:deepseek-ai/DeepEP)" >&2; exit 2; }
fmt_commit=$(git --git-dir="$DEEPEP_GIT" ls-tree "$DEEPEP_COMMIT" third-party/fmt | awk '{print $3}')
git --git-dir="$FMT_GIT" cat-file -e "$fmt_commit^{commit}" || {
  echo "deepep_source: $FMT_GIT has no commit $fmt_commit, DeepEP's fmt submodule (fetch github:fmtlib/fmt)" >&2; exit 2; }
mkdir -p "$work/deepep/third-party/fmt"
git --git-dir="$DEEPEP_GIT" archive --format=tar "$DEEPEP_COMMIT" | tar -x -C "$work/deepep"
# fmt is used header-only (csrc/utils/format.hpp defines FMT_HEADER_ONLY): its include/ is enough
git --git-dir="$FMT_GIT" archive --format=tar "$fmt_commit" include LICENSE | tar -x -C "$work/deepep/third-party/fmt"
rm -rf "$work/deepep/figures"  # README images, not needed to build
printf '%s\n' "deepep $DEEPEP_COMMIT" "fmt $fmt_commit" > "$work/deepep/APIARY_SOURCE"
tar -C "$work" -czf "$OUT/src.tar.gz" deepep
echo "deepep_source: $OUT/src.tar.gz ($(du -h "$OUT/src.tar.gz" | cut -f1)): DeepEP $DEEPEP_COMMIT, fmt $fmt_commit"
# rdma-core's verbs headers: NVSHMEM's IBGDA header (nvshmem_common_ibgda.h, included by DeepEP's legacy
# internode kernels) includes <infiniband/mlx5dv.h>; a machine without libibverbs-dev fails there. Headers
# only (no library is linked): Debian's libibverbs-dev, unpacked. NO_IBVERBS=1 skips it.
if [ "${NO_IBVERBS:-0}" != 1 ]; then
  (cd "$work" && apt-get download libibverbs-dev >/dev/null 2>&1) || { echo "deepep_source: apt-get download libibverbs-dev failed" >&2; exit 2; }
  dpkg-deb -x "$work"/libibverbs-dev_*.deb "$work/ibv"
  rm -rf "$OUT/include" && mkdir -p "$OUT/include" && cp -r "$work/ibv/usr/include/infiniband" "$OUT/include/"
  echo "deepep_source: verbs headers ($(basename "$work"/libibverbs-dev_*.deb)) in $OUT/include/infiniband"
fi
if [ "${NO_WHEELS:-0}" != 1 ]; then
  mkdir -p "$OUT/wheels"
  "$PY" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$OUT/wheels" ninja setuptools wheel
  echo "deepep_source: build helpers in $OUT/wheels: $(cd "$OUT/wheels" && ls | tr '\n' ' ')"
fi
