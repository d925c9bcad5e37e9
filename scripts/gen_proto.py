"""Generate the committed Python code for `proto/gonka/v1/*.proto` (and check it is fresh).

    .venv/bin/python scripts/gen_proto.py          # regenerate in place
    .venv/bin/python scripts/gen_proto.py --check  # regenerate into a temp dir and compare (CI)

Compiled from the repository root with `-I.` so that the proto paths mirror the package paths: the
generated `aggregator_pb2_grpc.py` then imports `proto.gonka.v1.aggregator_pb2` rather than a
top-level `aggregator_pb2` that only resolves when `proto/gonka/v1` happens to be on sys.path.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path("proto/gonka/v1")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted((ROOT / PROTO_DIR).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Compile every .proto into `out_root` (mirroring proto/gonka/v1/); returns the files written."""
    (out_root / PROTO_DIR).mkdir(parents=True, exist_ok=True)
    well_known = str(resources.files("grpc_tools") / "_proto")
    sources = [str(p.relative_to(ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        "-I.",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *sources,
    ]
    # protoc resolves -I. against the working directory, so run it from the repository root.
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        rc = protoc.main(args)
    finally:
        os.chdir(cwd)
    if rc != 0:
        raise SystemExit(f"protoc failed with status {rc}")
    return sorted(p for p in (out_root / PROTO_DIR).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def committed_files() -> list[Path]:
    return sorted(p for p in (ROOT / PROTO_DIR).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def check() -> int:
    """0 when the committed generated files equal a fresh generation, else 1 with a list of differences."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p for p in generate(Path(tmp))}
        have = {p.name: p for p in committed_files()}
        problems = [f"missing: {PROTO_DIR / n}" for n in sorted(fresh.keys() - have.keys())]
        problems += [f"stale extra file: {PROTO_DIR / n}" for n in sorted(have.keys() - fresh.keys())]
        problems += [
            f"out of date: {PROTO_DIR / n}"
            for n in sorted(fresh.keys() & have.keys())
            if not filecmp.cmp(fresh[n], have[n], shallow=False)
        ]
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print("run: .venv/bin/python scripts/gen_proto.py", file=sys.stderr)
        return 1
    print(f"generated protobuf code is fresh ({len(fresh)} files)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="compare against a fresh generation; write nothing"
    )
    args = parser.parse_args(argv)
    if args.check:
        return check()
    for stale in committed_files():
        stale.unlink()
    written = generate(ROOT)
    print("\n".join(str(p.relative_to(ROOT)) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
