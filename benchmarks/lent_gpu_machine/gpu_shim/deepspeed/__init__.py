"""Stand-in for DeepSpeed on the lent GPU machine (see ../README.md): OpenRLHF imports it at module level; the CPU
main job never calls it. Any attribute access raises."""


def __getattr__(name):
    raise AttributeError(f"deepspeed.{name}: DeepSpeed is not installed here (lent_gpu_machine/gpu_shim stand-in)")
