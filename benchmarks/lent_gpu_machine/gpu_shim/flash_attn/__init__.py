"""Stand-in for flash-attn on the lent GPU machine (see ../README.md): OpenRLHF's ring-attention helpers import
these names at module level; the CPU main job never calls them, and calling one raises."""

__version__ = "0.0.0+gpu-smoke-shim"


def _missing(name):
    def fn(*args, **kwargs):
        raise RuntimeError(f"flash_attn.{name}: flash-attn is not installed here (lent_gpu_machine/gpu_shim stand-in)")

    fn.__name__ = name
    return fn
