"""The CPU cluster mode: OpenRLHF 0.11.2's ``train_ppo_ray`` on CPU actors (``CPU_CLUSTER=1``).

- :mod:`.runtime`: the patches, settings, worker setup hook, recording hook (``OPENRLHF_SEARCH_PROBE_MODULE``) and
  private Ray of the mode.
"""
