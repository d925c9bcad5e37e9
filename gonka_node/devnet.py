"""`gonka-node devnet`: the whole network on one machine, with one command.

This process is the chain node: the embedded EVM served over JSON-RPC on 127.0.0.1. It deploys the
contracts with the Governor holding governance, schedules and funds an epoch by a GNK-weighted vote
(the voting period passes by moving the devnet chain's clock), then starts an aggregator and N hosts as
separate `gonka-node` processes that reach the chain and each other over loopback only (or, with
`chain_url`, uses an external JSON-RPC development node such as anvil instead of the embedded one:
its funded dev accounts play the same roles and its clock moves by `evm_increaseTime`). When the
epoch's last round is finalized it claims every host's rewards with Merkle proofs, pulls each round's
checkpoint and checks it against the hash on chain, and writes `report.json` and `loss.png`.
The aggregator serves TLS only: it writes its certificate at start (`aggregator_cert(out)`), which the
hosts' configs and this process's own pulls pin.

With `serve` the chain (now following the wall clock) and the aggregator keep running after the report
until Ctrl-C or SIGTERM, and their addresses are printed, so clients can list, pull and export against
them. Other long-running services start beside them then: each `ExtraService` in `SERVICES` (the hook
for `gonka-node explorer`, `gonka-node serve` and the like) is a `gonka-node` verb whose arguments are
built from a `ServeContext` (chain URL, deployment file, epoch, aggregator), started as a child like
the others, and announced with the address it reports once ready.
Every child process is stopped on the way out, whatever happened.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load as load_safetensors

from chain.backends import ChainBackend, EmbeddedBackend, RpcBackend
from chain.client import ChainClient
from chain.server import ChainServer
from chain.types import Deployment
from chain.units import NGONKA_PER_GNK as GNK
from gonka_node.core.client import AggregatorClient
from gonka_node.core.config import (
    TLS_DIR,
    AggregationSettings,
    AggregatorConfig,
    ChainSettings,
    RoundSettings,
)
from gonka_node.core.config_file import write_config
from gonka_node.core.keys import init_keys
from gonka_node.core.recipe import Recipe, recipe_default
from gonka_node.core.storage import StoreError, open_store
from gonka_node.core.tls import CERT_FILE, load_certificate
from gonka_node.epoch_setup import EpochTerms, epoch_spec, initial_checkpoint
from gonka_node.host.config import HostConfig, load_host_config
from gonka_node.host.store import HostStore
from training.checkpoint import canonical_sha256
from training.dataset import DatasetError, read_manifest
from training.inner import evaluate
from training.model import ModelConfig, build_model
from training.tokenizer import TokenizerError, load_tokenizer

GOVERNANCE, AGGREGATOR = 0, 9  # dev account indices; hosts are 1..N
VOTING_PERIOD_S = 3600
SIGNIN_WINDOW_S = 600  # closed early by moving the clock once every host has signed in
AGGREGATOR_DIR = "aggregator"  # the aggregator's data_dir under the devnet folder


class DevnetError(RuntimeError):
    pass


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
    broadcast: str = "dense"  # the recipe's download: "dense" fp32 or "codec" (gonka_node/aggregator/broadcast.py)
    services: tuple[ExtraService, ...] | None = None  # None: SERVICES (below)
    dataset: str | None = None  # a prepared dataset (folder or s3://…); None: the stdlib corpus, bytes
    tokenizer: Path | None = None  # the dataset's tokenizer.json, checked against it (optional)


@dataclass(frozen=True)
class ServeContext:
    """What a service started beside a serving devnet knows about the network it joins."""

    out: Path  # the devnet folder; a service may write its files (logs, port files) here
    chain_url: str
    deployment: Path
    epoch: int
    aggregator: str  # HOST:PORT of the aggregator's gRPC (TLS) service
    aggregator_cert: Path  # the certificate clients pin (also announced on chain)


@dataclass(frozen=True)
class ExtraService:
    """A long-running `gonka-node` verb started beside the chain and the aggregator by `devnet --serve`.

    `args(ctx)` is the verb and its flags; `ready(ctx)` says when it is up (e.g. its port file exists);
    `address(ctx)`, read once ready, is what the devnet prints for it (e.g. "http://127.0.0.1:PORT")."""

    name: str
    args: Callable[[ServeContext], list[str]]
    address: Callable[[ServeContext], str]
    ready: Callable[[ServeContext], bool] = lambda ctx: True


def printed_url(ctx: ServeContext, name: str, prefix: str) -> str | None:
    """The URL a child printed on its line starting with `prefix` (its log is logs/<name>.log), or None yet."""
    log = ctx.out / "logs" / f"{name}.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return next((line.removeprefix(prefix).strip() for line in lines if line.startswith(prefix)), None)


EXPLORER = ExtraService(
    "explorer",
    args=lambda ctx: ["explorer", "--deployment", str(ctx.deployment), "--rpc", ctx.chain_url, "--port", "0",
                      "--db", str(ctx.out / "explorer.sqlite3")],
    address=lambda ctx: printed_url(ctx, "explorer", "explorer:") or "?",
    ready=lambda ctx: printed_url(ctx, "explorer", "explorer:") is not None,
)

def _model_url(ctx: ServeContext) -> str | None:
    line = printed_url(ctx, "model", "model:")
    return line.split()[0] if line else None


MODEL = ExtraService(
    "model",
    args=lambda ctx: ["serve", "--deployment", str(ctx.deployment), "--rpc", ctx.chain_url, "--epoch",
                      str(ctx.epoch), "--round", "latest", "--port", "0", "--threads", "1",
                      "--cache-dir", str(ctx.out / "serve-cache")],
    address=lambda ctx: _model_url(ctx) or "?",
    ready=lambda ctx: _model_url(ctx) is not None,
)

# The hook: services started beside the chain and the aggregator under `devnet --serve`, in this order.
SERVICES: list[ExtraService] = [EXPLORER, MODEL]


@dataclass
class Children:
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, args: list[str], log: Path, env: dict[str, str]) -> None:
        with open(log, "ab") as sink:  # append: a restarted child keeps its earlier log
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "gonka_node", *args], stdout=sink, stderr=subprocess.STDOUT, env=env
            )

    def check(self, logs: Path) -> None:
        for name, p in self.procs.items():
            if p.poll() not in (None, 0):
                tail = (logs / f"{name}.log").read_text(errors="replace")[-2000:]
                raise DevnetError(f"{name} exited with status {p.returncode}; its log ends:\n{tail}")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait(what: str, ready: Callable[[], bool], timeout_s: float, children: Children, logs: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        children.check(logs)
        if time.monotonic() > deadline:
            raise DevnetError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


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
        broadcast=opts.broadcast,
    ).with_data_manifest()


def schedule_by_vote(backend: ChainBackend, deployment: Deployment, spec: Any, pool: int) -> int:
    """Create and fund the epoch through the Governor: treasury transfer, escrow, propose, vote, execute."""
    accounts = backend.dev_accounts()
    gov = ChainClient(backend, accounts[GOVERNANCE], deployment).connect()
    if pool:
        gov.transfer(deployment.governor, pool)
    epoch = gov.epoch_count() + 1
    voters = [ChainClient(backend, accounts[i], deployment).connect() for i in (GOVERNANCE, AGGREGATOR)]
    for v in voters:
        v.gov_deposit(v.gnk_balance() * 9 // 10)
    funding = gov.action_fund_epoch(epoch, pool) if pool else []
    pid = gov.propose([gov.action_create_epoch(spec), *funding], "devnet epoch")
    for v in voters:
        v.vote(pid, True)
    backend.increase_time(VOTING_PERIOD_S + 1)
    created = gov.epochs_created(gov.execute(pid))
    if created != [epoch]:
        raise DevnetError(f"the proposal created epochs {created}, expected [{epoch}]")
    return epoch


def aggregator_cert(out: Path) -> Path:
    """The certificate the devnet's aggregator writes at its first start (its TLS identity's public half)."""
    return out / AGGREGATOR_DIR / TLS_DIR / CERT_FILE


def aggregator_client(out: Path, target: str, timeout_s: float = 120.0) -> AggregatorClient:
    """A client of the devnet's running aggregator, pinning the certificate it wrote."""
    return AggregatorClient(target, load_certificate(aggregator_cert(out)), timeout_s)


def aggregator_config(opts: DevnetOptions, rpc_url: str, epoch: int) -> AggregatorConfig:
    """The devnet aggregator's config: listening on a free loopback port, a quorum of every host."""
    out, keys = opts.out, opts.out / "keys" / "aggregator"
    return AggregatorConfig(
        data_dir=out / AGGREGATOR_DIR, listen="127.0.0.1:0", node_key=keys / "node_key.json",
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


def write_configs(opts: DevnetOptions, rpc_url: str, epoch: int, stake_gnk: int) -> None:
    """out/aggregator.toml and out/host<i>.toml, rendered from the typed configs."""
    write_config(aggregator_config(opts, rpc_url, epoch), opts.out / "aggregator.toml")
    for i in range(1, opts.hosts + 1):
        write_config(host_config(opts, i, rpc_url, epoch, stake_gnk), opts.out / f"host{i}.toml")


@dataclass
class DevnetChain:
    """The devnet's chain: a backend this process controls (dev accounts, clock) and the URL children use."""

    backend: ChainBackend
    url: str
    server: ChainServer | None = None  # set when the chain is the embedded one, served from here

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def start_chain(chain_url: str | None = None) -> DevnetChain:
    """The embedded EVM served on 127.0.0.1, or an external development node at `chain_url`."""
    if chain_url is None:
        backend = EmbeddedBackend()
        server = ChainServer(backend, "127.0.0.1", 0).start()
        return DevnetChain(backend, server.url, server)
    rpc = RpcBackend(chain_url)
    if len(rpc.dev_accounts()) <= AGGREGATOR:
        raise DevnetError(
            f"{chain_url} ({rpc.client_version()}) is not a development node with funded accounts "
            f"0..{AGGREGATOR}: the devnet needs anvil or `gonka-node chain serve`"
        )
    return DevnetChain(rpc, chain_url)


@dataclass(frozen=True)
class ScheduledEpoch:
    deployment: Deployment
    recipe: Recipe
    epoch: int
    init_sha: bytes


def deploy_and_schedule(
    opts: DevnetOptions, chain: DevnetChain, say: Callable[[str], None] = print
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
        aggregators=[accounts[AGGREGATOR].address],
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
    for name, index in [("aggregator", AGGREGATOR)] + [(f"host{i}", i) for i in range(1, opts.hosts + 1)]:
        init_keys(out / "keys" / name, None, insecure_plaintext=True, force=True,
                  evm_private_key=bytes(accounts[index].key))
    write_configs(opts, chain.url, epoch, -(-terms.min_stake // GNK))
    return ScheduledEpoch(deployment, recipe, epoch, init_sha)


def child_env() -> dict[str, str]:
    """The children's environment: ours without GONKA_* settings (the configs say everything)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GONKA_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def start_aggregator(out: Path, children: Children, timeout_s: float = 120.0) -> str:
    """Start `gonka-node aggregator` on out/aggregator.toml; returns its HOST:PORT once it listens."""
    logs = out / "logs"
    port_file = out / "aggregator.port"
    port_file.unlink(missing_ok=True)
    children.start("aggregator", ["aggregator", "--config", str(out / "aggregator.toml"),
                                  "--port-file", str(port_file)], logs / "aggregator.log", child_env())
    _wait("the aggregator to listen", port_file.exists, timeout_s, children, logs)
    return f"127.0.0.1:{port_file.read_text().strip()}"


def point_host_at(out: Path, i: int, target: str) -> Path:
    """Set host i's aggregator endpoint (HOST:PORT) in its config file, which it returns."""
    cfg = out / f"host{i}.toml"
    write_config(dataclasses.replace(load_host_config(cfg, environ={}), aggregator=target), cfg)
    return cfg


def start_host(out: Path, i: int, target: str, children: Children, extra: tuple[str, ...] = ()) -> None:
    """Start (or restart: same config, same state dir) host i as `gonka-node run`; log appended."""
    cfg = point_host_at(out, i, target)
    children.start(f"host{i}", ["run", "--config", str(cfg), "--quiet", *extra], out / "logs" / f"host{i}.log",
                   child_env())


def close_signin(chain: DevnetChain, sched: ScheduledEpoch, hosts: int, children: Children, out: Path) -> None:
    """Wait for `hosts` sign-ins, then move the clock past the sign-in window: rounds may finalize."""
    reader = ChainClient(chain.backend, chain.backend.dev_accounts()[GOVERNANCE], sched.deployment).connect()
    _wait("every host to sign in", lambda: len(reader.hosts(sched.epoch)) >= hosts, 300, children, out / "logs")
    chain.backend.increase_time(SIGNIN_WINDOW_S + 1)


def run_devnet(
    opts: DevnetOptions,
    say: Callable[[str], None] = print,
    on_report: Callable[[dict[str, Any]], None] | None = None,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Run the epoch and return its report (also given to `on_report` as soon as it is written); with
    `opts.serve`, then keep serving until `stop` is set, SIGTERM or Ctrl-C."""
    out = opts.out
    if opts.hosts < 1 or opts.hosts > 8:
        raise DevnetError("--hosts must be between 1 and 8 (dev accounts 1..8)")
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    chain = start_chain(opts.chain_url)
    children = Children()
    started = time.monotonic()
    try:
        sched = deploy_and_schedule(opts, chain, say)
        epoch = sched.epoch
        target = start_aggregator(out, children)
        for i in range(1, opts.hosts + 1):
            start_host(out, i, target, children, ("--link", opts.link) if opts.link else ())
        say(f"aggregator on {target} (TLS, certificate {aggregator_cert(out)}); {opts.hosts} hosts started "
            f"(logs in {logs})")
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

        _wait(f"{opts.rounds} rounds", progressed, opts.timeout_s, children, logs)
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
        children.stop()
        chain.stop()


def keep_serving(
    ctx: ServeContext, chain: DevnetChain, children: Children, services: Sequence[ExtraService],
    say: Callable[[str], None], stop: threading.Event | None = None,
) -> None:
    """Start `services`, print every address, and wait for `stop`, SIGTERM or Ctrl-C (then return)."""
    if chain.server is not None:
        chain.server.follow_clock = True  # deadlines now pass with the wall clock, from the devnet's lead
    logs = ctx.out / "logs"
    for service in services:
        children.start(service.name, service.args(ctx), logs / f"{service.name}.log", child_env())
        _wait(f"{service.name} to start", functools.partial(service.ready, ctx), 120, children, logs)
    say(f"serving until Ctrl-C: chain {ctx.chain_url} (deployment {ctx.deployment}, epoch {ctx.epoch})")
    say(f"aggregator: {ctx.aggregator} (TLS certificate {ctx.aggregator_cert}, also announced on chain)")
    for service in services:
        say(f"{service.name}: {service.address(ctx)}")
    say(f"try: gonka-node checkpoint list --deployment {ctx.deployment}")
    stop = stop or threading.Event()
    _stop_on_sigterm(stop)
    try:
        while not stop.wait(0.5):
            _check_serving(children, logs)
    except KeyboardInterrupt:
        pass
    say("stopping the devnet")


def _check_serving(children: Children, logs: Path) -> None:
    """While serving, hosts have left; every other child must still run."""
    for name, proc in children.procs.items():
        if not name.startswith("host") and proc.poll() is not None:
            tail = (logs / f"{name}.log").read_text(errors="replace")[-2000:]
            raise DevnetError(f"{name} exited with status {proc.returncode} while serving; its log ends:\n{tail}")


def _stop_on_sigterm(stop: threading.Event) -> None:
    if threading.current_thread() is threading.main_thread():  # signals can only be set from there
        signal.signal(signal.SIGTERM, lambda *_: stop.set())


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
    with aggregator_client(opts.out, target) as agg:
        for r in range(1, opts.rounds + 1):
            want = reader.round_result(epoch, r).checkpoint_sha256
            params = load_safetensors(agg.checkpoint(epoch, r).data)
            got = bytes.fromhex(canonical_sha256(params))
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
        "overlap": opts.overlap,
        "broadcast": opts.broadcast,
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
