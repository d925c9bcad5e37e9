"""`checkpoint pull --fragment K` of a sharded epoch: fragment K alone, checked against the chain's root
without the other fragments' bytes (docs/PROTOCOL.md "Sharded aggregators", the fragment proof).

Shard K is the epoch's K-th aggregator on chain, pinned to the certificate it announced. Its
`LocateRound` serves the fragment's proof (its canonical hash and the sibling hashes up to the root);
nothing in it is trusted: its index and count must be the ones asked for (K, and the recipe's S), and it
must lead to the chain's root before a byte of the fragment is fetched. The fragment then comes from
the shard's object store or its stream (`fetch_into`, as a whole pull), into a temporary file beside
`--out`; its tensors' canonical hash, walked up the siblings, must be the chain's root, else the file
is deleted. The file written is the shard's fragment file: a safetensors file of that fragment's tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from gonka_node.cli import CliError
from gonka_node.cli.checkpoint_chain import ChainCheckpoint
from gonka_node.cli.checkpoint_pull import MESSAGE_LIMIT, check_aggregator, fetch_into, verified_into
from gonka_node.core.fragments import FragmentProof


def check_fragment_index(index: int, shards: int, want: ChainCheckpoint) -> None:
    """Refuse what no proof can answer: an unsharded epoch, round 0 (the initial model, recorded whole)
    or an index outside the epoch's fragments."""
    if shards <= 1:
        raise CliError(f"--fragment: epoch {want.epoch} is not sharded (one aggregator holds the whole model); "
                       "pull it without --fragment")
    if want.round == 0:
        raise CliError(f"--fragment: round 0 is epoch {want.epoch}'s initial model, recorded whole on chain; "
                       "pull it without --fragment")
    if not 0 <= index < shards:
        raise CliError(f"--fragment {index}: epoch {want.epoch} has {shards} fragments, 0 to {shards - 1}")


def pull_one_fragment(
    chain: Any, shards: int, index: int, want: ChainCheckpoint, out: Path, *, timeout_s: float, max_bytes: int,
    model: Any = None, model_source: str = "",
) -> tuple[int, FragmentProof, str]:
    """Fragment `index` of round `want.round` from its shard into `out`, once its proof leads to
    `want.sha256`; returns the file's size, the proof it was checked with and what became of its
    metadata (as `pull_checkpoint`)."""
    from gonka_node.core.tls import pinned_channel

    check_fragment_index(index, shards, want)
    shard = _shard(chain, want.epoch, index)
    where = f"shard {index} ({shard.endpoint})"
    check_aggregator(shard.endpoint, shard.tls_cert_pem, min(timeout_s, 10.0))
    try:
        with pinned_channel(shard.endpoint, shard.tls_cert_pem,
                            options=[("grpc.max_receive_message_length", MESSAGE_LIMIT)]) as channel:
            proof = served_proof(channel, want, index, shards, timeout_s, where)

            def write(tmp: Path) -> int:
                with tmp.open("r+b") as handle:
                    return fetch_into(channel, want, handle, timeout_s, max_bytes, where)

            size, note = verified_into(out, want, model, model_source, write,
                                       lambda tmp: check_file(tmp, want, index, shards, proof))
    except grpc.RpcError as exc:
        raise CliError(f"{where}: epoch {want.epoch} round {want.round} failed: {exc.code().name} "
                       f"{exc.details()}; nothing was written") from None
    return size, proof, note


def _shard(chain: Any, epoch: int, index: int) -> Any:
    """Shard `index`'s announcement: the epoch's `index`-th aggregator on chain (the shards' order)."""
    aggregators = chain.get_epoch(epoch).spec.aggregators
    address = aggregators[index] if index < len(aggregators) else None
    found = [a for a in chain.aggregator_endpoints(epoch) if a.address == address]
    if not found:
        raise CliError(f"--fragment {index}: shard {index} of epoch {epoch} (aggregator {address}) has not "
                       "announced its endpoint on chain yet; try again later")
    return found[0]


def served_proof(channel: grpc.Channel, want: ChainCheckpoint, index: int, shards: int, timeout_s: float,
                 where: str) -> FragmentProof:
    """The shard's proof of its fragment, refused unless it is fragment `index` of `shards` and leads to
    the chain's root: checked before anything is downloaded."""
    from proto.gonka.v1 import aggregator_pb2 as pb
    from proto.gonka.v1 import aggregator_pb2_grpc as pb_grpc

    location = pb_grpc.AggregatorStub(channel).LocateRound(pb.RoundRef(epoch=want.epoch, round=want.round),
                                                          timeout=timeout_s)
    if not location.HasField("fragment"):
        raise CliError(f"{where} serves no proof of its fragment of epoch {want.epoch} round {want.round} (a "
                       "skipped round, or an aggregator from before fragment proofs): pull the whole checkpoint "
                       "without --fragment")
    served = location.fragment
    proof = FragmentProof(served.index, served.count, bytes(served.fragment_sha256),
                          tuple(bytes(s) for s in served.siblings))
    if (proof.index, proof.count) != (index, shards):
        raise CliError(f"{where} serves the proof of fragment {proof.index} of {proof.count}, not of fragment "
                       f"{index} of {shards}; nothing was written")
    if not proof.proves(want.sha256):
        raise CliError(f"{where}'s proof of fragment {index} does not lead to the root {want.sha256.hex()} the "
                       f"chain records for epoch {want.epoch} round {want.round}; nothing was written")
    return proof


def check_file(path: Path, want: ChainCheckpoint, index: int, shards: int, proof: FragmentProof) -> None:
    """The downloaded file's tensors are fragment `index` of `shards` (what was asked for, not what the
    proof says): their canonical hash, walked up the proof's siblings, is the chain's root (CliError
    otherwise)."""
    from gonka_node.core.fragments import verify_fragment
    from training.checkpoint import CheckpointError, load_checkpoint

    try:
        got = bytes.fromhex(load_checkpoint(path).sha256)
    except CheckpointError as exc:
        raise CliError(f"epoch {want.epoch} round {want.round}: the downloaded fragment {index} is "
                       f"unreadable or corrupted ({exc}); it was deleted") from None
    if not verify_fragment(got, index, shards, proof.siblings, want.sha256):
        raise CliError(f"epoch {want.epoch} round {want.round}: the downloaded fragment {index}'s tensors "
                       f"hash to {got.hex()}, not to a leaf of the chain's root {want.sha256.hex()} "
                       f"(the proof is of {proof.fragment_sha256.hex()}): the shard served another fragment or a false proof; "
                       "it was deleted")
