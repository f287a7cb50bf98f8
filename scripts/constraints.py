"""Write constraints.txt: the exact version of every package a CPU install takes.

pip resolves, as for an empty environment and without installing anything,
everything `make venv` installs: pip and setuptools themselves, the torch
given on the command line (the Makefile passes its TORCH_CPU), berth's build
requirements, its dependencies and its dev extra. Every package picked is
pinned with ``==``; a local version label (torch's ``+cpu``) is dropped, so
that the CPU build and the default CUDA build of that torch both satisfy the
pin. Wheels only a CUDA build of torch pulls (``nvidia-*``, ``cuda-*``,
``triton``) are left out: CI and the image install the CPU build.

    python scripts/constraints.py torch==2.13.0   # what `make constraints` runs

Run it with the interpreter CI and the image use (Python 3.11): environment
markers are evaluated for the interpreter that runs it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "constraints.txt"
CUDA_ONLY = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")
SEPARATORS = re.compile(r"[-_.]+")
HEADER = """\
# Exact versions of every package a CPU install of berth resolves to (pip,
# setuptools, the CPU torch, the build requirements, the dependencies and the
# dev extra). Every install uses it: the Makefile and the Dockerfile pass it
# as -c (constraints) and --build-constraint (what builds berth: grpcio-tools
# decides the generated stubs). CUDA-only wheels (nvidia-*, cuda-*, triton)
# are not pinned: CI and the image take the CPU build of torch.
#
# Regenerate (re-resolves from nothing: the newest releases the floors in
# pyproject.toml allow), then run `make test`:
#     make constraints
# which runs, in a new venv of python3 (3.11, as CI and the image) with the
# newest pip:
#     python scripts/constraints.py torch==2.13.0
"""


def requirements(extra: list[str]) -> list[str]:
    """What `make venv` installs, as pip requirement strings."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [
        "pip",
        "setuptools",
        *extra,
        *project["build-system"]["requires"],
        *project["project"]["dependencies"],
        *project["project"]["optional-dependencies"]["dev"],
    ]


def resolve(reqs: list[str]) -> dict[str, str]:
    """name -> version of everything pip would install for reqs from nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [
                *(sys.executable, "-m", "pip", "install", "--dry-run"),
                *("--ignore-installed", "--quiet", "--report", str(report)),
                *reqs,
            ],
            check=True,
        )
        installs = json.loads(report.read_text())["install"]
    return {
        # The normalized name (PEP 503); the version without a local label.
        SEPARATORS.sub("-", item["metadata"]["name"]).lower(): item["metadata"][
            "version"
        ].split("+")[0]
        for item in installs
    }


def render(pins: dict[str, str]) -> str:
    return HEADER + "\n" + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("torch", nargs="*", help="the torch to pin, as torch==X.Y.Z")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    resolved = resolve(requirements(args.torch))
    pins = {n: v for n, v in resolved.items() if not CUDA_ONLY.match(n)}
    args.output.write_text(render(pins))
    print(f"wrote {len(pins)} pins to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
