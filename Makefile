# Newcomer commands (see README.md). Everything runs on CPU, offline.
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-slow test-guard bench

# The slow tests that guard the cluster path's hardest promises: a killed retriever, a relaunch after a killed launcher
# or a killed save, Ray Serve, eval.sh's two retrievers, the eval CLI's released prompts, two launchers' dry runs as
# subprocesses. CI runs them after `make test`; `make test-slow` runs every slow test.
GUARD := \
  tests/test_cpu_cluster_e2e.py::test_killed_retriever_samples_are_left_out_and_training_goes_on \
  tests/test_cpu_cluster_e2e.py::test_too_many_retrieval_failures_stop_the_run_with_one_clear_line \
  tests/test_cpu_cluster_relaunch.py \
  tests/retriever/test_ray_serve.py::test_cli_serves_and_stops_cleanly \
  tests/retriever/test_ray_launch.py \
  tests/test_parity.py::test_eval_sh_starts_both_retrievers_and_routes_each_set \
  tests/test_paper_prompts.py::test_eval_cli_writes_the_released_prompts \
  'tests/test_launchers.py::test_every_launcher_dry_run_subprocess[r1searcher_llama8b_instruct_stage1.sh]' \
  'tests/test_launchers.py::test_every_launcher_dry_run_subprocess[searchr1_ppo_qwen2.5-7b_base.sh]'

setup:            ## create .venv with the real stack (OpenRLHF 0.11.2, vLLM 0.29.0, CPU torch)
	bash scripts/setup_cpu_env.sh

demo: setup       ## the main job on the embedded default: index, retriever, 30 RL steps with search, eval before and after
	bash examples/scripts/run_default.sh

test: setup       ## the linter (ruff, settings in pyproject.toml), then the CPU test suite (slow tests excluded)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

test-slow: setup  ## only the slow tests
	$(PY) -m pytest -q -m slow

test-guard: setup ## the slow tests that guard the cluster path (GUARD above), what CI runs after `make test`
	$(PY) -m pytest -q -m slow $(GUARD)

bench: setup      ## benchmark scripts (print figures)
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done
