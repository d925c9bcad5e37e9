"""Weights from the chain: pull a round's checkpoint, verify it whole, and follow newer rounds.

`load_round` is `gonka-node checkpoint pull` (gonka_node/cli/checkpoint_pull.py) followed by the load that
`checkpoint generate --epoch --round` does: the chain's hash for the round, the aggregator and its
certificate from the chain (or the ones given), the streamed file checked against that hash, and the
model config and tokenizer from the epoch's recipe on chain (or a recipe file checked against the
epoch's model_spec_hash). A model config nothing on chain vouches for is refused: this server serves
only what the chain describes. The tokenizer is the file the recipe names by sha256: the one given
(`--tokenizer`) or the one stored with the recipe's dataset, refused if its hash differs. A file already in the cache is used when its tensors hash to the chain's.

`ChainFollower` polls the epoch's latest finalized round and, when it moves, loads that round and adds
it to the registry (which retires the oldest served round after its requests finish). A failed pull
is reported and tried again at the next poll; the rounds already served go on serving.
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gonka_node.cli import CliError
from gonka_node.cli.checkpoint_chain import ChainCheckpoint, chain_checkpoint, epoch_recipe
from gonka_node.cli.checkpoint_load import load_model, recipe_tokenizer
from gonka_node.cli.checkpoint_pull import DEFAULT_MAX_BYTES, MESSAGE_LIMIT, pull_checkpoint
from gonka_node.serve.models import ModelRegistry, Provenance
from training.model import Llama
from training.tokenizer import Bytes, Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointSource:
    """Where an epoch's checkpoints are and how to check them."""

    deployment: Path
    epoch: int
    cache_dir: Path  # verified checkpoint files, epoch-E-round-R.safetensors
    rpc_url: str | None = None  # default: the one the deployment file records
    recipe: Path | None = None  # only when the epoch's recipe is not published on chain
    aggregator: str | None = None  # HOST:PORT; default: the first one the epoch's aggregators announced
    tls_cert: Path | None = None  # default: the certificate announced on chain for that aggregator
    pull_timeout_s: float = 600.0
    max_bytes: int = DEFAULT_MAX_BYTES
    tokenizer: Path | None = None  # the recipe's tokenizer.json; default: the one with its dataset


@dataclass(frozen=True)
class VerifiedModel:
    provenance: Provenance
    model: Llama
    tokenizer: Tokenizer = field(default_factory=Bytes)


def open_chain(source: CheckpointSource) -> Any:
    """A read-only ChainClient (it signs nothing), as `checkpoint pull` opens one."""
    from gonka_node.cli.chain import open_client

    return open_client(argparse.Namespace(deployment=source.deployment, rpc_url=source.rpc_url))


def load_round(client: Any, source: CheckpointSource, round_text: str, device: str) -> VerifiedModel:
    """The round's model, every tensor checked against the chain's hash and its config the chain's."""
    want = chain_checkpoint(client, source.epoch, round_text)
    recipe, where = epoch_recipe(client, source.epoch, source.recipe)
    if recipe is None:
        raise CliError(
            f"epoch {source.epoch} has no recipe on chain to take the model config from: give the epoch's "
            "recipe file (--recipe), which is checked against its model_spec_hash")
    config = recipe.model
    tokenizer = recipe_tokenizer(recipe, where, source.tokenizer, config)
    path = source.cache_dir / f"epoch-{want.epoch}-round-{want.round}.safetensors"
    shards = recipe.shards if want.round > 0 else 1  # round 0: the initial model, one plain sha256
    tensors = _cached(path, want, shards)
    if tensors is None:
        _pull(client, source, want, path, config, where, shards)
        tensors = _cached(path, want, shards)
    if tensors is None:
        raise CliError(f"{path}: the pulled file no longer verifies against the chain")
    provenance = Provenance(want.epoch, want.round, want.sha256.hex(), want.chain_id, want.registry)
    return VerifiedModel(provenance, load_model(tensors, config, device), tokenizer)


def _cached(path: Path, want: ChainCheckpoint, shards: int) -> dict[str, Any] | None:
    """The file's tensors if they are the chain's checkpoint (a sharded epoch's by their Merkle root)."""
    from gonka_node.cli.checkpoint_fragments import checked_by_root
    from training.checkpoint import CheckpointError, load_checkpoint

    if not path.is_file():
        return None
    try:
        if shards > 1:
            return checked_by_root(path, want, shards)
        return load_checkpoint(path, expected_sha256=want.sha256.hex()).tensors
    except (CheckpointError, CliError) as exc:
        log.warning("%s does not verify against the chain (%s); pulling it again", path, exc)
        return None


def _pull(client: Any, source: CheckpointSource, want: ChainCheckpoint, out: Path, config: Any, where: str,
          shards: int) -> None:
    from gonka_node.core.discovery import resolve_aggregator
    from gonka_node.core.tls import TlsError, check_peer, pinned_channel

    if shards > 1:  # every shard announced on chain: one given aggregator holds one fragment only
        from gonka_node.cli.checkpoint_fragments import pull_fragments

        pull_fragments(client, shards, want, out, timeout_s=source.pull_timeout_s, max_bytes=source.max_bytes,
                       model=config, model_source=where)
        return
    try:
        found = resolve_aggregator(client, source.epoch, source.aggregator, source.tls_cert)
        check_peer(found.target, found.tls_cert_pem, min(source.pull_timeout_s, 10.0))
    except TlsError as exc:
        raise CliError(str(exc)) from None
    except ValueError as exc:  # an address that is not HOST:PORT
        raise CliError(f"aggregator {exc}") from None
    except OSError as exc:
        raise CliError(f"aggregator: cannot connect ({exc.strerror or exc})") from None
    options = [("grpc.max_receive_message_length", MESSAGE_LIMIT)]
    with pinned_channel(found.target, found.tls_cert_pem, options=options) as channel:
        pull_checkpoint(channel, want, out, timeout_s=source.pull_timeout_s, max_bytes=source.max_bytes,
                        model=config, model_source=where)


class ChainFollower:
    """Polls the chain every `poll_s` and serves each newly finalized round of the epoch."""

    def __init__(
        self, client: Any, source: CheckpointSource, registry: ModelRegistry,
        add: Callable[[VerifiedModel], None], *, device: str, poll_s: float,
    ) -> None:
        self._client, self._source, self._registry = client, source, registry
        self._add, self._device, self._poll_s = add, device, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gonka-serve-follow", daemon=True)

    def start(self) -> ChainFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30.0)

    def poll_once(self) -> bool:
        """Serve the latest finalized round if it is newer than the newest served; True if it was."""
        from chain.errors import ChainError

        newest = self._registry.newest()
        try:
            latest = self._client.latest_round(self._source.epoch)
            if newest is not None and latest <= newest.provenance.round:
                return False
            self._add(load_round(self._client, self._source, str(latest), self._device))
        except (CliError, ChainError, OSError) as exc:
            log.warning("epoch %d: could not serve a newer round yet (%s); trying again", self._source.epoch, exc)
            return False
        return True

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            self.poll_once()
