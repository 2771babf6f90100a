"""Regenerate the Python gRPC stubs from protos/ (`make protos` or `python -m specd.protos`)."""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent.parent / "protos"
PROTO_FILES = ("specd_api/v1/controller.proto",)


def generate(out_dir: Path) -> None:
    """Write controller_pb2.py, controller_pb2.pyi and controller_pb2_grpc.py under out_dir/specd_api/v1."""
    from grpc_tools import protoc

    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *(str(PROTO_ROOT / f) for f in PROTO_FILES)]  # fmt: skip
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILES}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT.parent)
