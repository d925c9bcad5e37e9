"""What torchrun runs in every process of a host's rig: `python -m gonka_node.host.rig_process --setup
FILE` (`gonka_node.host.rig_round.RigRounds` starts it): build this process's worker from the setup,
then take the daemon's rounds (`training.rig_service.RigService`) until a stop order or the daemon is gone.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from gonka_node.core.recipe import Recipe
from gonka_node.host.rig_round import RigSetup, process_alive, recipe_stream
from training.codecs import get_codec
from training.model import Llama
from training.plan import choose_sharding
from training.rig import Rig
from training.rig_service import Mailbox, ReplicatedWorker, RigService, RoundWorker, StateVersions
from training.worker import Assignment, DiLoCoWorker

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _parent_alive(pid: int) -> Callable[[], bool]:
    return lambda: process_alive(pid)


def follow_daemon(daemon_pid: int, poll_s: float = 1.0) -> None:
    """Make this rig process end with its agent and with the host daemon, wherever it blocks.

    torchrun's agent starts each process in a session of its own, so stopping the agent's session
    (`RigRounds.close`) does not reach them, and a process waiting in the rig's rendezvous or in a
    collective never reaches the order loop that notices a vanished daemon: such processes once
    outlived everything. The kernel kills this process when the agent dies (Linux), and a thread
    stops the agent (which stops every process and restarts none) once the daemon is gone."""
    agent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != agent:  # the agent died before the signal was armed
            os._exit(1)
    daemon_alive = _parent_alive(daemon_pid)

    def watch() -> None:
        while daemon_alive():
            time.sleep(poll_s)
        try:
            if os.getppid() == agent != 1:  # still ours (a dead agent's pid may name another process)
                os.kill(agent, signal.SIGTERM)
        except ProcessLookupError:
            pass
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="follow-daemon", daemon=True).start()


def _sharded(setup: RigSetup, recipe: Recipe, rig: Rig) -> bool:
    if setup.sharding != "auto":
        return setup.sharding == "sharded"
    memory = torch.cuda.get_device_properties(rig.device).total_memory if rig.device.type == "cuda" else None
    choice = choose_sharding(recipe.model, rig.world_size, memory, recipe.micro_batch, recipe.seq_len)
    return bool(rig.broadcast_object(choice))  # one decision for the whole rig


def build_rig_worker(setup: RigSetup, rig: Rig) -> tuple[RoundWorker, str]:
    """The worker of this rig process, on meta tensors first: nothing is initialised (every round loads
    the global model, a streamed epoch's first; later ones train on from the rig's own), and a sharded
    model is only ever allocated shard by shard."""
    recipe = Recipe.from_dict(setup.recipe)
    assignment = Assignment(setup.epoch_seed, setup.slot, setup.max_slots, bytes.fromhex(setup.beacon))
    cache = Path(setup.cache_dir) if setup.cache_dir is not None else None
    model = Llama(recipe.model, device="meta")
    stream = recipe_stream(recipe)
    if not _sharded(setup, recipe, rig):
        model.checkpoint_layers = setup.checkpoint_activations
        inner = replace(recipe.inner_config(), compile=setup.compile)
        worker = DiLoCoWorker(model.to_empty(device=rig.device), inner, get_codec(recipe.codec),
                              recipe.windows(cache), assignment, recipe.ef_decay, rig=rig)
        return ReplicatedWorker(worker, rig, stream, recipe.overlap), "replicated"
    from torch.distributed.device_mesh import init_device_mesh

    from training.sharded import ShardedWorker, ShardOptions, shard_model

    mesh = init_device_mesh(rig.device.type, (rig.world_size,))
    shard_model(model, mesh, ShardOptions(checkpoint_activations=setup.checkpoint_activations, compile=setup.compile))
    model.to_empty(device=rig.device)
    sharded = ShardedWorker(model, recipe.inner_config(), get_codec(recipe.codec), recipe.windows(cache), assignment,
                            rig, recipe.ef_decay, stream=stream, overlap=recipe.overlap)
    return sharded, "sharded"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gonka_node.host.rig_process")
    parser.add_argument("--setup", type=Path, required=True)
    args = parser.parse_args(argv)
    setup = RigSetup.load(args.setup)
    follow_daemon(setup.parent_pid)  # first: joining the rig below can block for minutes
    rig = Rig.from_torchrun()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // rig.world_size))
    worker, mode = build_rig_worker(setup, rig)
    if rig.is_rank0:
        print(f"rig of {rig.world_size} processes on {rig.device.type}, {mode}", flush=True)
    service = RigService(rig, Mailbox(Path(setup.mailbox)), StateVersions(Path(setup.state_dir)), worker,
                         _parent_alive(setup.parent_pid))
    service.serve()
    # Only after a clean stop: tearing the group down while a peer is mid-collective (this process
    # failed, the other did not) blocks; a failed process exits and the agent restarts the rig.
    rig.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
