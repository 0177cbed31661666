"""A stand-in for the GPU machine's Python environment on this CPU machine, to check wheel lists.

Makes a bare virtual environment whose site-packages links, from the interpreter running this
script (the project's `.venv`), only: the packages the GPU image has (docs/backends/verl.md,
"GPU check", names them; their dependencies follow from the installed metadata; pydantic is
left out, as the image lacks it), the packages the probe's verified run proves the image has,
and the distributions of the wheel lists given. Anything else the check imports then fails here
as it would there. Versions and the Python version (3.11, not 3.12) are this machine's.

    .venv/bin/python bench/gpu/image_env.py /tmp/image-env
    DEVICE=cpu STEPS=2 PYTHON=/tmp/image-env/bin/python SITE=/nonexistent PYTHONPATH=$PWD \
        bash bench/gpu/run_gpu_check.sh preflight test bench countdown
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
# What the image carries (docs/backends/verl.md, "GPU check").
IMAGE = ["torch", "transformers", "tokenizers", "accelerate", "peft", "safetensors", "numpy"]
IMAGE += ["pandas", "pyarrow", "pip", "setuptools"]
NOT_ON_IMAGE = {"pydantic", "pydantic-core", "annotated-types", "typing-inspection"}
# Imported by the probe's verified run (`import verl`, verl's engine workers) and absent from
# wheels-verl.txt: the image has them.
PROVEN = ["xxhash", "pillow", "msgpack", "protobuf", "requests", "urllib3", "attrs", "cloudpickle"]


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> set[str]:
    """`roots` and every distribution they require (no extras), as installed here."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = normalise(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def pinned(path: Path) -> list[str]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    return [line.split("==")[0] for line in lines if line and not line.startswith("#")]


def link(allowed: set[str], site: Path) -> list[str]:
    """Link every top-level file of each allowed distribution into `site`; the names linked."""
    linked = []
    for dist in md.distributions():
        name = normalise(dist.metadata["Name"])
        base = Path(str(dist.locate_file("")))
        if name not in allowed or dist.files is None or "site-packages" not in str(base):
            continue
        tops = {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}
        for top in tops:
            source, target = base / top, site / top
            if source.exists() and not target.is_symlink() and not target.exists():
                target.symlink_to(source)
        linked.append(name)
    return linked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path, help="the environment to make (must not exist)")
    parser.add_argument(
        "--wheels",
        type=Path,
        nargs="*",
        default=[ROOT / "bench/gpu/wheels-verl.txt", ROOT / "bench/gpu/wheels-unified.txt"],
        help="pin lists whose distributions the environment also gets",
    )
    args = parser.parse_args()
    if args.directory.exists():
        parser.error(f"{args.directory} exists; pass a new directory")
    allowed = (closure(IMAGE) - NOT_ON_IMAGE) | set(map(normalise, PROVEN)) | {"unified"}
    for pins in args.wheels:
        allowed |= set(map(normalise, pinned(pins)))
    python = f"python{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", args.directory], check=True)
    # A venv made from a venv points at the base interpreter: the same version as this one.
    site = args.directory / "lib" / python / "site-packages"
    linked = link(allowed, site)
    absent = sorted(allowed - set(linked))
    print(f"{args.directory}: {len(linked)} distributions; not installed here: {absent or 'none'}")


if __name__ == "__main__":
    main()
