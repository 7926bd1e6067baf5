#!/usr/bin/env bash
# The checks that need CUDA, for a machine with one (or more) NVIDIA GPUs: the
# integrity tags and the receiver's checks on buckets in GPU memory, the GPU
# transport tests (ipc on one device; collective over NCCL with two), the
# collective-group tests, and the transport benchmark (collective runs NCCL
# there). Everything else runs on CPUs in `make test`.
#
# Sized for a lent GPU machine's short lease: each step has its own time limit
# (under 9 minutes in all: 60 s of set-up, then 60 + 180 + 80 + 140 s), and the
# script ends with one table: what ran, whether it passed, and its seconds.
# Usage: scripts/gpu_check.sh (from the repository root).
# GPU_CHECK_PYTHON picks the interpreter (default: .venv's, else python3, for a
# machine whose image already holds torch, vLLM and Ray and cannot install).
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi finds none); run it on a GPU machine" >&2
  exit 2
fi
if [ -z "${GPU_CHECK_PYTHON:-}" ]; then
  if timeout 60 scripts/setup_env.sh main; then  # installs the CUDA build of vLLM where a registry is reachable
    GPU_CHECK_PYTHON=.venv/bin/python
  else
    echo "gpu_check: could not set up .venv; using python3 as it is" >&2
    GPU_CHECK_PYTHON=python3
  fi
fi
py=$GPU_CHECK_PYTHON

rows=()
step() {  # step NAME LIMIT_S COMMAND...: run it under its limit and keep a row of the table
  local name=$1 limit=$2; shift 2
  local start=$SECONDS outcome
  if timeout "$limit" "$@"; then outcome=passed; else
    case $? in 124) outcome="timed out (${limit} s)" ;; *) outcome=failed ;; esac
  fi
  rows+=("$(printf '%-44s %-18s %6d' "$name" "$outcome" $((SECONDS - start)))")
}

step "integrity tags on GPU buffers" 60 "$py" -m pytest -q -rs tests/transport/test_integrity_cuda.py
step "GPU transports (ipc, NCCL collective)" 180 "$py" -m pytest -q -rs tests/sync/test_gpu_transports.py
step "collective group (NCCL where CUDA is)" 80 "$py" -m pytest -q -rs tests/transport/test_collective.py
step "transport benchmark (ray vs collective)" 140 "$py" -m benchmarks.bench_transport --repeats 3

printf '\n%-44s %-18s %6s\n' "check" "outcome" "seconds"
printf '%s\n' "${rows[@]}"
! printf '%s\n' "${rows[@]}" | grep -qv " passed "
