"""Build hook: generate the gRPC stubs from protos/*.proto before packaging (also for -e)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        import sys

        root = Path(__file__).resolve().parent
        sys.path.insert(0, str(root))
        from protos.codegen import generate

        generate(root)
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
