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

# Each benchmark prints its table and, with --write-docs, writes it into its
# block of docs/performance.md (benchmarks/_docs_table.py), header included.
bench: env
	$(PY) -m benchmarks.bench_alternatives --write-docs
	$(PY) -m benchmarks.bench_delta --write-docs
	$(PY) -m benchmarks.bench_quantizer --write-docs
	$(PY) -m benchmarks.bench_sync --write-docs
	$(PY) -m benchmarks.bench_sharded --write-docs
	$(PY) -m benchmarks.bench_transport --write-docs
	$(PY) -m benchmarks.bench_latency --write-docs

# Regenerates the committed model fixtures: trains the tiny models in the main
# venv, then quantizes them with the real llmcompressor in its own venv.
fixtures: env
	@scripts/setup_env.sh llmc
	$(PY) -m fixtures.make_models
	$(PY) -m fixtures.mtp_model
	.venv-llmc/bin/python -m fixtures.quantize_with_llmcompressor
	$(PY) -m fixtures.tokenizer
