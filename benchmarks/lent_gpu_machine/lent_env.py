"""Helpers of ``gpu_smoke_lent.sh``: which carried wheels and stand-ins a machine without the GPU stack needs.

Run with the machine's own Python (``python3`` on such a machine, ``.venv/bin/python`` here)::

    python benchmarks/lent_gpu_machine/lent_env.py wheels DIR...   # carried wheels it lacks, one path a line
    python benchmarks/lent_gpu_machine/lent_env.py stand-ins        # vllm / deepspeed / flash_attn it cannot import

The figures of a run come from ``benchmarks/gpu_smoke_report.py``, as for ``benchmarks/gpu_smoke.sh``.

Only the standard library and ``packaging`` are imported at module level, so it runs before anything is installed.
"""

import argparse
import importlib.metadata
import importlib.util
import os
import re
import sys
from typing import Dict, List

# gpu_shim/ beside this file provides these when the real package cannot be imported (gpu_shim/README.md).
STAND_IN_MODULES = ("vllm", "deepspeed", "flash_attn")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_name_version(path: str) -> tuple:
    """(normalised distribution name, version) from a wheel file name (PEP 427: ``name-version-...whl``)."""
    parts = os.path.basename(path).split("-")
    if len(parts) < 5 or not path.endswith(".whl"):
        raise ValueError(f"not a wheel file name: {path}")
    return _norm(parts[0]), parts[1]


def wheels_to_install(paths: List[str]) -> List[str]:
    """The wheels among ``paths`` whose distribution this Python lacks, or has at an older version.

    A newer or equal installed version wins (the machine's own packages are never downgraded); two wheels of one
    distribution are an error, as pip would refuse them.

    Raises:
        ValueError: a file name that is not a wheel's, or one distribution twice.
    """
    from packaging.version import Version

    seen: Dict[str, str] = {}
    out = []
    for path in sorted(paths):
        name, version = wheel_name_version(path)
        if name in seen:
            raise ValueError(f"two wheels of {name}: {seen[name]} and {path}")
        seen[name] = path
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out.append(path)
            continue
        if Version(have) < Version(version):
            out.append(path)
    return out


def stand_ins_needed(modules=STAND_IN_MODULES) -> List[str]:
    """The modules of ``modules`` this Python cannot find (their stand-ins go on ``PYTHONPATH``)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wheels", help="print the carried wheels this machine lacks")
    w.add_argument("dirs", nargs="*")
    sub.add_parser("stand-ins", help="print the stand-in modules this machine needs")
    a = p.parse_args(argv)
    if a.cmd == "wheels":
        paths = [os.path.join(d, f) for d in a.dirs if os.path.isdir(d) for f in os.listdir(d) if f.endswith(".whl")]
        for path in wheels_to_install(paths):
            print(path)
    else:
        for name in stand_ins_needed():
            print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
