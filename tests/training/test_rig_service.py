"""The rig's loop in one process (no process group): orders, state versions, rollback, progress lines,
and a rig that stops by itself once its daemon is gone. The multi-process rig: tests/gonka_node/
test_host_rig.py."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from rig_kit import serving
from safetensors.torch import save_file

from training.codecs import get_codec
from training.data import Windows
from training.inner import InnerConfig
from training.model import ModelConfig, build_model
from training.rig import Rig
from training.rig_service import Mailbox, ReplicatedWorker, RoundOrder, StateVersions
from training.worker import Assignment, DiLoCoWorker

pytestmark = pytest.mark.usefixtures("one_thread")
CFG = ModelConfig.preset("tiny")


def worker(rig: Rig | None = None) -> DiLoCoWorker:
    windows = Windows(np.random.RandomState(0).randint(0, 256, size=20_000).astype(np.uint8), seq_len=16)
    inner = InnerConfig(steps=2, lr=1e-2, warmup_steps=1, total_steps=20, micro_batch=2, seq_len=16)
    return DiLoCoWorker(build_model(CFG, 0), inner, get_codec("int8"), windows, Assignment(3, 0, 2), rig=rig)


def _served() -> tuple[Rig, ReplicatedWorker]:
    rig = Rig.single("cpu")
    return rig, ReplicatedWorker(worker(rig), rig)


def wait_for(what: str, ready: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_orders_versions_and_a_rollback_give_one_process_payloads(tmp_path: Path) -> None:
    global_path = tmp_path / "global.safetensors"
    save_file({n: p.detach() for n, p in build_model(CFG, 7).named_parameters()}, str(global_path))
    params = {n: p.detach().clone() for n, p in build_model(CFG, 7).named_parameters()}
    alone = worker()
    want = [alone.train_round(r, params).payload for r in (1, 2)]

    mailbox, versions = Mailbox(tmp_path / "mailbox"), StateVersions(tmp_path / "state")
    with serving(mailbox, versions, *_served()) as thread:
        for seq, (round_, base) in enumerate([(1, 0), (2, 1), (2, 1), (1, 0)], start=1):
            mailbox.post(RoundOrder(seq, round_, str(global_path), base))
            wait_for(f"report {seq}", lambda s=seq: mailbox.report(s) is not None)
            report = mailbox.report(seq)
            assert report is not None and (report.round, report.base) == (round_, base)
            assert mailbox.payload_path(seq).read_bytes() == want[round_ - 1], seq  # rolled back: the same bytes
            steps, offset = mailbox.progress(seq, 0)
            assert [s for s, _ in steps] == [1, 2] and offset == mailbox.progress_path(seq).stat().st_size
            assert report.ranks[0]["held_bytes"]["optimizer"] == 2 * report.ranks[0]["held_bytes"]["parameters"]
        assert sorted(p.name for p in versions.root.iterdir()) == ["after-1"]  # base 0 kept nothing else
        assert mailbox.pid(0) is not None
    assert not thread.is_alive()  # the daemon is gone: the loop ended by itself


def test_an_order_keeps_the_previous_base_so_an_overlapped_host_rolls_back_two_versions(tmp_path: Path) -> None:
    """An overlapped top-k host whose round r − 1 is refused trains round r again from the state before
    r − 1, the base of the order before (`keep`): rounds 1-3, round 3 again from version 1, round 4,
    round 4 again from version 1 (a second refusal in a row); each payload is a lone worker's."""
    global_path = tmp_path / "global.safetensors"
    save_file({n: p.detach() for n, p in build_model(CFG, 7).named_parameters()}, str(global_path))
    params = {n: p.detach().clone() for n, p in build_model(CFG, 7).named_parameters()}
    alone = worker()
    want = [alone.train_round(1, params).payload]
    after_1 = copy.deepcopy(alone.state_dict())
    want += [alone.train_round(r, params).payload for r in (2, 3)]
    alone.load_state_dict(copy.deepcopy(after_1))
    want += [alone.train_round(r, params).payload for r in (3, 4)]
    alone.load_state_dict(copy.deepcopy(after_1))
    want.append(alone.train_round(4, params).payload)

    mailbox, versions = Mailbox(tmp_path / "mailbox"), StateVersions(tmp_path / "state")
    with serving(mailbox, versions, *_served()) as thread:
        orders = [(1, 0, None), (2, 1, 0), (3, 2, 1), (3, 1, 2), (4, 3, 1), (4, 1, 3)]
        for seq, (round_, base, keep) in enumerate(orders, start=1):
            mailbox.post(RoundOrder(seq, round_, str(global_path), base, keep=keep))
            wait_for(f"report {seq}", lambda s=seq: mailbox.report(s) is not None or not thread.is_alive())
            assert mailbox.report(seq) is not None, f"the rig stopped at order {seq}"  # a version it deleted
            assert mailbox.payload_path(seq).read_bytes() == want[seq - 1], seq
        # bounded: the base, the kept one and the version just saved
        assert sorted(p.name for p in versions.root.iterdir()) == ["after-1", "after-3", "after-4"]


def test_progress_lines_are_read_whole_and_a_restarted_file_is_read_again(tmp_path: Path) -> None:
    mailbox = Mailbox(tmp_path)
    path = mailbox.progress_path(4)
    path.write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "lo')
    steps, offset = mailbox.progress(4, 0)
    assert steps == [(1, 5.5)]
    path.write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "loss": 5.25}\n')
    assert mailbox.progress(4, offset) == ([(2, 5.25)], path.stat().st_size)
    path.write_text('{"step": 1, "loss": 4.0}\n')  # a retried round starts its file again
    assert mailbox.progress(4, path.stat().st_size + 10)[0] == [(1, 4.0)]
    assert mailbox.progress(5, 0) == ([], 0)


def test_a_missing_or_foreign_version_is_refused_with_the_fix(tmp_path: Path) -> None:
    versions, rig = StateVersions(tmp_path), Rig.single("cpu")
    with pytest.raises(FileNotFoundError, match="after-3 is missing: the rig's state after round 3"):
        versions.load(3, rig)
    versions.save(3, {"x": torch.ones(2)}, rig)
    assert torch.equal(versions.load(3, rig)["x"], torch.ones(2))
    (tmp_path / "after-3" / "rig.json").write_text('{"world_size": 4}')
    with pytest.raises(ValueError, match="a rig of 4 processes; this rig has 1: run with --gpus 4"):
        versions.load(3, rig)
