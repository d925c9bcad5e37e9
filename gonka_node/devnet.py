"""`gonka-node devnet`: the whole network on one machine, with one command.

This process is the chain node: the embedded EVM served over JSON-RPC on 127.0.0.1 (with
`kernel_link`: on the links' bridge). It deploys the
contracts with the Governor holding governance, schedules and funds an epoch by a GNK-weighted vote
(the voting period passes by moving the devnet chain's clock), then starts an aggregator and N hosts as
separate `gonka-node` processes that reach the chain and each other over loopback only (or, with
`chain_url`, uses an external JSON-RPC development node such as anvil instead of the embedded one:
its funded dev accounts play the same roles and its clock moves by `evm_increaseTime`). When the
epoch's last round is finalized it claims every host's rewards with Merkle proofs, pulls each round's
checkpoint and checks it against the hash on chain, and writes `report.json` and `loss.png`.
With `serve` the chain and the aggregator keep running after the report, beside extra services
(`devnet_serve.py`), until Ctrl-C or SIGTERM. With `shards` S > 1 the epoch names S aggregators (quorum
S), the recipe has `shards = S`, and S aggregator processes exchange signed messages over gRPC; each round's
checkpoint hash is then the Merkle root over fragments (`core/fragments.py`); shard 0 scores and replays
the sampled hosts from their fragments (docs/PROTOCOL.md "Sharded aggregators"). With `link` each host
paces its own transfers like that link on loopback; with `kernel_link` too, the kernel shapes them
instead, each host in a network namespace of its own (`devnet_links.py`).

This module holds the devnet's options, its recipe, its configs (rendered from the typed configs) and
the run itself; the steps live beside it, one job each: `devnet_chain.py` (the chain, the vote, the
sign-in window), `devnet_procs.py` (child processes, the aggregator's certificate and client),
`devnet_report.py` (claims, then the report that only reads), `devnet_serve.py` (`--serve`) and
`devnet_links.py` (`--kernel-link`).
Every child process is stopped on the way out, whatever happened.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chain.client import ChainClient
from chain.units import NGONKA_PER_GNK as GNK
from gonka_node.core.config import (
    AggregationSettings,
    AggregatorConfig,
    ChainSettings,
    RoundSettings,
)
from gonka_node.core.config_file import write_config
from gonka_node.core.keys import init_keys
from gonka_node.core.link import LinkSpec
from gonka_node.core.recipe import Recipe, RecipeError, recipe_default
from gonka_node.core.storage import StoreError, open_store
from gonka_node.devnet_chain import (
    AGGREGATOR,
    GOVERNANCE,
    SIGNIN_WINDOW_S,
    VOTING_PERIOD_S,
    DevnetChain,
    ScheduledEpoch,
    close_signin,
    schedule_by_vote,
    start_chain,
)
from gonka_node.devnet_links import KernelLinks
from gonka_node.devnet_procs import (
    AGGREGATOR_DIR,
    Children,
    DevnetError,
    aggregator_cert,
    aggregator_name,
    start_aggregator,
    start_host,
    wait_for,
)
from gonka_node.devnet_report import claim_rewards, make_report
from gonka_node.devnet_serve import SERVICES, ExtraService, ServeContext, keep_serving
from gonka_node.epoch_setup import EpochTerms, epoch_spec, initial_checkpoint
from gonka_node.host.config import HostConfig
from training.codecs import spec_of
from training.dataset import DatasetError, read_manifest
from training.fragments import FragmentError, plan_fragments
from training.model import Llama, ModelConfig
from training.tokenizer import TokenizerError, load_tokenizer

# The devnet's recipe where it differs from an epoch recipe's defaults (a few minutes on a CPU); every
# other field is the recipe's default, or the option below that sets it.
DEVNET_RECIPE: dict[str, Any] = {"n_rounds": 8, "inner_lr": 3e-3, "warmup_steps": 10}


@dataclass(frozen=True)
class DevnetOptions:
    out: Path
    hosts: int = 3
    rounds: int = DEVNET_RECIPE["n_rounds"]
    inner_steps: int = recipe_default("inner_steps")
    preset: str = "devnet"
    seq_len: int = recipe_default("seq_len")
    micro_batch: int = recipe_default("micro_batch")
    codec: str = recipe_default("codec")
    reward_per_round_gnk: int = 100
    timeout_s: float = 900.0
    heldout_windows: int = 64
    chain_url: str | None = None  # an external dev node (anvil); None: the embedded chain, served here
    replay_fraction: float = 1.0  # the epoch's replay probability p; > 0: fresh rounds; 0: no replays, no pay
    serve: bool = False  # keep the chain, the aggregator and the extra services running until stopped
    link: str | None = None  # every host's link, "DOWN/UP" Mbit/s (gonka_node/core/link.py); None: loopback as is
    overlap: str = "off"  # the recipe's overlap rule (training/overlap.py)
    forecast_step: int = 0  # "eager": the inner step each round moves onto its forecast (0: from the start)
    merge_step: int = 0  # "eager": the inner step each round moves onto the model after r − 1 (0: never)
    broadcast: str = "dense"  # the recipe's download: "dense" fp32 or "codec" (gonka_node/aggregator/broadcast.py)
    services: tuple[ExtraService, ...] | None = None  # None: SERVICES (below)
    dataset: str | None = None  # a prepared dataset (folder or s3://…); None: the stdlib corpus, bytes
    tokenizer: Path | None = None  # the dataset's tokenizer.json, checked against it (optional)
    shards: int = 1  # aggregator processes, each owning a fragment of the model (recipe `shards`)
    kernel_link: bool = False  # shape `link` in the kernel: a network namespace per host (devnet_links.py)
    stream_fragments: int = 1  # the recipe's: fragments synced one a round (training/streaming.py); 1: whole model
    stream_mix: float = 0.0  # the recipe's: how much of its own values a host keeps when a synced fragment lands


def _data_fields(opts: DevnetOptions) -> dict[str, Any]:
    """The recipe's data fields: the stdlib corpus with bytes, or the dataset with its tokenizer (whose
    vocabulary the model takes)."""
    if opts.dataset is None:
        if opts.tokenizer is not None:
            raise DevnetError("--tokenizer names the tokenizer of a prepared dataset: give --dataset too "
                              "(gonka-node data prepare --tokenizer FILE --out DIR)")
        return {"model": ModelConfig.preset(opts.preset)}
    corpus = opts.dataset if "://" in opts.dataset else str(Path(opts.dataset).resolve())  # hosts run elsewhere
    try:
        manifest, _ = read_manifest(open_store(corpus))
    except (StoreError, DatasetError) as exc:
        raise DevnetError(f"--dataset: {exc}") from exc
    if opts.tokenizer is not None:
        try:
            load_tokenizer(opts.tokenizer, manifest.tokenizer_sha256 or "0" * 64)
        except TokenizerError as exc:
            raise DevnetError(f"--tokenizer: {exc} (the dataset's)") from exc
    model = dataclasses.replace(ModelConfig.preset(opts.preset), vocab_size=manifest.vocab_size)
    return {"model": model, "corpus": corpus, "tokenizer": manifest.tokenizer_sha256}


def make_recipe(opts: DevnetOptions) -> Recipe:
    return Recipe(
        **_data_fields(opts),
        **{**DEVNET_RECIPE, "n_rounds": opts.rounds},
        assignment_seed="signin-block",  # no host knows its windows before sign-in closes
        seq_len=opts.seq_len,
        micro_batch=opts.micro_batch,
        inner_steps=opts.inner_steps,
        codec=opts.codec,
        round_state="fresh" if opts.replay_fraction > 0 else "carry",
        overlap=opts.overlap,
        forecast_step=opts.forecast_step,
        merge_step=opts.merge_step,
        broadcast=opts.broadcast,
        shards=opts.shards,
        stream_fragments=opts.stream_fragments,
        stream_mix=opts.stream_mix,
    ).with_data_manifest()


def check_shards(opts: DevnetOptions) -> None:
    """What a sharded devnet cannot do yet, refused in one line before anything starts."""
    if opts.shards < 1 or opts.hosts + opts.shards > AGGREGATOR:
        raise DevnetError(f"--shards must be at least 1, and hosts + shards at most {AGGREGATOR} (dev accounts "
                          f"1..{AGGREGATOR}), got {opts.hosts} hosts and {opts.shards} shards")
    if opts.shards > 1 and opts.overlap == "eager":
        raise DevnetError("--shards with --overlap eager: the sharded replay does not compute the hosts' eager "
                          "bases; use --overlap delayed or one aggregator")
    if opts.stream_fragments > 1 and opts.replay_fraction > 0:
        raise DevnetError(f"--stream-fragments {opts.stream_fragments}: a streamed round trains on from the host's "
                          "own model, which no replay can recompute; add --replay-fraction 0 (no replays, no pay)")
    try:  # the recipe's own refusal of the forecast and merge steps and the streaming, before anything starts
        model = ModelConfig.preset(opts.preset)
        Recipe(model=model, inner_steps=opts.inner_steps, overlap=opts.overlap, forecast_step=opts.forecast_step,
                        merge_step=opts.merge_step, shards=opts.shards, codec=opts.codec,
                        round_state="fresh" if opts.replay_fraction > 0 else "carry",
                        stream_fragments=opts.stream_fragments, stream_mix=opts.stream_mix)
        if opts.stream_fragments > 1:  # no more fragments than the model has tensors (shapes only: meta)
            with torch.device("meta"):
                shapes = spec_of(dict(Llama(model).named_parameters()))
            plan_fragments(shapes, opts.stream_fragments, what="stream_fragments")
    except (RecipeError, FragmentError) as exc:  # each names its field first: the flag that sets it
        field = str(exc).split(":")[0].split()[0]
        raise DevnetError(f"--{field.replace('_', '-')}: {exc}") from exc


def kernel_links(opts: DevnetOptions) -> KernelLinks | None:
    """With `kernel_link`, the hosts' namespaces and shaped pairs (made here: DevnetError in one line,
    nothing made, where they cannot be); else None (loopback, paced by each host when `link` is set)."""
    if not opts.kernel_link:
        return None
    if opts.link is None:
        raise DevnetError("--kernel-link shapes the hosts' links in the kernel: give the rates with --link DOWN/UP")
    if opts.chain_url is not None:
        raise DevnetError("--kernel-link with --rpc-url: hosts in their own network namespaces cannot reach a "
                          "development node on this machine's loopback; leave --rpc-url out (the embedded chain "
                          "listens on the links' bridge)")
    if opts.dataset is not None and "://" in opts.dataset:
        raise DevnetError("--kernel-link with an object-store --dataset: hosts in their own network namespaces "
                          "reach only the links' bridge, not the store; give a prepared dataset folder")
    return KernelLinks.create(opts.hosts, LinkSpec.parse(opts.link))


def aggregator_account(shard: int) -> int:
    """Shard `shard`'s dev account: 9, 8, ... downwards (hosts are 1..N from below)."""
    return AGGREGATOR - shard


def aggregator_config(
    opts: DevnetOptions, rpc_url: str, epoch: int, shard: int = 0, hub: str = "127.0.0.1"
) -> AggregatorConfig:
    """The config of the devnet's aggregator (shard `shard` of `opts.shards`): listening on a free port
    of `hub` (loopback, or the kernel links' bridge), a quorum of every host; shards reach each other
    over the Shard gRPC service on their own ports (signed messages, peers as announced on chain), as
    shards on separate machines would."""
    out, name = opts.out, aggregator_name(shard)
    keys = out / "keys" / name
    return AggregatorConfig(
        data_dir=out / name, listen=f"{hub}:0", node_key=keys / "node_key.json",
        evm_key=keys / "evm_key.json", recipe=out / "recipe.json", deployment=out / "deployment.json", epoch=epoch,
        chain=ChainSettings(backend="rpc", rpc_url=rpc_url), round=RoundSettings(quorum=opts.hosts),
        aggregation=AggregationSettings(heldout_windows=opts.heldout_windows),
    )


def host_config(opts: DevnetOptions, i: int, rpc_url: str, epoch: int, stake_gnk: int) -> HostConfig:
    """Host i's config, pinning the aggregator's certificate; its endpoint is set when the aggregator
    listens (`start_host`)."""
    out = opts.out
    return HostConfig(
        key_dir=out / "keys" / f"host{i}", state_dir=out / f"host{i}", aggregator="", recipe=out / "recipe.json",
        deployment=out / "deployment.json", rpc_url=rpc_url, epoch=epoch, stake=stake_gnk * GNK,
        cache_dir=out / "cache", aggregator_tls_cert=aggregator_cert(out),
    )


def write_configs(opts: DevnetOptions, rpc_url: str, epoch: int, stake_gnk: int, hub: str = "127.0.0.1") -> None:
    """out/aggregator.toml (and out/aggregator-shard<i>.toml) and out/host<i>.toml, rendered from the
    typed configs."""
    for shard in range(opts.shards):
        write_config(aggregator_config(opts, rpc_url, epoch, shard, hub),
                     opts.out / f"{aggregator_name(shard)}.toml")
    for i in range(1, opts.hosts + 1):
        write_config(host_config(opts, i, rpc_url, epoch, stake_gnk), opts.out / f"host{i}.toml")


def deploy_and_schedule(
    opts: DevnetOptions, chain: DevnetChain, say: Callable[[str], None] = print, hub: str = "127.0.0.1"
) -> ScheduledEpoch:
    """Deploy (Governor as governance), write recipe/deployment/keys/configs under `opts.out`, and
    schedule + fund the epoch by a vote. Hosts still have to sign in (their processes do)."""
    out = opts.out
    backend = chain.backend
    accounts = backend.dev_accounts()
    deployer = ChainClient(backend, accounts[GOVERNANCE]).connect()
    deployment = deployer.deploy_all(
        use_governor=True,
        voting_period_s=VOTING_PERIOD_S,
        quorum_bps=1000,  # 10% of supply: the two devnet voters escrow 18%
        initial_mint={a.address: 1_000_000 * GNK for a in accounts},
    )
    deployment.extra["rpc_url"] = chain.url
    deployment.save(out / "deployment.json")
    where = f"embedded EVM at {chain.url}" if chain.server else f"{backend.name} node at {chain.url}"
    say(f"chain: {where}, contracts deployed (governance: the Governor)")

    recipe = make_recipe(opts)
    recipe.save(out / "recipe.json")
    init_sha = initial_checkpoint(recipe, out / AGGREGATOR_DIR / "initial.safetensors")
    # The stake rule: min_stake × p must cover a round's reward, so a cheat is a losing bet. An epoch
    # that replays nobody (p = 0) cannot pay.
    reward = opts.reward_per_round_gnk * GNK if opts.replay_fraction > 0 else 0
    terms = EpochTerms.staked_for(
        reward, opts.replay_fraction,
        aggregators=[accounts[aggregator_account(s)].address for s in range(opts.shards)],
        aggregator_quorum=opts.shards,
        round_length_s=600,
        signin_window_s=SIGNIN_WINDOW_S,
        max_hosts=max(8, opts.hosts),
    )
    spec = epoch_spec(recipe, init_sha, terms, "file:recipe.json")
    epoch = schedule_by_vote(backend, deployment, spec, opts.rounds * terms.reward_per_round)
    say(f"governance: epoch {epoch} scheduled and funded by a vote ({recipe.model.num_params():,} "
        f"parameters, {opts.rounds} rounds × H={opts.inner_steps}, codec {opts.codec}, replay probability "
        f"{opts.replay_fraction:g}, stake {terms.min_stake / GNK:g} GNK per host"
        + (")" if reward else "; no replay check, so no rewards: the stake rule needs p > 0)"))
    if opts.shards > 1:
        say(f"sharded: {opts.shards} aggregators, each owning a fragment of the model; checkpoint hashes are "
            "Merkle roots over fragments; shard 0 scores and replays the sampled hosts from their fragments")
    roles = [(aggregator_name(s), aggregator_account(s)) for s in range(opts.shards)]
    for name, index in roles + [(f"host{i}", i) for i in range(1, opts.hosts + 1)]:
        init_keys(out / "keys" / name, None, insecure_plaintext=True, force=True,
                  evm_private_key=bytes(accounts[index].key))
    # a host stakes at least 1 GNK: its config refuses 0, which is the minimum of an unpaid (p = 0) epoch
    write_configs(opts, chain.url, epoch, max(1, -(-terms.min_stake // GNK)), hub)
    return ScheduledEpoch(deployment, recipe, epoch, init_sha)


def run_devnet(
    opts: DevnetOptions,
    say: Callable[[str], None] = print,
    on_report: Callable[[dict[str, Any]], None] | None = None,
    stop: threading.Event | None = None,
    children: Children | None = None,
) -> dict[str, Any]:
    """Run the epoch and return its report (also given to `on_report` as soon as it is written); with
    `opts.serve`, then keep serving until `stop` is set, SIGTERM or Ctrl-C. `children`: where the child
    processes are kept (a test that stops and restarts one passes its own)."""
    out = opts.out
    if opts.hosts < 1 or opts.hosts > 8:
        raise DevnetError("--hosts must be between 1 and 8 (dev accounts 1..8)")
    check_shards(opts)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    links = kernel_links(opts)
    hub = "127.0.0.1" if links is None else links.hub
    children = Children() if children is None else children
    started = time.monotonic()
    chain: DevnetChain | None = None
    try:
        chain = start_chain(opts.chain_url, hub)
        sched = deploy_and_schedule(opts, chain, say, hub)
        epoch = sched.epoch
        targets = [start_aggregator(out, children, shard=s) for s in range(opts.shards)]
        target = targets[0]
        for i in range(1, opts.hosts + 1):
            if links is None:
                start_host(out, i, target, children, ("--link", opts.link) if opts.link else ())
            else:  # the kernel shapes the link: the host's own pacing stays off
                start_host(out, i, target, children, prefix=links.command(i))
        if links is not None:
            say(f"links: {opts.link} Mbit/s shaped by the kernel (tc tbf), each host in network namespace "
                f"{links.namespace(1)}..{opts.hosts} on {links.subnet}, the chain and the aggregators on {hub}")
        say(f"aggregator{'s' if opts.shards > 1 else ''} on {', '.join(targets)} (TLS, certificate "
            f"{aggregator_cert(out)}{' and beside it in each shard' if opts.shards > 1 else ''}); {opts.hosts} "
            f"hosts started (logs in {logs})")
        close_signin(chain, sched, opts.hosts, children, out)
        reader = ChainClient(chain.backend, chain.backend.dev_accounts()[GOVERNANCE], sched.deployment).connect()
        last = 0

        def progressed() -> bool:
            nonlocal last
            now = reader.latest_round(epoch)
            if now > last:
                say(f"round {now}/{opts.rounds} finalized on chain ({time.monotonic() - started:.0f} s)")
                last = now
            return now >= opts.rounds

        wait_for(f"{opts.rounds} rounds", progressed, opts.timeout_s, children, logs)
        for i in range(1, opts.hosts + 1):
            children.procs[f"host{i}"].wait(120)
        claimed = claim_rewards(opts, chain.backend, sched.deployment, epoch, target)
        report = make_report(opts, chain.backend, sched.deployment, sched.recipe, epoch, target, sched.init_sha, claimed)
        report["seconds"] = round(time.monotonic() - started, 1)
        (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        if on_report is not None:
            on_report(report)
        if opts.serve:
            ctx = ServeContext(out, chain.url, out / "deployment.json", epoch, target, aggregator_cert(out))
            keep_serving(ctx, chain, children, SERVICES if opts.services is None else opts.services, say, stop)
        return report
    finally:
        try:
            children.stop()
            if chain is not None:
                chain.stop()
        finally:
            if links is not None:
                links.close()
