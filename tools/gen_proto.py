"""Regenerate k3serve's own gRPC stubs from proto/ (needs grpcio-tools, a dev dependency).

    python tools/gen_proto.py           # writes server/pd/bootstrap_pb2.py and _pb2_grpc.py
    python tools/gen_proto.py --out D   # writes them under D instead (the drift test)
"""
from __future__ import annotations

import argparse
import pathlib
import shutil
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ["k3serve/server/pd/bootstrap.proto"]


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    """Generate every proto's stubs into ``out`` (flat: the files' base names); returns them."""
    import grpc_tools
    from grpc_tools import protoc

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for proto in PROTOS:
            rc = protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={tmp}",
                              f"--grpc_python_out={tmp}", str(ROOT / "proto" / proto)])
            if rc != 0:
                raise RuntimeError(f"protoc failed on {proto} ({rc})")
            stem = pathlib.Path(proto).with_suffix("")
            for suffix in ("_pb2.py", "_pb2_grpc.py"):
                src = pathlib.Path(tmp) / f"{stem}{suffix}"
                dst = out / src.name
                shutil.copyfile(src, dst)
                written.append(dst)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "server" / "pd")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for p in generate(args.out):
        print(p)


if __name__ == "__main__":
    main()
