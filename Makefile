# Newcomer commands (see README.md). Everything runs on CPU, offline.
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-slow bench

setup:            ## create .venv with the real stack (OpenRLHF 0.11.2, vLLM 0.29.0, CPU torch)
	bash scripts/setup_cpu_env.sh

demo: setup       ## the main job on the embedded default: index, retriever, 30 RL steps with search, eval before and after
	bash examples/scripts/run_default.sh

test: setup       ## the linter (ruff, settings in pyproject.toml), then the CPU test suite (slow tests excluded)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

test-slow: setup  ## only the slow tests
	$(PY) -m pytest -q -m slow

bench: setup      ## benchmark scripts (print figures)
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done
