#!/usr/bin/env bash
# The real attention kernels (FlashAttention's CuTe kernels, FlashInfer) for a GPU machine that
# reaches no package registry, carried there as wheels in parts small enough for one transfer.
#
#   here:  scripts/gpu_kernels.sh download         wheels -> .whl/kernels, split into .whl/k1..k4
#   there: scripts/gpu_kernels.sh stage .whl/kN    copy one carried part to $STAGE (one call each)
#   there: scripts/gpu_kernels.sh install          join the parts, pip install --no-deps --target
#   there: source <(scripts/gpu_kernels.sh env)    PYTHONPATH for the installed kernels
#
# The versions are the set known to work with torch 2.11 + CUDA 13, Python 3.12, on Hopper.
# A --target install does not run the packages' .pth files, so `env` also puts CuTe DSL's
# dsl_packages folder on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
  flash-attn-4==4.0.0b36
  nvidia-cutlass-dsl==4.8.1
  nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1
  nvidia-cutlass-dsl-libs-cu13==4.8.1
  quack-kernels==0.6.5
  apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5
  flashinfer-python==0.7.2.post1
)
PART_MB=45                      # one carried part stays well under a transfer's 64 MiB
STAGE=${STAGE:-/tmp/specmeta-wheels}
TARGET=${TARGET:-/tmp/specmeta-kernels}

download() {
  local dir=.whl/kernels
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "${WHEELS[@]}"
  rm -rf .whl/k1 .whl/k2 .whl/k3 .whl/k4
  mkdir -p .whl/k1 .whl/k2 .whl/k3 .whl/k4
  # k1 and k2: the large CuTe DSL library in two pieces, each with half the small wheels;
  # k3 and k4: FlashInfer (62 MB) in two pieces, so that a part and the repository's own tree
  # (about 5 MB) stay under one transfer's 64 MiB.
  local big fi n=0
  big=$(ls "$dir"/nvidia_cutlass_dsl_libs_cu13-*.whl)
  split -b "${PART_MB}M" -d "$big" ".whl/k1/$(basename "$big").part"
  mv ".whl/k1/$(basename "$big").part01" .whl/k2/
  fi=$(ls "$dir"/flashinfer_python-*.whl)
  split -b 31M -d "$fi" ".whl/k3/$(basename "$fi").part"
  mv ".whl/k3/$(basename "$fi").part01" .whl/k4/
  for w in "$dir"/*.whl; do
    case "$w" in
      "$big" | "$fi") ;;
      *) n=$((n + 1)); cp "$w" ".whl/k$(( n % 2 + 1 ))/" ;;
    esac
  done
  du -sh .whl/k1 .whl/k2 .whl/k3 .whl/k4
}

stage() {
  mkdir -p "$STAGE"
  cp "$1"/* "$STAGE"/
  ls "$STAGE" | wc -l | xargs echo "staged files:"
}

install() {
  local part
  for part in "$STAGE"/*.part00; do
    [ -e "$part" ] || continue
    cat "${part%.part00}".part* > "${part%.part00}"
    rm -f "${part%.part00}".part*
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$TARGET" "$STAGE"/*.whl
  echo "installed into $TARGET"
}

env_() {
  echo "export PYTHONPATH=$TARGET:$TARGET/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH}"
}

case "${1:-}" in
  download) download ;;
  stage) stage "${2:?stage needs the carried folder}" ;;
  install) install ;;
  env) env_ ;;
  *) echo "usage: $0 download | stage <dir> | install | env" >&2; exit 2 ;;
esac
