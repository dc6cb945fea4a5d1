"""The CPU cluster mode: OpenRLHF 0.11.2's ``train_ppo_ray`` on CPU actors (``CPU_CLUSTER=1``).

- :mod:`.runtime`: the patches, settings, worker setup hook and private Ray of the mode.
- :mod:`.assets`: the tiny policy, tokenizer, data and BM25 index it runs on, built once and cached.
- :mod:`.probe`: records of what ran inside the actors (weights after a sync, executor records), for tests and
  ``benchmarks/bench_cluster_cpu.py``.
"""
