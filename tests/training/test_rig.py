import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.checkpoint import load_checkpoint
from training.inner import InnerConfig
from training.model import ModelConfig
from training.rig import Rig, RigJob, is_rank0, launch_local, main, train

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]


def _job(out: Path, grad_accum: int) -> RigJob:
    inner = InnerConfig(
        steps=3, lr=3e-3, warmup_steps=1, total_steps=10, micro_batch=2, grad_accum=grad_accum, seq_len=32
    )
    return RigJob(
        model=ModelConfig.preset("tiny"), inner=inner, corpus_max_bytes=200_000, eval_windows=4, out=str(out)
    )


def _params(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path).tensors


def test_single_process_rig_helpers() -> None:
    rig = Rig.single("cpu")
    assert rig.is_rank0 and not rig.distributed and is_rank0()
    assert list(rig.shard([1, 2, 3])) == [1, 2, 3]  # type: ignore[list-item]
    assert rig.broadcast_object({"round": 4}) == {"round": 4}
    assert Rig(1, 3, torch.device("cpu")).shard(range(8)).__next__() == 1  # type: ignore[arg-type]
    assert list(Rig(1, 3, torch.device("cpu")).shard(range(8))) == [1, 4, 7]  # type: ignore[arg-type]


def test_grad_accum_must_split_evenly_over_the_rig(tmp_path: Path) -> None:
    job = _job(tmp_path / "x.safetensors", grad_accum=3)
    with pytest.raises(
        ValueError, match=r"grad_accum \(3\) must be a multiple of the rig's process count \(2\)"
    ):
        train(Rig(0, 2, torch.device("cpu")), job)


@pytest.mark.slow  # ~15 s alone, more on a loaded machine: it starts two Python processes
@pytest.mark.multiprocess
def test_two_processes_train_the_same_model_as_one(tmp_path: Path) -> None:
    # Same global batch either way: 1 process takes every micro-batch, 2 processes take every other one.
    jobs_two = [_job(tmp_path / "two_a2.safetensors", 2), _job(tmp_path / "two_a4.safetensors", 4)]
    launch_local(2, jobs_two, tmp_path / "rendezvous")
    one_a2 = train(Rig.single("cpu"), _job(tmp_path / "one_a2.safetensors", 2))
    train(Rig.single("cpu"), _job(tmp_path / "one_a4.safetensors", 4))

    # grad_accum == processes: each process backpropagates one micro-batch per step, and the all-reduce
    # sums the same two gradients the single process accumulates; float addition is commutative: exact.
    two, one = _params(tmp_path / "two_a2.safetensors"), _params(tmp_path / "one_a2.safetensors")
    for name in one:
        assert torch.equal(two[name], one[name]), name
    assert load_checkpoint(tmp_path / "two_a2.safetensors").sha256 == one_a2.checkpoint_sha256

    # grad_accum 4 on 2 processes sums (g0+g2)+(g1+g3) where one process sums ((g0+g1)+g2)+g3: float
    # addition is not associative, so gradients differ in the last bits. Adam divides by sqrt(v), which
    # can blow a last-bit difference of a near-zero gradient up to ~lr, so bound the whole tensor tightly
    # and single elements loosely: a missing or doubled micro-batch moves parameters by ~lr = 3e-3.
    two, one = _params(tmp_path / "two_a4.safetensors"), _params(tmp_path / "one_a4.safetensors")
    for name in one:
        assert (two[name] - one[name]).norm() <= 1e-5 * one[name].norm(), name
        assert (two[name] - one[name]).abs().max() < 1e-4, name


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchrun_launches_the_rig_entry_point(tmp_path: Path) -> None:
    args = ["--preset", "tiny", "--steps", "3", "--micro-batch", "2", "--grad-accum", "2", "--seq-len", "32"]
    args += ["--log-every", "1", "--out", str(tmp_path / "rig.safetensors")]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*command, "-m", "training.rig", *args], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 2 and len(report["losses"]) == 3
    assert done.stdout.count("step ") == 3  # rank 0 alone prints

    assert main([*args[:-1], str(tmp_path / "alone.safetensors"), "--log-every", "0"]) == 0
    assert load_checkpoint(tmp_path / "alone.safetensors").sha256 == report["checkpoint_sha256"]
