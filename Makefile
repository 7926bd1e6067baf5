# The two commands of the README: `make demo` and `make test`. Each installs
# what it needs first (scripts/setup_env.sh is idempotent and fast when
# nothing changed).
PY := .venv/bin/python
export TOKENIZERS_PARALLELISM ?= false

.PHONY: env demo test bench fixtures

env:
	@scripts/setup_env.sh main

demo: env
	$(PY) -m examples.demo

test: env
	$(PY) -m ruff check .
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests

bench: env
	$(PY) -m benchmarks.bench_alternatives
	$(PY) -m benchmarks.bench_delta
	$(PY) -m benchmarks.bench_quantizer
	$(PY) -m benchmarks.bench_sync
	$(PY) -m benchmarks.bench_sharded
	$(PY) -m benchmarks.bench_transport

# Regenerates the committed model fixtures: trains the tiny models in the main
# venv, then quantizes them with the real llmcompressor in its own venv.
fixtures: env
	@scripts/setup_env.sh llmc
	$(PY) -m fixtures.make_models
	.venv-llmc/bin/python -m fixtures.quantize_with_llmcompressor
	$(PY) -m fixtures.tokenizer
