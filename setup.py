"""Build steps pyproject.toml cannot express: protobuf stubs and the Cython core.

Generated code is produced here from protos/ and batcher/*.pyx and never
committed. The stubs land in services/proto/ so that
``from services.proto.berth.v1 import berth_pb2`` works in an editable
install and in a wheel alike.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "services"))

from protogen import generate  # noqa: E402  (services/protogen.py, no deps)


class BuildPyWithProtos(build_py):
    """build_py that first generates the gRPC stubs from protos/."""

    def run(self) -> None:
        generate(ROOT / "protos", ROOT / "services" / "proto")
        super().run()


def extensions() -> list[Extension]:
    from Cython.Build import cythonize

    return cythonize(
        [
            Extension(
                "batcher._core_c", ["batcher/_core_c.pyx"], extra_compile_args=["-O3"]
            )
        ],
        compiler_directives={"language_level": "3"},
        quiet=True,
    )


setup(
    cmdclass={"build_py": BuildPyWithProtos},
    ext_modules=[] if os.environ.get("BERTH_NO_CYTHON") else extensions(),
)
