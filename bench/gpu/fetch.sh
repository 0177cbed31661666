#!/usr/bin/env bash
# Make everything the GPU check carries to the device machine, here (pip's index, no GPU):
#   .whl/whl, .whl/ray_a, .whl/ray_b   ../shared/gpu/wheels-verl.txt (its fetch_wheels.sh)
#   .whl/extra                         bench/gpu/wheels-unified.txt
#   .cache/countdown-warmstart-tiny    the countdown warm start (built once, reused)
# and check that each device call's carry stays within 64 MiB. `.whl/` is git-ignored.
#   bash bench/gpu/fetch.sh            (SHARED_GPU=<dir> if ../shared/gpu is elsewhere)
set -euo pipefail
cd "$(dirname "$0")/../.."
shared=${SHARED_GPU:-../shared/gpu}
[ -f .whl/ray_b/NAME ] || bash "$shared/fetch_wheels.sh" "$shared/wheels-verl.txt" .whl
mkdir -p .whl/extra
grep -Ev '^\s*(#|$)' bench/gpu/wheels-unified.txt | xargs python3 -m pip download -q --no-deps \
  --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl/extra
"${PYTHON:-.venv/bin/python}" -c \
  'from examples.countdown.prepare import warmstart_model; print("warm start:", warmstart_model())'
mib() { du -smc "$@" | tail -1 | cut -f1; }
first=$(mib .whl/ray_a .whl/extra)
second=$(mib .whl/whl .whl/ray_b .cache/countdown-warmstart-tiny)
echo "carry of call 1 (.whl/ray_a .whl/extra): ${first} MiB"
echo "carry of call 2 (.whl/whl .whl/ray_b .cache/countdown-warmstart-tiny): ${second} MiB"
[ "$first" -le 64 ] && [ "$second" -le 64 ] || { echo "a carry is over 64 MiB"; exit 1; }
