#!/usr/bin/env bash
# Make everything the GPU check carries to the device machine, here (pip's index, no GPU):
#   .whl/whl, .whl/ray_a, .whl/ray_b   bench/gpu/wheels-verl.txt (Ray's wheel split in two parts:
#                                      one device call carries at most 64 MiB)
#   .whl/extra                         bench/gpu/wheels-unified.txt
#   .cache/countdown-warmstart-tiny    the countdown warm start (built once, reused)
# and check that each device call's carry stays within 64 MiB. `.whl/` is git-ignored.
#   bash bench/gpu/fetch.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
download() {  # download DIR PIN...: Python 3.12 x86-64 wheels, no dependencies
  local dir=$1
  shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$dir" "$@"
}
pins() { grep -Ev '^\s*(#|$)' "$1"; }

if [ ! -f .whl/ray_b/NAME ]; then
  mkdir -p .whl/whl .whl/ray_a .whl/ray_b .whl/tmp
  pins bench/gpu/wheels-verl.txt | while read -r pin; do
    target=.whl/whl
    [ "${pin%%==*}" = ray ] && target=.whl/tmp
    # A few pure-Python packages ship only as source (antlr4-python3-runtime): build their wheel.
    download "$target" "$pin" 2>/dev/null || python3 -m pip wheel -q --no-deps -w "$target" "$pin"
  done
  ray=$(ls .whl/tmp/ray-*.whl)
  (cd .whl/tmp && sha256sum "$(basename "$ray")" > ../ray_b/ray.sha256 \
    && split -b 40M "$(basename "$ray")" ray.whl.)
  mv .whl/tmp/ray.whl.aa .whl/ray_a/ && mv .whl/tmp/ray.whl.ab .whl/ray_b/
  basename "$ray" > .whl/ray_b/NAME
  rm -rf .whl/tmp
fi
mkdir -p .whl/extra
mapfile -t extra < <(pins bench/gpu/wheels-unified.txt)
download .whl/extra "${extra[@]}"
"${PYTHON:-.venv/bin/python}" -c \
  'from examples.countdown.prepare import warmstart_model; print("warm start:", warmstart_model())'
mib() { du -smc "$@" | tail -1 | cut -f1; }
first=$(mib .whl/ray_a .whl/extra)
second=$(mib .whl/whl .whl/ray_b .cache/countdown-warmstart-tiny)
echo "carry of call 1 (.whl/ray_a .whl/extra): ${first} MiB"
echo "carry of call 2 (.whl/whl .whl/ray_b .cache/countdown-warmstart-tiny): ${second} MiB"
[ "$first" -le 64 ] && [ "$second" -le 64 ] || { echo "a carry is over 64 MiB"; exit 1; }
