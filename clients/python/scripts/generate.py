"""Regenerates tinybroker/_pb/ from the repository's proto/ directory.

Run it with grpcio-tools 1.80.1 installed (its bundled protoc 31.1 writes
code that protobuf >= 6.31.1 and grpcio >= 1.80.1 load, the floor that
still supports Python 3.9); no protoc on the PATH is needed:

    python -m pip install grpcio-tools==1.80.1
    python clients/python/scripts/generate.py

CI runs it and fails when `git diff --exit-code clients/python` shows a
difference. The generated modules import each other package-relatively
(`from . import broker_pb2`), so the package needs nothing on sys.path.
"""

import pathlib
import re
import shutil
import sys
import tempfile

GRPCIO_TOOLS = "1.80.1"

HERE = pathlib.Path(__file__).resolve().parent
PACKAGE = HERE.parent / "tinybroker" / "_pb"
PROTO_ROOT = HERE.parent.parent.parent / "proto"
PROTOS = ["tinybroker/v1/broker.proto", "tinybroker/v1/admin.proto"]


def main() -> int:
    import grpc_tools
    from grpc_tools import protoc

    version = getattr(grpc_tools, "__version__", None)
    try:
        from importlib.metadata import version as dist_version

        version = dist_version("grpcio-tools")
    except Exception:
        pass
    if version != GRPCIO_TOOLS:
        print(f"generate.py wants grpcio-tools=={GRPCIO_TOOLS}, found {version}", file=sys.stderr)
        return 2
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as out:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *PROTOS,
        ]
        if protoc.main(args) != 0:
            print("protoc failed", file=sys.stderr)
            return 1
        generated = pathlib.Path(out) / "tinybroker" / "v1"
        for old in PACKAGE.glob("*_pb2*"):
            old.unlink()
        for path in sorted(generated.iterdir()):
            text = path.read_text()
            # Package-relative imports between the generated modules.
            text = re.sub(r"^from tinybroker\.v1 import ", "from . import ", text, flags=re.M)
            (PACKAGE / path.name).write_text(text)
    (PACKAGE / "__init__.py").write_text(
        '"""Code generated from proto/tinybroker/v1 by scripts/generate.py; do not edit."""\n'
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
