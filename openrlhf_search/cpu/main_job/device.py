"""Where the CPU main job's tensors live: ``--train.device auto|cpu|cuda``.

The policy, its reference, the critic, the frozen-trunk states, every batch, advantage and loss tensor live on one
device; the engine samples on the policy's device (it reads ``next(model.parameters()).device``) and draws its
random numbers on the host, so a run's rollouts do not depend on the device's RNG. The retriever's query encoder
(dense indexes) gets the same device through ``retriever.server --device``. Checkpoints are plain HF folders and
``torch.save`` files read back with ``map_location="cpu"``, so a GPU run resumes on a CPU and the other way round.
"""

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


class DeviceError(ValueError):
    """The requested device is not usable here; the message says why and what to use instead."""


def resolve_device(requested: str) -> str:
    """The device string a run uses for ``--train.device requested``.

    Args:
        requested: ``"cpu"``, ``"cuda"`` (the current CUDA device) or ``"auto"`` (``"cuda"`` when
            ``torch.cuda.is_available()``, else ``"cpu"``).
    Returns:
        ``"cpu"`` or ``"cuda"``.
    Raises:
        DeviceError: ``"cuda"`` without a usable CUDA device, or an unknown name.
    """
    if requested not in DEVICE_CHOICES:
        raise DeviceError(f"--train.device must be one of {', '.join(DEVICE_CHOICES)}, got {requested!r}")
    if requested == "cpu":
        return "cpu"
    available = torch.cuda.is_available()
    if requested == "auto":
        return "cuda" if available else "cpu"
    if not available:
        built = torch.version.cuda
        why = f"this torch ({torch.__version__}) was built without CUDA" if built is None else \
            f"torch {torch.__version__} (CUDA {built}) sees no CUDA device"
        raise DeviceError(f"--train.device cuda: {why}; use --train.device cpu, or auto to take a GPU only when "
                          "there is one")
    return "cuda"


def model_device(model) -> torch.device:
    """The device of a module's parameters (the first one; the job keeps a model on one device)."""
    return next(model.parameters()).device


def describe_device(device: str) -> str:
    """One line naming the device for the logs, e.g. ``cuda:0 (NVIDIA H200, 139.8 GiB)`` or ``cpu (16 threads)``."""
    d = torch.device(device)
    if d.type == "cuda":
        index = d.index if d.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return f"cuda:{index} ({props.name}, {props.total_memory / 2 ** 30:.1f} GiB)"
    return f"cpu ({torch.get_num_threads()} threads)"
