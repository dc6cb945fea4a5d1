"""Stand-in for the vLLM 0.29.0 names the CPU main job imports (see ../README.md); used by gpu_smoke_lent.sh only when
the real vLLM cannot be imported."""

from vllm.sampling_params import SamplingParams

__version__ = "0.29.0+gpu-smoke-shim"
IS_GPU_SMOKE_SHIM = True

__all__ = ["SamplingParams"]
