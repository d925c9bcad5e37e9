"""`gonka-node run --gpus N`: a rig that lives for the epoch (torchrun, gloo on CPU here).

`RigRounds` starts one torchrun job whose 2 processes keep the model and the state between rounds;
with grad_accum == processes each process backpropagates one micro-batch per step and the reductions
add the same two gradients a single process accumulates, so every payload is byte for byte the
one-process payload — sharded (FSDP2) or replicated — and so is the aggregator's replay of it. A rig
process killed mid-round is restarted by torchrun's agent; the rig reloads the round's base state
from disk and sends the same payload. A refused round rolls back to the previous state version.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sysconfig
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rig_kit import serving
from safetensors.torch import save_file
from test_host_node import World

from gonka_node.core.client import AggregatorClient
from gonka_node.core.recipe import Recipe
from gonka_node.host.node import HostNode, HostSettings
from gonka_node.host.rig_process import build_rig_worker
from gonka_node.host.rig_round import (
    LocalRounds,
    RigError,
    RigOptions,
    RigRounds,
    RigSetup,
    check_rig_size,
    host_rounds,
    make_worker,
)
from gonka_node.host.store import HostStore, Progress
from training.codecs import get_codec, round_seed, spec_of
from training.model import ModelConfig, build_model
from training.residual_commit import ChunkLayout, residual_root
from training.rig import Rig
from training.rig_service import Mailbox, StateVersions
from training.worker import Assignment, Rebase, Shifted, commitment_root, replay_round

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_recipe(tmp: Path, grad_accum: int = 2, **fields: object) -> Recipe:
    corpus = tmp / "corpus.txt"
    corpus.write_bytes((Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_bytes())
    settings: dict[str, object] = dict(
        model=ModelConfig.preset("tiny"), corpus=str(corpus), seq_len=32, micro_batch=2, grad_accum=grad_accum,
        inner_steps=4, inner_lr=3e-3, warmup_steps=1, n_rounds=3, codec="int8",
    )
    return Recipe(**{**settings, **fields}).with_data_manifest()  # type: ignore[arg-type]


def global_models(recipe: Recipe, tmp: Path) -> list[tuple[dict[str, torch.Tensor], Path]]:
    """A different global model for each of rounds 1-3, in memory and as the daemon's file."""
    out = []
    for r in (1, 2, 3):
        params = {n: p.detach().clone() for n, p in build_model(recipe.model, recipe.init_seed + r).named_parameters()}
        save_file(params, str(tmp / f"global-{r}.safetensors"))
        out.append((params, tmp / f"global-{r}.safetensors"))
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def wait_gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow  # two rig starts (one a restart after a kill): ~40 s on a loaded 2-core machine
@pytest.mark.multiprocess
def test_a_sharded_rig_sends_one_process_payloads_and_survives_a_killed_process(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, inner_steps=30, round_state="fresh")  # fresh: the replay check applies
    assignment = Assignment(recipe.epoch_seed, slot=1, max_slots=4)
    cache = tmp_path / "cache"
    models = global_models(recipe, tmp_path)
    alone = LocalRounds(make_worker(recipe, assignment, cache))
    rig = RigRounds(RigOptions(2, "sharded"), recipe, assignment, cache, tmp_path / "rig")
    old = tmp_path / "rig" / "run-0ld" / "mailbox"  # a crashed daemon's run: its models go, its log stays
    old.mkdir(parents=True)
    for name in ("move-3-0.safetensors", "payload-3.bin", "order.json"):
        (old / name).write_bytes(b"x")
    (old.parent / "rig.log").write_text("an earlier rig")
    rig.start()
    assert sorted(p.name for p in old.iterdir()) == ["order.json"] and (old.parent / "rig.log").exists()
    try:
        steps: list[int] = []
        killed: list[int] = []

        def kill_rank1_at_step_2(step: int, loss: float) -> None:
            steps.append(step)
            if step == 2 and not killed:
                assert rig.mailbox is not None
                pid = rig.mailbox.pid(1)
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

        payloads, roots = [], []
        for r, (params, path) in enumerate(models, start=1):
            want = alone.train_round(r, params, lambda p=path: p, lambda s, loss: None)
            hook = kill_rank1_at_step_2 if r == 2 else (lambda s, loss: None)
            got = rig.train_round(r, params, lambda p=path: p, hook)
            assert got.payload == want.payload, f"round {r}"
            assert got.last_loss == want.last_loss and got.tokens == want.tokens
            # from the report; the one-process host hashes its residual where it saves the round (None here)
            assert want.residual_root is None
            ef = alone.worker.feedback
            assert got.residual_root == commitment_root(ef.residual, spec_of(params), ef.codec)
            payloads.append(got.payload)
            roots.append(got.residual_root)
            if r == 2:  # rank 1 died after step 2; the restarted rig trained the round again from step 1
                assert steps[:2] == [1, 2] and steps[-30:] == list(range(1, 31)) and len(steps) >= 32
                assert rig.mailbox is not None and rig.mailbox.pid(1) not in (None, killed[0])
        # The sharded rig's round is the one the aggregator replays in one process, bit for bit.
        replayed = replay_round(build_model(recipe.model, 0), recipe.inner_config(), recipe.windows(cache),
                                assignment, 1, models[0][0])
        codec = get_codec(recipe.codec).for_round(round_seed(recipe.epoch_seed, 1))
        assert codec.encode(replayed) == payloads[0]  # round 1 has no error-feedback residual yet

        # A refused round 3 leaves no trace: the rig goes back to the state after round 2 (from disk,
        # its memory holds round 3's) and trains round 3 into the very same payload again.
        rig.load_state_dict({"rig": {"base": 2, "procs": 2}})
        params, path = models[2]
        again = rig.train_round(3, params, lambda: path, lambda s, loss: None)
        assert again.payload == payloads[2]
        assert sorted(p.name for p in (tmp_path / "rig" / "state").iterdir()) == ["after-2", "after-3"]
        # What a challenge of round 3 opens: e_2 and e_3 from the union of the processes' state files, each
        # holding the residuals of the tensors it owns: the one-process host's, under the roots signed.
        previous, current = rig.residuals()
        layout = ChunkLayout.of({n: tuple(t.shape) for n, t in params.items()})
        assert (residual_root(previous, layout), residual_root(current, layout)) == (roots[1], roots[2])
        for mine, theirs in zip(rig.residuals(), alone.residuals(), strict=True):
            assert mine.keys() == theirs.keys() == params.keys()
            assert all(torch.equal(mine[n], theirs[n]) for n in params)
        # Stopped without waiting (the agent is killed, as after a stall): the restarted processes,
        # each in a session of its own, go with it instead of living on as orphans.
        assert rig.mailbox is not None
        ranks = [rig.mailbox.pid(rank) for rank in (0, 1)]
        rig.close(timeout_s=0.0)
        assert all(pid is not None and wait_gone(pid) for pid in ranks)
    finally:
        rig.close()
    assert rig.proc is None


def test_rig_size_must_split_the_recipes_batch(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, grad_accum=2)
    check_rig_size(recipe, 1)
    check_rig_size(recipe, 2)
    with pytest.raises(RigError, match=r"--gpus 3: .* 2 micro-batches per step, .* divisor of 2"):
        check_rig_size(recipe, 3)
    with pytest.raises(RigError, match="at least one process"):
        RigOptions(0)
    with pytest.raises(RigError, match=r"--shard 'zero': choose one of auto, replicated, sharded"):
        RigOptions(2, "zero")


def test_saved_state_of_another_rig_size_is_refused_with_the_fix(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path)
    assignment = Assignment(recipe.epoch_seed, slot=0, max_slots=2)
    rig = RigRounds(RigOptions(2), recipe, assignment, None, tmp_path / "rig")  # never started
    with pytest.raises(RigError, match="belongs to a rig of 4 processes; run with --gpus 4"):
        rig.load_state_dict({"rig": {"base": 3, "procs": 4}})
    with pytest.raises(RigError, match=r"belongs to a one-process host .* run with --gpus 1"):
        rig.load_state_dict(make_worker(recipe, assignment, None).state_dict())
    rig.load_state_dict({"rig": {"base": 3, "procs": 2}})
    assert rig.state_dict() == {"rig": {"base": 3, "procs": 2}}
    local = LocalRounds(make_worker(recipe, assignment, None))
    with pytest.raises(RigError, match="run with --gpus 2"):
        local.load_state_dict(rig.state_dict())
    with pytest.raises(RigError, match="not started"):
        rig.train_round(1, {}, lambda: tmp_path, lambda s, loss: None)
    assert not (tmp_path / "rig").exists()  # nothing launched, nothing written


@contextlib.contextmanager
def served_rig(recipe: Recipe, assignment: Assignment, tmp: Path, keep_previous: bool = False) -> Iterator[RigRounds]:
    """The daemon's `RigRounds` over a one-process rig whose loop runs in this process on its mailbox (a
    `sleep` stands for the torchrun agent), the worker built as `gonka-node run --gpus` builds it."""
    rounds = RigRounds(RigOptions(1, stall_s=20.0), recipe, assignment, None, tmp / "rig", keep_previous=keep_previous)
    rounds.mailbox = Mailbox(tmp / "mailbox")
    rounds.proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    setup = RigSetup(recipe.to_dict(), assignment.epoch_seed, assignment.slot, assignment.max_slots, None, "replicated",
                     False, False, str(rounds.mailbox.root), str(tmp / "rig" / "state"), os.getpid())
    rig = Rig.single("cpu")
    worker, mode = build_rig_worker(setup, rig)
    assert mode == "replicated"
    try:
        with serving(rounds.mailbox, StateVersions(tmp / "rig" / "state"), rig, worker):
            yield rounds
    finally:
        rounds.close(timeout_s=0.0)


def test_a_rig_keeps_the_state_an_overlapped_top_k_host_rolls_back_to(tmp_path: Path) -> None:
    """Rounds 1-3, then round 2 refused: the daemon goes back to the state before round 2 (version 1,
    the base of the order before the last) and trains round 3 again; the rig still has it. The rig's
    loop runs in this process on the daemon's mailbox (a `sleep` stands for the torchrun agent)."""
    recipe = tiny_recipe(tmp_path, grad_accum=1, round_state="fresh", codec="topk:chunk=4096,k=128,bits=2")
    assignment = Assignment(recipe.epoch_seed, slot=0, max_slots=2)
    params, path = global_models(recipe, tmp_path)[0]
    alone = make_worker(recipe, assignment, None)
    alone.train_round(1, params)
    want = alone.train_round(3, params).payload  # round 3 from the state after round 1
    with served_rig(recipe, assignment, tmp_path, keep_previous=True) as rounds:
        for r in (1, 2, 3):
            rounds.train_round(r, params, lambda: path, lambda s, loss: None)
        rounds.load_state_dict({"rig": {"base": 1, "procs": 1}})  # round 2 refused: the state before it
        assert rounds.train_round(3, params, lambda: path, lambda s, loss: None).payload == want
        assert sorted(p.name for p in (tmp_path / "rig" / "state").iterdir()) == ["after-1", "after-2", "after-3"]


def test_a_rig_trains_a_streamed_epoch_as_one_process_does_past_a_skipped_round_and_a_rollback(tmp_path: Path) -> None:
    """A streamed epoch (two fragments, delayed, mix 0.5) on a rig built as `gonka-node run --gpus` builds
    it: each round's fragment payload and residual root are the one-process host's, round 4 landing
    nothing of round 2, which the chain skipped (the order carries it), and a refused round 5 trained
    again from the rig's version after round 4, its own model included, sends the same payload."""
    recipe = tiny_recipe(tmp_path, grad_accum=1, round_state="carry", stream_fragments=2, stream_mix=0.5,
                         overlap="delayed", n_rounds=5, codec="topk:chunk=4096,k=128,bits=2")
    assignment = Assignment(recipe.epoch_seed, slot=0, max_slots=2)
    models = []
    for r in range(1, 6):  # the held model each round trains from: a different one each time
        params = {n: p.detach().clone() for n, p in build_model(recipe.model, recipe.init_seed + r).named_parameters()}
        save_file(params, str(tmp_path / f"held-{r}.safetensors"))
        models.append((params, tmp_path / f"held-{r}.safetensors"))
    alone = host_rounds(recipe, assignment, None, None, tmp_path / "unused")
    assert isinstance(alone, LocalRounds)
    with served_rig(recipe, assignment, tmp_path) as rounds:
        alone.skipped = rounds.skipped = lambda r: r == 2
        assert rounds.mailbox is not None
        orders: list[tuple[int, ...]] = []
        post = rounds.mailbox.post
        rounds.mailbox.post = lambda order: orders.append(tuple(order.skipped)) or post(order)  # type: ignore[method-assign]
        sent = []
        for r, (params, path) in enumerate(models, start=1):
            want = alone.train_round(r, params, lambda p=path: p, lambda s, loss: None)
            got = rounds.train_round(r, params, lambda p=path: p, lambda s, loss: None)
            assert got.payload == want.payload, f"round {r}"
            ef = alone.worker.feedback
            assert got.residual_root == commitment_root(ef.residual, spec_of(params), ef.codec)
            sent.append(got.payload)
        assert orders == [(), (), (), (2,), ()]
        rounds.load_state_dict({"rig": {"base": 4, "procs": 1}})  # round 5 refused: the state after round 4
        params, path = models[4]
        assert rounds.train_round(5, params, lambda: path, lambda s, loss: None).payload == sent[4]


def test_a_rig_moves_a_round_onto_the_daemon_s_targets_as_one_process_does_and_drops_a_round_given_up(
    tmp_path: Path,
) -> None:
    """An eager round's late forecast on a rig: the daemon takes each move's target once the move's step is
    reported and writes it (with its shift, `Shifted`) for the rig, whose payload is the one-process
    round's; a round whose target fails is given up, and the rig trains the next order from its base (a
    `carry` epoch: the half-trained round's AdamW steps must not survive into it)."""
    recipe = tiny_recipe(tmp_path, grad_accum=1, round_state="carry", overlap="eager", forecast_step=2)
    assignment = Assignment(recipe.epoch_seed, slot=0, max_slots=2)
    models = global_models(recipe, tmp_path)
    alone = LocalRounds(make_worker(recipe, assignment, None))
    (start, _), (target, _), (other, _) = models
    shift = {n: target[n] - start[n] for n in start}  # as `shift_onto` takes it: fp32, one rounding
    seen: list[int] = []
    with served_rig(recipe, assignment, tmp_path) as rounds:
        for r, moved in ((1, lambda: target), (2, lambda: Shifted(other, shift))):
            steps: list[int] = []

            def taken(moved: Callable[[], object] = moved, steps: list[int] = steps) -> object:
                seen.append(max(steps, default=0))  # the steps reported when the daemon took it
                return moved()

            want = alone.train_round(r, start, lambda: models[0][1], lambda s, loss: None, [Rebase(2, moved)])
            got = rounds.train_round(r, start, lambda: models[0][1], lambda s, loss, steps=steps: steps.append(s),
                                     [Rebase(2, taken)])  # type: ignore[list-item]
            assert got.payload == want.payload, f"round {r}"
        assert seen == [2, 2]

        def fails() -> dict[str, torch.Tensor]:
            raise RuntimeError("the forecast failed")

        with pytest.raises(RuntimeError, match="the forecast failed"):
            rounds.train_round(3, start, lambda: models[0][1], lambda s, loss: None, [Rebase(2, fails)])
        # the daemon trains round 3 again without the move: the rig left the half-trained round for it
        want = alone.train_round(3, start, lambda: models[0][1], lambda s, loss: None).payload
        assert rounds.train_round(3, start, lambda: models[0][1], lambda s, loss: None).payload == want
        assert rounds.mailbox is not None and not list(rounds.mailbox.root.glob("move-*"))  # gone with each round


def test_local_rounds_count_steps_within_the_round(tmp_path: Path) -> None:
    recipe = replace(tiny_recipe(tmp_path), inner_steps=3)
    worker = make_worker(recipe, Assignment(recipe.epoch_seed, 0, 2), None)
    params = {n: p.detach().clone() for n, p in build_model(recipe.model, 0).named_parameters()}
    rounds = LocalRounds(worker)
    seen: list[int] = []
    for r in (1, 2):
        rounds.train_round(r, params, lambda: tmp_path, lambda s, loss: seen.append(s))
    assert seen == [1, 2, 3, 1, 2, 3] and worker.trainer.step == 6


def rig_world(tmp: Path, **recipe: object) -> World:
    """test_host_node's world with a 3-round recipe whose step takes 2 micro-batches (one per process)."""
    from test_host_node import build_world

    tmp.mkdir(parents=True)
    return build_world(tmp, inner_steps=6, micro_batch=2, grad_accum=2, warmup_steps=2, n_rounds=3,
                       **recipe)  # type: ignore[arg-type]


# two fragments, one a round, landing a round late with a mix; the update broadcast with the codec
STREAMED = dict(replay_probability=0.0, round_state="carry", stream_fragments=2, stream_mix=0.5, overlap="delayed",
                broadcast="codec")


def run_epoch(world: World, tmp: Path, host1: HostSettings) -> list[Progress]:
    from test_host_node import TLS, AggregatorThread, host_keys

    with AggregatorThread(world, tmp / "agg") as target:
        nodes = []
        for i, settings in ((1, host1), (2, HostSettings(world.epoch, 5 * 10**9, tmp / "host2", poll_s=0.05))):
            agg = AggregatorClient(target, TLS.cert_pem, 60.0)
            nodes.append(HostNode(settings, world.recipe, world.client(i), agg, host_keys(i, world)))
        with ThreadPoolExecutor(2) as pool:
            return [f.result(timeout=600) for f in [pool.submit(n.run) for n in nodes]]


@pytest.mark.slow  # two 3-round epochs with a real aggregator, one with a torchrun rig: ~1-2 min
@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe", [{}, STREAMED, {"overlap": "eager", "forecast_step": 2, "merge_step": 4}],
                         ids=["fresh", "streamed", "late-forecast-merge"])
def test_a_host_on_a_sharded_two_process_rig_submits_the_one_process_hosts_payloads(
    tmp_path: Path, recipe: dict[str, object]
) -> None:
    """A streamed epoch too: the rig host sends each round's fragment as the one-process host does, and
    follows each round by its fragment's update (its outer momentum never dropped for a pulled checkpoint).
    An eager epoch with a late forecast and a merge: the rig moves onto the daemon's forecast, then onto
    the model after r - 1, at their steps, and every round passes the aggregator's replay (p = 1) with
    the one-process host's payload."""
    single, on_rig = tmp_path / "single", tmp_path / "rig"
    world = rig_world(single, **recipe)
    alone = run_epoch(world, single, HostSettings(world.epoch, 5 * 10**9, single / "host1", poll_s=0.05))
    world = rig_world(on_rig, **recipe)
    rigged = run_epoch(world, on_rig, HostSettings(world.epoch, 5 * 10**9, on_rig / "host1", poll_s=0.05,
                                                   procs=2, sharding="sharded"))
    assert set(alone[0].submitted) == {"1", "2", "3"}
    assert rigged[0].submitted == alone[0].submitted  # the payloads' sha256, round by round
    assert rigged[1].submitted == alone[1].submitted  # so the other host saw the same global models
    assert rigged[0].model_sha256 == alone[0].model_sha256 == world.client(0).round_result(
        world.epoch, 3).checkpoint_sha256.hex()
    assert [p.outer_steps for p in (*alone, *rigged)] == [3] * 4
    if recipe is not STREAMED:  # paid for every round: the aggregator's replay (p = 1) reproduced it
        assert all(rigged[0].rewards[str(r)] > 0 for r in (1, 2, 3)), rigged[0].rewards
    assert HostStore(on_rig / "host1").load().worker_state == {"rig": {"base": 3, "procs": 2}}  # type: ignore[union-attr]
    assert sorted(p.name for p in (on_rig / "host1" / "rig" / "state").iterdir()) == ["after-2", "after-3"]
