"""Makes this machine's Python look like the lent GPU machine's, for tests/test_device.py (put this folder first on
PYTHONPATH; Python imports ``sitecustomize`` at start-up).

The lent machine (an H200 machine lent without the GPU stack, package list read 2026-11-17) has torch and transformers
but no vLLM, OpenRLHF, DeepSpeed, Ray, flash-attn, fastapi ... A package counts as present when it is in that list, is a
dependency of one in the list (by this machine's metadata: the list leaves some out, e.g. pyparsing's users' own needs),
is named in ``$LENT_GPU_CARRIED`` (comma-separated import names: the wheels gpu_smoke_lent.sh carries), or belongs to
this project. vllm, deepspeed and flash_attn are found only in benchmarks/lent_gpu_machine/gpu_shim (through any folder
or link on the path), never this machine's real packages. Everything else is "not found": the path finder returns no
spec, so ``import`` raises ModuleNotFoundError and ``importlib.util.find_spec`` returns None, as there. The real vllm /
deepspeed / flash-attn distributions are also hidden from ``importlib.metadata``, since on the lent machine they have no
dist-info. ``$LENT_GPU_LOG``: a file to which every refused name is appended.
"""

import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import re
import sys

LENT_GPU_DISTS = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
STAND_INS = {"vllm", "deepspeed", "flash_attn"}  # ../gpu_shim: no dist-info there
SHIM_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "gpu_shim") + os.sep
# This machine's torch 2.13 imports optree from torch._dynamo without declaring it; the lent machine's own torch 2.11
# works with what its image holds, so torch's undeclared needs count as present.
TORCH_INTERNALS = {"optree"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _present_import_names() -> set:
    by_name = {}
    for d in importlib.metadata.distributions():
        by_name.setdefault(_norm(d.metadata["Name"] or ""), d)
    todo, seen = [_norm(n) for n in LENT_GPU_DISTS], set()
    while todo:  # the listed distributions and, transitively, what they require (extras left out)
        n = todo.pop()
        if n in seen or n not in by_name:
            continue
        seen.add(n)
        for req in by_name[n].requires or []:
            if "extra ==" not in req:
                todo.append(_norm(re.split(r"[ ;<>=!~\[(]", req.strip(), 1)[0]))
    names = set()
    for n in seen:
        d = by_name[n]
        top = d.read_text("top_level.txt")
        if top:
            names.update(t.strip() for t in top.split() if t.strip())
        for f in d.files or []:
            parts = str(f).split("/")
            if parts[0].endswith((".dist-info", ".data")) or parts[0] == "..":
                continue
            names.add(parts[0][:-3] if parts[0].endswith(".py") else parts[0].split(".")[0])
    return names


CARRIED = {n for n in os.environ.get("LENT_GPU_CARRIED", "").split(",") if n}
PRESENT = _present_import_names() | TORCH_INTERNALS | CARRIED | {
    "openrlhf_search", "retriever", "tests", "benchmarks", "sitecustomize"}


class _LentGpuFinder(importlib.abc.MetaPathFinder):
    """Wraps the path finder: a package that is not on the lent machine is not found."""

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in STAND_INS:  # only the stand-in, wherever it is linked from
            spec = self.inner.find_spec(name, path, target)
            where = (spec.origin or next(iter(spec.submodule_search_locations or []), "")) if spec else ""
            return spec if spec and SHIM_ROOT in os.path.realpath(where) else None
        if top in sys.stdlib_module_names or top in PRESENT or top.startswith("_"):
            return self.inner.find_spec(name, path, target)
        if os.environ.get("LENT_GPU_LOG"):
            with open(os.environ["LENT_GPU_LOG"], "a") as fh:
                fh.write(top + "\n")
        return None

    def find_distributions(self, *args, **kwargs):
        for d in self.inner.find_distributions(*args, **kwargs):
            if _norm(d.metadata["Name"] or "") not in STAND_INS:
                yield d

    def invalidate_caches(self):
        return self.inner.invalidate_caches()


sys.meta_path[:] = [_LentGpuFinder(f) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
