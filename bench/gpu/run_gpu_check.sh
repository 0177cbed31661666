#!/usr/bin/env bash
# The GPU check of the verl backend, in stages, on the device machine (docs/backends/verl.md,
# "GPU check: how to run it"). Prepare here first: bash bench/gpu/fetch.sh
#
#   bash bench/gpu/run_gpu_check.sh stage                    # 1: carry .whl/ray_a .whl/extra
#   bash bench/gpu/run_gpu_check.sh install preflight local bench  # 2: carry .whl/whl .whl/ray_b
#   bash bench/gpu/run_gpu_check.sh test countdown           # 3: carry as 2
# Calls 2 and 3 also carry .cache/countdown-warmstart-tiny (the countdown recipe's model).
# Each call straight after the last, on the same warm machine (`all` runs every stage in one).
#
# stage     keeps the first part of Ray's wheel and the extra wheels in $STAGE (/tmp survives
#           between calls made one right after the other)
# install   Ray's wheel joined and checked, the verl wheels and the extras the image lacks, and
#           the project (--no-deps) into $SITE
# preflight versions, the device, and every import the check needs
# test      pytest -m gpu tests/test_verl_gpu.py
# local     the local backend on the ~0.5B Qwen2: bench/verl_gpu.py --backend local (step time),
#           then bench/sampler.py in bf16 (the local sampler against HF generate, and the bound)
# bench     bench/verl_gpu.py on the ~0.5B Qwen2 (with DEVICE=cpu: --device cpu --tiny)
# countdown unified train examples/countdown/verl_sync.yaml with verl.device=$DEVICE, a few steps
#
# Every stage logs to $OUT/<stage>.log and appends "<stage> rc=<rc> <seconds>s" to
# $OUT/stages.txt; a failed (or timed-out: limit_s below) stage does not stop the next one; the
# exit status says whether any failed.
# Environment: OUT (runs/gpu-check), DEVICE (cuda), PYTHON (python3), SITE (/tmp/site),
# STAGE (/tmp/gpu-stage), STEPS (countdown steps, 20), PIP_TARGET_FLAGS (extra `pip install`
# flags: on this CPU machine, --python-version 3.12 ... installs the same wheels for checking).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu-check} DEVICE=${DEVICE:-cuda} PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/site} STAGE=${STAGE:-/tmp/gpu-stage} STEPS=${STEPS:-20}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled RAY_DEDUP_LOGS=0
mkdir -p "$OUT"
[ -d "$SITE" ] && export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
pip_install() {
  # shellcheck disable=SC2086  # PIP_TARGET_FLAGS is a list of flags
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --root-user-action=ignore --target "$SITE" ${PIP_TARGET_FLAGS:-} "$@"
}

run_stage() {
  [ -f .whl/ray_a/ray.whl.aa ] && [ -d .whl/extra ] \
    || { echo "carry .whl/ray_a and .whl/extra (made by bash bench/gpu/fetch.sh)"; return 2; }
  mkdir -p "$STAGE" && cp .whl/ray_a/ray.whl.aa "$STAGE/" && cp -r .whl/extra "$STAGE/"
  du -sh "$STAGE"
}

run_install() {
  [ -f "$STAGE/ray.whl.aa" ] \
    || { echo "no $STAGE/ray.whl.aa: run the stage 'stage' first, on this machine"; return 2; }
  [ -f .whl/ray_b/NAME ] && [ -d .whl/whl ] || { echo "carry .whl/whl and .whl/ray_b"; return 2; }
  local ray
  ray="$STAGE/$(cat .whl/ray_b/NAME)"
  cp .whl/ray_b/ray.whl.ab "$STAGE/" && cat "$STAGE"/ray.whl.a? > "$ray" \
    && (cd "$STAGE" && sha256sum -c "$OLDPWD/.whl/ray_b/ray.sha256") || return 1
  pip_install .whl/whl/*.whl "$ray" || return 1
  # An extra wheel goes in only when the image lacks its distribution: the image's own stay.
  local missing
  missing=$(env -u PYTHONPATH "$PYTHON" - "$STAGE"/extra/*.whl <<'EOF'
import importlib.metadata as md, os, sys
for wheel in sys.argv[1:]:
    name = os.path.basename(wheel).split("-")[0]
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        print(wheel)
EOF
  ) || return 1
  echo "extras the image lacks: $(echo "$missing" | xargs -rn1 basename | cut -d- -f1 | xargs)"
  [ -z "$missing" ] || pip_install $missing || return 1
  # The project's entry points name the backends: it is installed, built by the setuptools found.
  PYTHONPATH="$SITE" "$PYTHON" -m pip install -q --no-deps --no-build-isolation \
    --ignore-requires-python --no-cache-dir --upgrade --root-user-action=ignore --target "$SITE" . \
    || return 1
  du -sh "$SITE"
}

run_preflight() {
  "$PYTHON" - "$DEVICE" <<'EOF'
import importlib, importlib.metadata as md, platform, sys
device = sys.argv[1]
print("python", platform.python_version())
for name in ["torch", "transformers", "tokenizers", "verl", "ray", "tensordict", "hydra-core",
             "omegaconf", "pydantic", "transferqueue", "pytest", "pytest-asyncio", "unified"]:
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING")
missing = []
for module in ["unified.cli", "backends.verl.backend", "backends.verl.worker", "ray", "pytest",
               "pytest_asyncio", "aiohttp", "bench.verl_gpu", "examples.countdown.prepare"]:
    try:
        importlib.import_module(module)
    except Exception as e:
        missing.append(f"{module}: {type(e).__name__}: {e}")
import torch
print("cuda", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
if device == "cuda" and not torch.cuda.is_available():
    missing.append("torch sees no CUDA device")
print("\n".join(missing) or "every import the check needs works")
sys.exit(1 if missing else 0)
EOF
}

run_test() {
  "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_verl_gpu.py
}

run_bench() {
  if [ "$DEVICE" = cuda ]; then
    "$PYTHON" -m bench.verl_gpu --json "$OUT/verl_gpu.json"
  else
    "$PYTHON" -m bench.verl_gpu --device cpu --tiny --steps 2 --warmup 1 --json "$OUT/verl_gpu.json"
  fi
}

run_local() {
  local model=/tmp/unified-bench-qwen2-0.5b-random args=()
  if [ "$DEVICE" = cpu ]; then
    model=/tmp/unified-bench-tiny-random args=(--device cpu --tiny --steps 2 --warmup 1)
  fi
  "$PYTHON" -m bench.verl_gpu --backend local "${args[@]}" --model-dir "$model" \
    --json "$OUT/local_gpu.json" || return 1
  # BANDWIDTH_GBS: the device's memory bandwidth (H100 SXM 3350, H200 4800; the datasheets').
  "$PYTHON" -m bench.sampler --model "$model" --device "$DEVICE" --dtype bf16 --rounds 3 \
    --batch 64 --max-tokens 128 --no-batching ${BANDWIDTH_GBS:+--bandwidth-gbs "$BANDWIDTH_GBS"} \
    --json "$OUT/sampler_gpu.json"
}

run_countdown() {
  local workers=1 name=gpu-countdown
  "$PYTHON" -m unified.cli train examples/countdown/verl_sync.yaml "name=$name" \
    "verl.device=$DEVICE" "verl.num_workers=$workers" "trainer.total_steps=$STEPS" \
    "trainer.eval_every=$STEPS" data.eval_limit=100 "logging.run_dir=$OUT/runs" || return 1
  "$PYTHON" - "$OUT/runs/$name/metrics.jsonl" <<'EOF'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "time/step" in r]
rows = rows[1:] or rows  # step 1 compiles and allocates
med = {k: statistics.median(r[k] for r in rows) for k in ("time/step", "time/train", "time/sync")}
times = "  ".join(f"{k} {v:.3f} s" for k, v in med.items())
share = med["time/sync"] / med["time/step"]
print(f"countdown, median of the last {len(rows)} steps: {times}  time/sync share {share:.2%}")
EOF
}

if [ "${1:-}" = --one ]; then run_"$2"; exit; fi
stages="stage install preflight local test bench countdown"
case " $* " in *" all "*) set -- $stages ;; esac
[ $# -gt 0 ] || { echo "usage: $0 STAGE... ($stages, or all)"; exit 2; }
declare -A limit_s=([stage]=60 [install]=240 [preflight]=120 [local]=300 [test]=300 [bench]=420 [countdown]=480)
failed=0
for name in "$@"; do
  [ -n "${limit_s[$name]:-}" ] || { echo "unknown stage '$name'; use $stages, or all"; exit 2; }
  echo "== $name ($(date -u +%H:%M:%S), at most ${limit_s[$name]}s)"
  started=$SECONDS
  timeout -k 10 "${limit_s[$name]}" bash "$0" --one "$name" > >(tee "$OUT/$name.log") 2>&1
  rc=$?
  echo "$name rc=$rc $((SECONDS - started))s" | tee -a "$OUT/stages.txt"
  [ $rc -eq 0 ] || failed=1
done
exit $failed
