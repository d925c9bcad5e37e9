"""FSDP2 inside a rig (gloo on CPU): sharded state, and payloads byte for byte one process's.

Two processes, a FileStore rendezvous (no ports). With grad_accum == processes each process
backpropagates one micro-batch per step; FSDP2's reduce-scatter adds the same two gradients a single
process accumulates, the clip's norm rounds to the same fp32 number (`clip_grad_norm`), AdamW is
elementwise, and the payload parts are independent per tensor: the payload equals `DiLoCoWorker`'s
bit for bit, over rounds and across a save / reset / load of the sharded state. With more micro-batches
than processes the gradient sums associate differently: the stated tolerance is a relative L2
difference of the decoded pseudo-gradient below 1e-4 (measured ~2e-6; the aggregator's replay check
accepts 1e-4 in norm).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch import nn

from training.codecs import get_codec, round_seed, spec_of
from training.data import Windows
from training.inner import InnerConfig, RoundState, clip_grad_norm
from training.model import Llama, ModelConfig, build_model
from training.residual_commit import ChunkLayout, residual_root, zero_root
from training.rig import Rig
from training.rig_moves import OrderReplaced, RigMove
from training.rig_service import ReplicatedWorker
from training.sharded import (
    ShardedWorker,
    ShardLayout,
    ShardOptions,
    balanced_owners,
    held_bytes,
    shard_model,
)
from training.streaming import StreamSchedule
from training.worker import Assignment, DiLoCoWorker, Rebase, Shifted

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = ModelConfig.preset("tiny")
ASSIGNMENT = Assignment(epoch_seed=7, slot=1, max_slots=4)
CODEC = "topk:chunk=64,k=8,bits=2"  # per-chunk selection: a part must see its whole tensor


def windows() -> Windows:
    rng = np.random.RandomState(0)
    return Windows(rng.randint(0, 256, size=40_000).astype(np.uint8), seq_len=16, heldout_fraction=0.1)


def inner(grad_accum: int, round_state: RoundState = "carry") -> InnerConfig:
    # lr 3e-2 with clip 0.05: the clip binds on every step, so its coefficient is part of the check.
    return InnerConfig(steps=3, lr=3e-2, warmup_steps=1, total_steps=30, micro_batch=2, grad_accum=grad_accum,
                       seq_len=16, grad_clip=0.05, round_state=round_state)


def _rig_process(rank: int, world_size: int, store: str, out: Path) -> None:
    torch.set_num_threads(1)
    rig = Rig.from_store(dist.FileStore(store, world_size), rank, world_size)
    try:
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,))
        results: dict[str, object] = {}
        for accum, codec, state in ((2, CODEC, "carry"), (4, "fp32", "carry"), (2, CODEC, "fresh")):
            model = shard_model(Llama(CFG, device="meta"), mesh, ShardOptions()).to_empty(device="cpu")
            worker = ShardedWorker(model, inner(accum, state), get_codec(codec), windows(), ASSIGNMENT, rig,
                                   ef_decay=0.9)
            worker.reset()
            for r in (1,) if accum == 4 else (1, 2, 3):
                name = f"{accum}-{r}" if state == "carry" else f"fresh-{r}"
                figures = worker.run_round(r, out / f"global-{r}.safetensors", out / f"payload-{name}.bin")
                results[f"root-{name}"] = figures.residual_root.hex()  # rank 0's joins every owner's leaves
                if r == 2:  # what a restarted rig does: reload this process's share from a file
                    torch.save(worker.state_dict(), out / f"state-{rank}.pt")
                    results[f"inner-{state}"] = sorted(worker.state_dict()["inner"])
                    worker.reset()
                    worker.load_state_dict(torch.load(out / f"state-{rank}.pt", weights_only=True))
            results[f"residual-{accum}"] = sorted(worker.feedback.residual)
            results[f"held-{accum}"] = worker.held_bytes()
        results.update(_streamed_rounds(rig, mesh, out))
        # an eager round's moves partway (training.rig_moves): onto a target, then by a shift given with one
        model = shard_model(Llama(CFG, device="meta"), mesh, ShardOptions()).to_empty(device="cpu")
        moving = ShardedWorker(model, inner(2), get_codec(CODEC), windows(), ASSIGNMENT, rig, ef_decay=0.9)
        moving.reset()
        target, shift = out / "move-target.safetensors", out / "move-shift.safetensors"
        for r, move in ((1, RigMove(1, target, out / "absent.safetensors", lambda: False)),
                        (2, RigMove(2, target, shift, lambda: False))):
            moving.run_round(r, out / f"global-{r}.safetensors", out / f"payload-move-{r}.bin", moves=[move])
        # a move the daemon gave up (another order posted): every process leaves the round at it, none in a
        # collective, and the rig takes its next order
        with pytest.raises(OrderReplaced):
            moving.run_round(3, out / "global-3.safetensors", out / "payload-given-up.bin",
                             moves=[RigMove(1, out / "never.safetensors", out / "never-shift.safetensors", lambda: True)])
        results["after-give-up"] = moving.run_round(3, out / "global-3.safetensors", out / "payload-move-3.bin").round
        torch.save(results, out / f"rank-{rank}.pt")
    finally:
        rig.close()


STREAM = StreamSchedule.plan(spec_of(dict(Llama(CFG, device="meta").named_parameters())), 3, mix=0.5, first_round=1)
SKIPPED = {4: (3,)}  # round 4 lands nothing: the chain skipped round 3


def _streamed_rounds(rig: Rig, mesh: torch.distributed.device_mesh.DeviceMesh, out: Path) -> dict[str, object]:
    """A streamed epoch's rounds 1-4 on a sharded and on a replicated rig, the state saved, reset and
    reloaded after round 2 (a restarted rig); rank 0's roots."""
    model = shard_model(Llama(CFG, device="meta"), mesh, ShardOptions()).to_empty(device="cpu")
    sharded = ShardedWorker(model, inner(2), get_codec(CODEC), windows(), ASSIGNMENT, rig, ef_decay=0.9,
                            stream=STREAM, overlap="off")
    replicated = ReplicatedWorker(DiLoCoWorker(build_model(CFG, 0), inner(2), get_codec(CODEC), windows(), ASSIGNMENT,
                                               ef_decay=0.9, rig=rig), rig, STREAM, "off")
    results: dict[str, object] = {}
    for kind, worker in (("sharded", sharded), ("replicated", replicated)):
        worker.reset()
        for r in (1, 2, 3, 4):
            figures = worker.run_round(r, out / f"global-{r}.safetensors", out / f"payload-stream-{kind}-{r}.bin",
                                       None, SKIPPED.get(r, ()))
            results[f"stream-root-{kind}-{r}"] = figures.residual_root.hex()
            if r == 2:
                torch.save(worker.state_dict(), out / f"stream-{kind}-{rig.rank}.pt")
                worker.reset()
                with torch.no_grad():  # a restarted process holds no trained model: the state's must come back
                    for p in (model if kind == "sharded" else replicated.worker.model).parameters():
                        p.zero_()
                worker.load_state_dict(torch.load(out / f"stream-{kind}-{rig.rank}.pt", weights_only=True))
    return results


@pytest.mark.slow  # two spawned processes: ~20-30 s on a loaded 2-core machine
@pytest.mark.multiprocess
def test_sharded_rig_sends_one_process_payloads_and_holds_half_the_state(tmp_path: Path) -> None:
    for r in (1, 2, 3, 4):  # a different global model each round, as the daemon hands it over
        params = {n: p.detach() for n, p in build_model(CFG, 10 + r).named_parameters()}
        save_file(params, str(tmp_path / f"global-{r}.safetensors"))
    target = {n: p.detach() for n, p in build_model(CFG, 30).named_parameters()}
    save_file(target, str(tmp_path / "move-target.safetensors"))
    save_file({n: (t * 0.01).contiguous() for n, t in target.items()}, str(tmp_path / "move-shift.safetensors"))
    mp.spawn(_rig_process, args=(2, str(tmp_path / "store"), tmp_path), nprocs=2, join=True)

    alone = DiLoCoWorker(build_model(CFG, 0), inner(2), get_codec(CODEC), windows(), ASSIGNMENT, ef_decay=0.9)
    roots: list[str] = []
    for r in (1, 2, 3):
        want = alone.train_round(r, _load(tmp_path / f"global-{r}.safetensors"))
        assert (tmp_path / f"payload-2-{r}.bin").read_bytes() == want.payload, f"round {r}"
        roots.append(want.residual_root.hex())
        assert want.residual_root == residual_root(alone.feedback.residual, ChunkLayout.of(spec_of(alone.feedback.residual)))

    ranks = [torch.load(tmp_path / f"rank-{k}.pt", weights_only=True) for k in (0, 1)]
    # A fresh epoch's saved share holds no AdamW rows (every round restarts them), and the rig resumed
    # from it sends one fresh process's payloads, round 3 included.
    fresh = DiLoCoWorker(build_model(CFG, 0), inner(2, "fresh"), get_codec(CODEC), windows(), ASSIGNMENT,
                         ef_decay=0.9)
    for r in (1, 2, 3):
        want = fresh.train_round(r, _load(tmp_path / f"global-{r}.safetensors"))
        assert (tmp_path / f"payload-fresh-{r}.bin").read_bytes() == want.payload, f"fresh round {r}"
    assert [x["inner-fresh"] for x in ranks] == [["step"]] * 2 and ranks[0]["inner-carry"] == ["optimizer", "step"]
    # The rig's root (rank 0, from the two owners' leaves) is the one-process worker's, round by round;
    # the other process reports none. fp32 loses nothing: its residual is zero, and so its root.
    assert [ranks[0][f"root-2-{r}"] for r in (1, 2, 3)] == roots and len(set(roots)) == 3
    assert ranks[1]["root-2-1"] == ""
    assert ranks[0]["root-4-1"] == zero_root(ChunkLayout.of(spec_of(alone.feedback.residual))).hex()
    owned = [set(x["residual-2"]) for x in ranks]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(alone.feedback.residual)
    assert min(len(o) for o in owned) >= 9  # 21 tensors split about evenly: nobody holds all of Δ
    replicated = sum(held_bytes(alone.model, alone.trainer.optimizer).values())
    for x in ranks:
        assert sum(x["held-2"].values()) <= 0.55 * replicated  # half, plus FSDP's uneven last rows

    # Four micro-batches on two processes: (g0+g2)+(g1+g3) against ((g0+g1)+g2)+g3.
    # A streamed epoch: each round's fragment alone, from the rig's own model (its rows, on a sharded rig),
    # landing with the mix, after a restart and past a skipped round: one process's payloads and roots.
    streamed = DiLoCoWorker(build_model(CFG, 0), inner(2), get_codec(CODEC), windows(), ASSIGNMENT, ef_decay=0.9)
    for r in (1, 2, 3, 4):
        want = streamed.network_stream_round(STREAM, r, _load(tmp_path / f"global-{r}.safetensors"), r - 1,
                                             SKIPPED.get(r, ()), root=True)
        assert len(want.payload) < 0.5 * len((tmp_path / "payload-2-1.bin").read_bytes())  # a third of the model
        for kind in ("sharded", "replicated"):
            assert (tmp_path / f"payload-stream-{kind}-{r}.bin").read_bytes() == want.payload, f"{kind} round {r}"
            assert ranks[0][f"stream-root-{kind}-{r}"] == want.residual_root.hex(), f"{kind} round {r}"

    # Moves partway: row by row, the one-process round's payloads (the shift given is added as it is).
    target, shift = _load(tmp_path / "move-target.safetensors"), _load(tmp_path / "move-shift.safetensors")
    moving = DiLoCoWorker(build_model(CFG, 0), inner(2), get_codec(CODEC), windows(), ASSIGNMENT, ef_decay=0.9)
    for r, rebase in ((1, Rebase(1, lambda: target)), (2, Rebase(2, lambda: Shifted(target, shift)))):
        want = moving.train_round(r, _load(tmp_path / f"global-{r}.safetensors"), rebases=[rebase])
        assert (tmp_path / f"payload-move-{r}.bin").read_bytes() == want.payload, f"moved round {r}"
    assert [x["after-give-up"] for x in ranks] == [3, 3] and not (tmp_path / "payload-given-up.bin").exists()

    four = DiLoCoWorker(build_model(CFG, 0), inner(4), get_codec("fp32"), windows(), ASSIGNMENT, ef_decay=0.9)
    want = four.train_round(1, _load(tmp_path / "global-1.safetensors")).payload
    spec = {n: tuple(p.shape) for n, p in four.model.named_parameters()}
    codec = get_codec("fp32").for_round(round_seed(ASSIGNMENT.epoch_seed, 1))
    a, b = codec.decode(want, spec), codec.decode((tmp_path / "payload-4-1.bin").read_bytes(), spec)
    diff = math.sqrt(sum(float((a[n] - b[n]).double().square().sum()) for n in a))
    norm = math.sqrt(sum(float(a[n].double().square().sum()) for n in a))
    assert 0 < diff < 1e-4 * norm


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_layout_follows_fsdp2s_row_split_and_balances_owners() -> None:
    layout = ShardLayout({"a": (5, 2), "b": (3,), "c": (8, 8)}, rank=3, world_size=4)
    assert [(t.start, t.stop, t.chunk) for t in layout.tensors.values()] == [(5, 5, 2), (3, 3, 1), (6, 8, 2)]
    rows = [ShardLayout({"a": (5, 2)}, rank=k, world_size=4).tensors["a"] for k in range(4)]
    assert [(t.start, t.stop) for t in rows] == [(0, 2), (2, 4), (4, 5), (5, 5)]  # torch.chunk's split
    owners = balanced_owners({"big": (100,), "m1": (60,), "m2": (50,), "s": (10,)}, 2)
    assert owners == {"big": 0, "m1": 1, "m2": 1, "s": 0}  # loads 110 and 110


def test_clip_norm_does_not_depend_on_how_gradients_are_split() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(257, 33) * 3, torch.randn(1000) * 0.01, torch.randn(7, 5)]

    def params(tensors: list[torch.Tensor]) -> list[nn.Parameter]:
        out = []
        for t in tensors:
            p = nn.Parameter(torch.zeros_like(t))
            p.grad = t.clone()
            out.append(p)
        return out

    whole = params(grads)
    pieces = params([half for g in grads for half in g.reshape(-1).tensor_split(2)])  # what 2 shards hold
    reference = params(grads)
    norm = clip_grad_norm(whole, 1.0)
    assert float(norm) > 1.0  # the clip binds
    assert torch.equal(clip_grad_norm(pieces, 1.0), norm)
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in whole]), torch.cat([p.grad for p in pieces]))
    torch_norm = torch.nn.utils.clip_grad_norm_(reference, 1.0)
    assert float(norm) == pytest.approx(float(torch_norm), rel=1e-6)  # torch's formula, fp64 sum
    for mine, theirs in zip(whole, reference, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=0)
