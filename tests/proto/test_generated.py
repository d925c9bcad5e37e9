"""The committed generated protobuf code is fresh and importable under the `proto.` package path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh() -> None:
    run = subprocess.run(
        [sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr


def test_grpc_modules_import_their_siblings_through_the_package() -> None:
    # The _pb2_grpc trap: compiled without -I. these would say `import aggregator_pb2`.
    for name in ("aggregator", "checkpoints", "shard"):
        text = (ROOT / "proto/gonka/v1" / f"{name}_pb2_grpc.py").read_text()
        assert f"from proto.gonka.v1 import {name}_pb2" in text
    from proto.gonka.v1 import aggregator_pb2, aggregator_pb2_grpc, checkpoints_pb2_grpc

    assert aggregator_pb2.DESCRIPTOR.package == "gonka.v1"
    assert hasattr(aggregator_pb2_grpc, "AggregatorServicer")
    assert hasattr(checkpoints_pb2_grpc, "CheckpointsServicer")


def test_every_service_is_in_package_gonka_v1() -> None:
    from proto.gonka.v1 import aggregator_pb2, checkpoints_pb2, shard_pb2

    names = {
        s.full_name
        for m in (aggregator_pb2, checkpoints_pb2, shard_pb2)
        for s in m.DESCRIPTOR.services_by_name.values()
    }
    assert names == {"gonka.v1.Aggregator", "gonka.v1.Checkpoints", "gonka.v1.Shard"}
