#!/usr/bin/env bash
# The checks that need CUDA, for a machine with one (or more) NVIDIA GPUs:
# the GPU transport tests (ipc on one device; collective over NCCL with two)
# and the transport benchmark (collective runs NCCL there). Everything else
# runs on CPUs in `make test`. Usage: scripts/gpu_check.sh (from the repository root).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi finds none); run it on a GPU machine" >&2
  exit 2
fi
scripts/setup_env.sh main  # installs the CUDA build of vLLM on a GPU machine
.venv/bin/python -m pytest -q -rs tests/sync/test_gpu_transports.py tests/transport/test_collective.py
.venv/bin/python -m benchmarks.bench_transport --repeats 3
