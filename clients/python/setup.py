"""The client's build step pyproject.toml cannot express: its gRPC stubs.

berth_client/_proto/ is generated here, at build time, from berth's protos/
(generate_stubs.py) and never committed, as berth's own stubs are. The
protos are found in ``$BERTH_PROTOS`` when set, else in the berth checkout
this folder sits in (``../../protos``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from generate_stubs import generate  # noqa: E402  (grpcio-tools only)


def protos() -> Path:
    """Where berth's .proto files are (SystemExit naming both places when
    neither has them)."""
    configured = os.environ.get("BERTH_PROTOS")
    found = Path(configured) if configured else HERE.parent.parent / "protos"
    if not (found / "berth" / "v1" / "berth.proto").is_file():
        raise SystemExit(
            f"berth-client: no berth/v1/berth.proto under {found}: build it from "
            "a berth checkout (clients/python) or set BERTH_PROTOS to its protos/"
        )
    return found


class BuildPyWithStubs(build_py):
    """build_py that writes the stubs into the build, beside the sources."""

    def run(self) -> None:
        super().run()
        generate(Path(self.build_lib) / "berth_client" / "_proto", protos())


setup(cmdclass={"build_py": BuildPyWithStubs})
