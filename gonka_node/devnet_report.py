"""What a finished devnet epoch did: each host claims the rounds it earned by Merkle proof
(`claim_rewards`, the only part that sends transactions), then `make_report` reads the chain, the
aggregator (every round's checkpoint pulled and checked against the hash on chain, its held-out loss)
and the hosts' recorded progress into `report.json`'s dict and `loss.png`. A sharded epoch's checkpoint
is every shard's fragment merged, checked by the Merkle root over fragments the chain records.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import load as load_safetensors

from chain.backends import ChainBackend
from chain.client import ChainClient
from chain.types import Deployment
from gonka_node.core.fragments import model_root
from gonka_node.core.recipe import Recipe
from gonka_node.devnet_chain import GOVERNANCE
from gonka_node.devnet_procs import DevnetError, aggregator_client
from gonka_node.host.shards import ShardedAggregator, sharded_aggregator
from gonka_node.host.store import HostStore
from training.inner import evaluate
from training.model import build_model

if TYPE_CHECKING:
    from gonka_node.core.client import AggregatorClient
    from gonka_node.devnet import DevnetOptions

def _earned(opts: DevnetOptions, host: int) -> tuple[dict[int, int], int]:
    """What host `host` recorded: ngonka earned per round, and payload bytes sent."""
    snap = HostStore(opts.out / f"host{host}").load()
    if snap is None:
        return {}, 0
    return {int(r): amount for r, amount in snap.progress.rewards.items()}, snap.progress.bytes_sent


def _transfers(opts: DevnetOptions, host: int) -> tuple[int, dict[str, float]]:
    """What host `host` recorded: bytes downloaded, and its utilisation per round (`host_utilisation`)."""
    snap = HostStore(opts.out / f"host{host}").load()
    if snap is None:
        return 0, host_utilisation({})
    return snap.progress.bytes_received, host_utilisation(snap.progress.utilisation)


def claim_rewards(
    opts: DevnetOptions, backend: ChainBackend, deployment: Deployment, epoch: int, target: str
) -> dict[str, int]:
    """Each host claims every round it earned, by Merkle proof from the aggregator; the ngonka each
    address received."""
    accounts = backend.dev_accounts()
    claimed: dict[str, int] = {}
    with aggregator_client(opts.out, target) as agg:
        for i in range(1, opts.hosts + 1):
            host = ChainClient(backend, accounts[i], deployment).connect()
            before = host.gnk_balance()
            for r, amount in _earned(opts, i)[0].items():
                if amount > 0 and not host.claimed(epoch, r):
                    proof = agg.reward_proof(epoch, r, bytes.fromhex(host.address[2:]))
                    host.claim(epoch, r, int(proof.amount), list(proof.proof))
            claimed[host.address] = host.gnk_balance() - before
    return claimed


@contextmanager
def _checkpoints(
    opts: DevnetOptions, reader: ChainClient, recipe: Recipe, epoch: int, target: str
) -> Iterator[AggregatorClient | ShardedAggregator]:
    """Where the report pulls checkpoints: the aggregator, or every shard announced on chain as one."""
    agg = aggregator_client(opts.out, target) if recipe.shards == 1 else sharded_aggregator(reader, epoch, recipe)
    try:
        yield agg
    finally:
        agg.close()


def make_report(
    opts: DevnetOptions, backend: ChainBackend, deployment: Deployment, recipe: Recipe,
    epoch: int, target: str, init_sha: bytes, claimed: Mapping[str, int],
) -> dict[str, Any]:
    """What the epoch did, read from the chain, the aggregator and the hosts' state (`claimed`: what
    `claim_rewards` received); sends nothing."""
    accounts = backend.dev_accounts()
    reader = ChainClient(backend, accounts[GOVERNANCE], deployment).connect()
    windows = recipe.windows(opts.out / "cache")
    heldout = windows.sample_heldout(12345, 128)
    model = build_model(recipe.model, recipe.init_seed)
    losses = [evaluate(model, windows.batches(heldout, 32))]
    hashes = [init_sha.hex()]
    with _checkpoints(opts, reader, recipe, epoch, target) as agg:
        for r in range(1, opts.rounds + 1):
            want = reader.round_result(epoch, r).checkpoint_sha256
            params = load_safetensors(agg.checkpoint(epoch, r).data)
            got = model_root(params, recipe.shards)  # one shard: the canonical hash itself
            if got != want:
                raise DevnetError(f"round {r}: pulled checkpoint hashes to {got.hex()}, chain says {want.hex()}")
            model.load_state_dict(params)
            losses.append(evaluate(model, windows.batches(heldout, 32)))
            hashes.append(want.hex())
    rewards: dict[str, Any] = {}
    bytes_per_host: dict[str, int] = {}
    received_per_host: dict[str, int] = {}
    utilisation: dict[str, dict[str, float]] = {}
    for i in range(1, opts.hosts + 1):
        address = str(accounts[i].address)
        earned, bytes_per_host[address] = _earned(opts, i)
        received_per_host[address], utilisation[address] = _transfers(opts, i)
        rewards[address] = {
            "earned_ngonka": sum(earned.values()),
            "claimed_ngonka": claimed.get(address, 0),
            "per_round": {r: earned.get(r, 0) for r in range(1, opts.rounds + 1)},
        }
    n_params = recipe.model.num_params()
    allreduce = 4 * n_params * recipe.total_inner_steps
    report = {
        "epoch": epoch,
        "rounds": opts.rounds,
        "hosts": opts.hosts,
        "params": n_params,
        "codec": opts.codec,
        "losses": losses,
        "link": opts.link or "loopback",
        # who paces it: each host's gRPC client on loopback, or the kernel (tc tbf, devnet_links.py)
        "link_shaping": "none" if opts.link is None else "kernel" if opts.kernel_link else "host",
        "overlap": opts.overlap,
        "forecast_step": opts.forecast_step,
        "merge_step": opts.merge_step,
        "broadcast": opts.broadcast,
        "stream_fragments": recipe.stream_fragments,  # > 1: each round syncs one of that many fragments
        "stream_mix": recipe.stream_mix,
        "shards": recipe.shards,  # > 1: checkpoint_hashes are Merkle roots over that many fragments
        "bytes_per_host": bytes_per_host,
        "download_bytes_per_host": received_per_host,
        "utilisation": utilisation,  # per host: per round and "all" (inner-step seconds / wall seconds)
        "allreduce_bytes_per_host": allreduce,
        "reduction_vs_allreduce": allreduce / max(1, max(bytes_per_host.values(), default=1)),
        "rewards": rewards,
        "checkpoint_hashes": hashes,
    }
    _plot(opts.out / "loss.png", losses, report)
    return report


def host_utilisation(rounds: dict[str, list[float]]) -> dict[str, float]:
    """A host's share of wall time in inner steps, per round and over all its rounds ("all")."""
    out = {r: round(busy / wall, 4) if wall > 0 else 0.0 for r, (busy, wall) in sorted(rounds.items(), key=lambda kv: int(kv[0]))}
    busy, wall = sum(b for b, _ in rounds.values()), sum(w for _, w in rounds.values())
    out["all"] = round(busy / wall, 4) if wall > 0 else 0.0
    return out


def _plot(path: Path, losses: list[float], report: dict[str, Any]) -> None:
    """Left: held-out loss per round. Middle: bytes each host sent vs all-reduce every step (log scale).
    Right: each host's utilisation (share of wall time in inner steps) per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (loss_ax, bytes_ax, util_ax) = plt.subplots(1, 3, figsize=(14, 4), gridspec_kw={"width_ratios": [3, 2, 3]})
    loss_ax.plot(range(len(losses)), losses, marker="o")
    loss_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    loss_ax.set_xlabel("round (0 = initial model)")
    loss_ax.set_ylabel("held-out loss (nats/byte)")
    loss_ax.set_title(f"{report['hosts']} hosts, {report['params']:,} params, codec {report['codec']}")
    loss_ax.grid(alpha=0.3)
    hosts = list(report["bytes_per_host"])
    labels = [f"host {i + 1}" for i in range(len(hosts))] + ["all-reduce\nevery step"]
    values = [report["bytes_per_host"][h] for h in hosts] + [report["allreduce_bytes_per_host"]]
    bytes_ax.bar(labels, values, color=["tab:blue"] * len(hosts) + ["tab:gray"])
    bytes_ax.set_yscale("log")
    bytes_ax.set_ylabel("bytes sent per host over the epoch")
    bytes_ax.set_title(f"{report['reduction_vs_allreduce']:.0f}× fewer bytes than all-reduce")
    for i, per_round in enumerate(report["utilisation"].values()):
        rounds = [int(r) for r in per_round if r != "all"]
        util_ax.plot(rounds, [per_round[str(r)] for r in rounds], marker="o", label=f"host {i + 1} ({per_round['all']:.2f})")
    util_ax.set_ylim(0, 1.05)
    util_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    util_ax.set_xlabel("round")
    util_ax.set_ylabel("share of wall time in inner steps")
    util_ax.set_title(f"utilisation, link {report['link']}, overlap {report['overlap']}")
    util_ax.legend(fontsize=8)
    util_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
