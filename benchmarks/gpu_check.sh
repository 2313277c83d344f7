#!/usr/bin/env bash
# GPU check of the snapshot engine, the trainer's overlapped paths and a whole run, in stages:
#   build     dppo._C with the CUDA engine, in place (sm_90 by default)                       limit 120 s
#   tests     every test marked cuda (pytest -m cuda), the Ray rollout worker's included        limit 120 s
#   snapshot  benchmarks/snapshot_bench.py: save/restore against the baselines and the ceiling  limit  60 s
#   fsdp      benchmarks/fsdp_cycle.py: the actor plain and FSDP2 at world size 1 (NCCL)          limit  60 s
#   train     `dppo train` with its defaults on this machine: the demo, the actor on the GPU   limit  90 s
#             (ray.enabled auto: Ray, with trainer.device=auto -> cuda)
#   cycle     benchmarks/cycle_bench.py --gpu: whole sync cycles, bf16 0.4B and 1.2B models   limit 150 s
# The limits add up to 600 s, the device tool's limit on one command; the longest stage runs last.
# Usage: bash benchmarks/gpu_check.sh [STAGES] [RESULTS_DIR]
#   STAGES: comma-separated, default build,tests,snapshot,fsdp,train,cycle. A later call on the same warm machine can
#   skip build: the extension built in place stays.
#   RESULTS_DIR: default bench_out/gpu_check; every log and JSON file lands flat in it, and summary.txt holds the
#   verdicts. Where $OUT is set (the device tool's folder, which brings back at most 8 files), the results folder is
#   also packed into $OUT/gpu_check.tgz after every stage, so that a run cut short still brings back what it did.
# Each stage runs under its own time limit (a hang cannot eat the session's device time) and the script goes on to
# the next stage after a failure.
#
# Python: .venv/bin/python if it imports a CUDA build of torch, else the system python3 if it does (GPU images
# with torch preinstalled). Packages such an image lacks (omegaconf, cloudpickle, Ray) come from .gpu_wheels/
# when it is there (benchmarks/gpu_wheels.sh gathers it; the device tool carries it), unpacked into /tmp/dppo-site.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
STAGES=",${1:-build,tests,snapshot,fsdp,train,cycle},"
RESULTS=${2:-$ROOT/bench_out/gpu_check}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
START=$(date +%s)
declare -a SUMMARY=()
FAILED=0

has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' >/dev/null 2>&1; }
if [[ -x .venv/bin/python ]] && has_cuda_torch .venv/bin/python; then
  PY=$ROOT/.venv/bin/python
elif has_cuda_torch python3; then
  PY=$(command -v python3)
else
  echo "no python with a CUDA build of torch (make install creates .venv with one)" >&2
  exit 2
fi

SITE=/tmp/dppo-site
if [[ -d .gpu_wheels ]]; then
  mkdir -p "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .gpu_wheels/*.whl
  for tarball in .gpu_wheels/*.tar.xz; do [[ -e $tarball ]] && tar -xJf "$tarball" -C "$SITE"; done
fi
# the source tree first (dppo and its in-place extension), then the carried packages, then the image's
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"

want() { [[ $STAGES == *",$1,"* ]]; }

# step NAME LIMIT_S CMD...: runs CMD under a time limit, logs to $RESULTS/NAME.log, records the outcome.
step() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS rc=0
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$RESULTS/$name.log" 2>&1 || rc=$?
  tail -n 30 "$RESULTS/$name.log"
  local verdict=ok
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then verdict="TIMED OUT"; elif [[ $rc -ne 0 ]]; then verdict="FAILED (rc=$rc)"; fi
  [[ $verdict == ok ]] || FAILED=1
  SUMMARY+=("$(printf '%-16s %-18s %4ds' "$name" "$verdict" $((SECONDS - t0)))")
  pack
}
# pack: the results so far into $OUT/gpu_check.tgz (the device tool brings back few files, none deeper than 2 folders)
pack() {
  [[ -n ${OUT:-} && -d ${OUT:-} ]] || return 0
  printf '%s\n' "${SUMMARY[@]}" >"$RESULTS/summary.txt"
  tar -czf "$OUT/gpu_check.tgz" -C "$RESULTS" . 2>/dev/null || true
}
# verdicts NAME: the PASS/FAIL lines a benchmark printed, into the summary
verdicts() {
  local lines
  mapfile -t lines < <(grep -E "^(PASS|FAIL)  " "$RESULTS/$1.log" 2>/dev/null || true)
  SUMMARY+=("${lines[@]}")
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  stages: ${STAGES//,/ }"
  echo "python: $PY"
  "$PY" -c 'import torch, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "gpus", torch.cuda.device_count()); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU visible")' || true
  "$PY" -c 'import ray; print("ray", ray.__version__)' 2>&1 | tail -n 1
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
  nvcc --version 2>/dev/null | tail -n 2 || true
  echo "cpus: $(nproc)"
} >"$RESULTS/env.txt" 2>&1
cat "$RESULTS/env.txt"

export MAX_JOBS=${MAX_JOBS:-$(nproc)} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
want build && step build 120 env DPPO_FORCE_CUDA=1 "$PY" setup.py build_ext --inplace
"$PY" -m dppo.build_info >>"$RESULTS/env.txt" 2>&1 || true

if want tests; then
  # Every test file that carries the cuda marker (collecting the whole tree would import packages that GPU images
  # may lack, and the CPU suite is CI's).
  mapfile -t CUDA_TESTS < <(grep -rlE "pytest\.mark\.cuda|mark\.cuda\b" tests --include='test_*.py' | sort)
  step tests 120 "$PY" -m pytest -m cuda -q -p no:cacheprovider -rs --continue-on-collection-errors \
    --junitxml="$RESULTS/tests.xml" "${CUDA_TESTS[@]}"
fi

# SnapshotPool.save/restore of a ~1 GiB model (and a few sizes) against verl v1's per-parameter pageable copies,
# preallocated pinned per-parameter copies and one large pinned copy (the ceiling). Target: >= 0.9x the ceiling.
want snapshot && step snapshot 60 "$PY" benchmarks/snapshot_bench.py --repeats 3 --out "$RESULTS/snapshot_bench.json"

# The actor plain and FSDP2 over one rank (NCCL), two global steps, verify_old_log_prob on; with several GPUs also
# FSDP2 over all of them as Ray actors.
if want fsdp; then
  NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 1)
  step fsdp 60 "$PY" benchmarks/fsdp_cycle.py --device cuda --world-size "$NGPU" --out "$RESULTS/fsdp_cycle.json" &&
    verdicts fsdp
fi

# The demo as a user runs it here: `dppo train` with its defaults (on a GPU machine that is Ray, the actor's rank on
# the GPU, one rollout worker on the CPU), its metrics and summary kept.
if want train; then
  step train 90 "$PY" -m dppo train trainer.output_dir="$RESULTS/train_run" trainer.progress_bar=false
  cp "$RESULTS/train_run/summary.json" "$RESULTS/train_summary.json" 2>/dev/null || true
  cp "$RESULTS/train_run/metrics.jsonl" "$RESULTS/train_metrics.jsonl" 2>/dev/null || true
  rm -rf "$RESULTS/train_run"  # checkpoints and the model: too large to bring back, and not needed
fi

# Whole sync cycles of the real trainer step, bf16 Qwen2-style models of 0.4B and 1.2B parameters with host slots,
# parameter_sync_step 1/2/4/8, every pi_old mode; an fp32 model of each size for the old-log-prob check. The JSON
# is rewritten after each size, so a timeout still leaves the sizes that finished.
want cycle && step cycle 150 "$PY" benchmarks/cycle_bench.py --gpu --repeats 2 --out "$RESULTS/cycle_bench.json" &&
  verdicts cycle

{
  echo "gpu_check summary ($(($(date +%s) - START)) s total), results in $RESULTS"
  printf '%s\n' "${SUMMARY[@]}"
  grep -hE "^[0-9]+ (passed|failed)|passed|failed|error" "$RESULTS/tests.log" 2>/dev/null | tail -n 1 || true
  grep -hE "x pinned ceiling|verified" "$RESULTS/snapshot.log" 2>/dev/null || true
} | tee "$RESULTS/summary.final.txt"
mv "$RESULTS/summary.final.txt" "$RESULTS/summary.txt"
pack
[[ -n ${OUT:-} && -d ${OUT:-} ]] && cp "$RESULTS/summary.txt" "$OUT/summary.txt"
exit $FAILED
