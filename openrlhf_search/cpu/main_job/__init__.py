"""The CPU main job: one process that trains and evaluates a small LLM with search on CPU (``make demo``).

CPU twins of the GPU-only pieces behind the same interfaces: :mod:`.engine` (``HFEngine``, the token-in/token-out
``generate`` of OpenRLHF's vLLM rollout actor over a ``transformers`` model) and :mod:`.trainer` (the RL loop that a
DeepSpeed actor runs on a cluster), with the cluster core's executor, rewards, advantages and masked losses inside.
Entry point: ``python -m openrlhf_search.cpu.main_job.train`` (:mod:`.train`).
"""
