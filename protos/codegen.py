"""Generate the protobuf/gRPC stubs from ``protos/pipeshard_v1.proto`` (never committed).

Run at build/install time by ``setup.py`` (grpcio-tools is a build requirement), or by hand:
``python -m protos.codegen``. The stubs import as ``protos.pipeshard_v1_pb2`` and
``protos.pipeshard_v1_pb2_grpc``.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO = "protos/pipeshard_v1.proto"


def generate(root: Path) -> None:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` beside the proto under ``root``."""
    from importlib.resources import files

    from grpc_tools import protoc

    include = str(files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{include}",
        f"--python_out={root}",
        f"--pyi_out={root}",
        f"--grpc_python_out={root}",
        str(root / PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {root / PROTO}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
