"""Generate the Python gRPC stubs of proto/ddtree/v1/*.proto into services/protocol/.

Usage: python -m scripts.data.gen_proto [OUT_DIR]   (default: services/protocol)

The generated modules import each other as `ddtree.v1.x_pb2`; they are rewritten to import
`ddtree.protocol.ddtree.v1.x_pb2` so the stubs live inside our package. tests/deploy/test_proto_stubs.py
regenerates into a temporary folder and fails when the committed stubs differ.
"""

from __future__ import annotations

import argparse
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.data.gen_proto", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=pathlib.Path, default=DEFAULT_OUT, help="default: services/protocol")
    out = parser.parse_args(argv).out
    for path in generate(out):
        print(path.relative_to(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
