"""Generate the Python gRPC stubs of proto/ddtree/v1/*.proto into services/protocol/.

Usage: python -m scripts.gen_proto [OUT_DIR]   (default: services/protocol)

The generated modules import each other as `ddtree.v1.x_pb2`; they are rewritten to import
`ddtree.protocol.ddtree.v1.x_pb2` so the stubs live inside our package. tests/test_proto_stubs.py
regenerates into a temporary folder and fails when the committed stubs differ.
"""

from __future__ import annotations

import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
DEFAULT_OUT = REPO / "services" / "protocol"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    import grpc_tools
    from grpc_tools import protoc  # only needed at generation time

    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.glob("ddtree/v1/*.proto"))
    include = str(pathlib.Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = sorted((out_dir / "ddtree" / "v1").glob("*_pb2*.py"))
    for path in written:
        text = path.read_text()
        text = re.sub(r"^from ddtree\.v1 import", "from ddtree.protocol.ddtree.v1 import", text, flags=re.M)
        path.write_text(text)
    for pkg in (out_dir / "ddtree", out_dir / "ddtree" / "v1"):
        (pkg / "__init__.py").write_text("")
    return written


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    for p in generate(out):
        print(p.relative_to(out))
