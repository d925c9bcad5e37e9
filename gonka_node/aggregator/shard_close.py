"""A shard's close (docs/PROTOCOL.md "Sharded aggregators"): report to the verifier, take its verdict,
aggregate and step this shard's fragment only, exchange fragment hashes, and return the round's
outcome with the Merkle-of-fragments root as its checkpoint hash.

Deterministic from the files on disk and the other shards' reports, like `close.compute_outcome`: a
close that waits (`ShardPending`) is simply run again at the next tick. The round state it holds is
its fragment's base, new parameters, aggregate and momentum.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch
from safetensors import safe_open
from safetensors.torch import load as safetensors_load
from torch import Tensor

from gonka_node.aggregator.broadcast import prepare_broadcast
from gonka_node.aggregator.close import (
    ClosingInputs,
    RoundOutcome,
    _save_durably,
    _sketch_path,
    save_broadcast,
)
from gonka_node.aggregator.outer_state import read_outer_state
from gonka_node.aggregator.shard import (
    BASE_KEY,
    FragmentReport,
    HostFragment,
    ShardExchange,
    ShardMismatch,
    ShardPending,
    ShardRole,
    SignedFragment,
    Verdict,
    VerdictRefused,
    VerifierInputs,
    WholeInputs,
    decide,
    misfit,
    payload_key,
    report_digest,
    sampled,
)
from gonka_node.aggregator.shard_audit import contradiction, rewards_contradiction
from gonka_node.aggregator.store import RoundRow, ShardDecision, Store, SubmissionRow
from gonka_node.aggregator.validate import Sketcher, decode_update, decoding, mapped
from gonka_node.core.fragments import FragmentProof, fragment_root, plan_fragments
from training.checkpoint import HASH_FORMAT, canonical_sha256
from training.codecs import round_seed
from training.diloco import OuterOptimizer, StreamingAverager
from training.durable import atomic_write
from training.hf_export import MODEL_CONFIG_KEY

if TYPE_CHECKING:
    from gonka_node.aggregator.engine_types import CheckpointIO

PUBLIC_ROUNDS = 16  # as close.PUBLIC_ROUNDS: earlier aggregates in the mixture check's span
HASH_CHUNK = 8 << 20  # bytes read at a time when hashing a checkpoint file


def fragments_path(checkpoint: Path) -> Path:
    """Where a shard keeps the S fragment hashes of a round's checkpoint (the root's leaves)."""
    return checkpoint.with_suffix(".fragments.json")


def read_fragment_hashes(checkpoint: Path) -> list[bytes]:
    return [bytes.fromhex(h) for h in json.loads(fragments_path(checkpoint).read_text())]


def served_proof(checkpoint: Path, role: ShardRole) -> FragmentProof | None:
    """This shard's fragment's proof under a round's root, from the leaves kept beside its checkpoint
    (None where there are none: a round this shard did not step). What `LocateRound` serves."""
    if not fragments_path(checkpoint).is_file():
        return None
    return FragmentProof.of(read_fragment_hashes(checkpoint), role.index)


def load_fragment(
    checkpoints: CheckpointIO, path: Path, expected: bytes, role: ShardRole, initial: Path
) -> dict[str, Tensor]:
    """This shard's tensors of a global model: the epoch's initial checkpoint is whole (verified whole,
    then cut); a round's is this shard's fragment file, verified against the root through its leaves."""
    if path == initial:
        return _fragment_of_whole(path, expected, role)
    hashes = read_fragment_hashes(path)
    if len(hashes) != role.count or fragment_root(hashes) != expected:
        raise ShardMismatch(f"{path}: its recorded fragment hashes do not make the root {expected.hex()}")
    return checkpoints.load(path, hashes[role.index])


def file_sha256(path: Path) -> bytes:
    """`training.checkpoint.canonical_sha256` of a safetensors file, read in chunks through the page
    cache: no tensor is materialised and no page is mapped into this process (a mapped file's pages
    count in its resident memory), so hashing the whole initial model costs a shard nothing."""
    with open(path, "rb") as f:
        return _canonical_sha256_of(f)


def _canonical_sha256_of(f: BinaryIO) -> bytes:
    (size,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(size))
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    digest = hashlib.sha256(HASH_FORMAT + struct.pack("<Q", len(entries)))
    for name in sorted(entries, key=lambda n: n.encode("utf-8")):
        entry, raw_name = entries[name], name.encode("utf-8")
        dtype, shape = entry["dtype"].encode("ascii"), entry["shape"]
        digest.update(struct.pack("<I", len(raw_name)) + raw_name + struct.pack("<I", len(dtype)) + dtype)
        digest.update(struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape))
        begin, end = entry["data_offsets"]
        digest.update(struct.pack("<Q", end - begin))
        f.seek(8 + size + begin)
        for at in range(begin, end, HASH_CHUNK):
            digest.update(f.read(min(HASH_CHUNK, end - at)))
    return digest.digest()


_VERIFIED: dict[tuple[int, int, int, int, int], bytes] = {}  # a file's identity and version → its hash


def verified_sha256(path: Path) -> bytes:
    """`file_sha256`, computed once per file as it stands on disk: a close waiting on the other shards
    is run again each tick, and re-reading a 1.2B model's 4.8 GB initial checkpoint each time costs
    ~4 s of CPU an attempt. The key is the open file's device, inode, size and modification and change
    times, read from the descriptor the hash then reads (a rename in between cannot pair one file's
    key with another's hash); a write changes the change time, which no user call can set back."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if key not in _VERIFIED:
            _VERIFIED[key] = _canonical_sha256_of(f)
    return _VERIFIED[key]


def _fragment_of_whole(path: Path, expected: bytes, role: ShardRole) -> dict[str, Tensor]:
    """This shard's tensors of a whole checkpoint, the whole verified against `expected` without
    holding (or mapping) the other fragments: what keeps a shard's memory to its fragment."""
    if verified_sha256(path) != expected:
        raise ShardMismatch(f"{path} is not the checkpoint {expected.hex()}")
    with safe_open(str(path), framework="pt") as handle:
        return {n: handle.get_tensor(n) for n in role.fragment.names}


def keep_decision(store: Store, row: RoundRow, skip: bool) -> ShardDecision:
    """The round's close decision: the one kept with the round if any, else `skip` over the round's
    checked submissions now, kept first. Kept before the report is signed (and before the seed is
    revealed), so a restarted shard reports exactly what it would have: one report per round, however
    the uploads it holds or its tick's view of the quorum changed."""
    stored = store.get_round(row.epoch, row.round)
    kept = None if stored is None else ShardDecision.of(stored)
    if kept is not None:  # every attempt after the first (a close waiting on the others retries each tick)
        return kept
    hosts = tuple(sorted(store.submitted_hosts(row.epoch, row.round, checked_only=True)))  # by address, no sketches
    return store.keep_shard_decision(row.epoch, row.round, ShardDecision(skip, hosts))


def decided_inputs(i: ClosingInputs, decision: ShardDecision) -> ClosingInputs:
    """`i` with the submissions the decision covers (all of them: none is stored after it)."""
    covered = [s for s in i.submissions if s.host in set(decision.hosts)]
    if [s.host for s in covered] != list(decision.hosts):
        row = i.round_row
        raise ShardMismatch(f"round {row.epoch}/{row.round}: a host this shard decided to report has no "
                            f"checked submission in its store")
    return dataclasses.replace(i, submissions=covered)


def close_fragment(
    i: ClosingInputs, role: ShardRole, exchange: ShardExchange, decision: ShardDecision, max_update_norm: float
) -> RoundOutcome:
    """Close this shard's fragment of the round as `decision` (keep_decision's, kept with the round) says."""
    i, skip = decided_inputs(i, decision), decision.skip
    ctx, row = i.ctx, i.round_row
    epoch, round_ = row.epoch, row.round
    base = load_fragment(i.checkpoints, i.base_path, row.base_sha256, role, ctx.initial_checkpoint)
    if not _reported(exchange, i, role, skip):  # a close waiting on the others does not decode again
        put_sampled(i, role, exchange)  # before the report: the verifier reads them once all reports are in
        exchange.put_report(report(i, role, base, skip))
    verdict = exchange.verdict(epoch, round_)
    if verdict is None and role.index == 0:
        whole = WholeInputs(lambda: whole_base(i, role, exchange), lambda s: whole_update(i, role, exchange, s))
        verifier = VerifierInputs(ctx, role, row, i.seed, i.slots, i.aggregation, max_update_norm, whole)
        exchange.put_verdict(decide(verifier, exchange.reports(epoch, round_)))
        verdict = exchange.verdict(epoch, round_)
    if verdict is None:
        raise ShardPending(f"round {epoch}/{round_}: no verdict from shard 0 yet")
    _check_verdict(verdict, i.submissions, role)
    audit_verdict(exchange, verdict, role, i.aggregation.rule_for(epoch))
    paid = rewards_contradiction(verdict, ctx)
    if paid is not None:
        raise ShardMismatch(f"round {epoch}/{round_}: shard {role.index} refuses the verifier's verdict: {paid}")
    if not verdict.aggregated:
        return RoundOutcome(row.base_sha256, bytes(32), 0, verdict.rule, list(verdict.rows), 0)
    own = _stepped(exchange, i, role)
    if own is None:
        own = step_fragment(i, role, verdict, base)
        exchange.put_hash(epoch, round_, role.index, own)
    hashes = exchange.hashes(epoch, round_)
    if len(hashes) < role.count:
        raise ShardPending(f"round {epoch}/{round_}: {len(hashes)} of {role.count} fragment hashes in")
    leaves = [hashes[k] for k in range(role.count)]
    if leaves[role.index] != own:
        raise ShardMismatch(f"round {epoch}/{round_}: the exchange holds another hash for fragment {role.index}")
    path = i.store.checkpoint_path(epoch, round_)
    atomic_write(fragments_path(path), lambda tmp: tmp.write_text(json.dumps([h.hex() for h in leaves])))
    return RoundOutcome(
        fragment_root(leaves), verdict.rewards_root, verdict.total_reward, verdict.rule, list(verdict.rows),
        len(verdict.aggregated),
    )


def _reported(exchange: ShardExchange, i: ClosingInputs, role: ShardRole, skip: bool) -> bool:
    """Whether the exchange already holds this shard's report of exactly these submissions. A shard signs
    one report per round (a second, different one is evidence against it): a close that would report
    otherwise waits for good, saying why."""
    row = i.round_row
    mine = next((r for r in exchange.reports(row.epoch, row.round) if r.index == role.index), None)
    if mine is None:
        return False
    if mine.skip != skip or [h.host for h in mine.hosts] != [s.host for s in i.submissions]:
        raise ShardMismatch(f"round {row.epoch}/{row.round}: shard {role.index} reported other submissions "
                            f"before (or a skip): it signs one report per round")
    return True


def _stepped(exchange: ShardExchange, i: ClosingInputs, role: ShardRole) -> bytes | None:
    """This shard's fragment hash if an earlier attempt of this close stepped and wrote everything (the
    hash is sent only after the last file is durable), else None."""
    row = i.round_row
    own = exchange.hashes(row.epoch, row.round).get(role.index)
    done = i.store.outer_state_path(row.epoch, row.round).exists() and i.store.checkpoint_path(row.epoch, row.round).exists()
    return own if done else None


def _check_verdict(verdict: Verdict, submissions: list[SubmissionRow], role: ShardRole) -> None:
    """The verdict must name every host this shard accepted, and aggregate none it did not."""
    accepted = {s.host for s in submissions}
    named = {r.host for r in verdict.rows}
    if not accepted <= named or not set(verdict.aggregated) <= accepted:
        raise ShardMismatch(
            f"round {verdict.epoch}/{verdict.round}: the verdict does not match the hosts shard {role.index} accepted"
        )


def audit_verdict(exchange: ShardExchange, verdict: Verdict, role: ShardRole, rule: str) -> None:
    """Refuse (`VerdictRefused`, evidence filed) a verdict whose host set, clip norms or τ do not follow
    from the reports it names (`shard_audit.contradiction`); wait for a named report not in yet."""
    reports = _named_reports(exchange, verdict, role)
    where = f"round {verdict.epoch}/{verdict.round}"
    if verdict.rule != rule:
        raise ShardMismatch(f"{where}: the verdict's rule is {verdict.rule!r}; shard {role.index} runs {rule!r}")
    why = misfit(reports, role) or contradiction(verdict, reports)
    if why is None:
        return
    kept = exchange.file_contradiction(verdict.epoch, verdict.round, why)
    raise VerdictRefused(f"{where}: shard {role.index} refuses the verifier's verdict: {why}"
                         + (f"; evidence kept in {kept}" if kept is not None else ""))


def _named_reports(exchange: ShardExchange, verdict: Verdict, role: ShardRole) -> list[FragmentReport]:
    """The S reports the verdict names by digest, as this shard holds them."""
    where = f"round {verdict.epoch}/{verdict.round}"
    if len(verdict.reports) != role.count:
        raise ShardMismatch(f"{where}: the verdict names {len(verdict.reports)} reports, not one per shard ({role.count})")
    held = {r.index: r for r in exchange.reports(verdict.epoch, verdict.round)}
    for k, digest in enumerate(verdict.reports):
        if k not in held:
            raise ShardPending(f"{where}: shard {k}'s report, which the verdict names, is not in yet")
        if report_digest(held[k]) != digest:
            raise ShardMismatch(f"{where}: the verdict names a report of shard {k} ({digest.hex()[:16]}…) "
                                f"other than the one shard {role.index} holds")
    return [held[k] for k in range(role.count)]


# ---- the sampled hosts' whole updates -------------------------------------------------------------


def put_sampled(i: ClosingInputs, role: ShardRole, exchange: ShardExchange) -> None:
    """Put this shard's fragment payload of every host the replay pick selects (and, when the round's
    base is a sharded checkpoint, this shard's fragment of it) where the verifier reads them."""
    row = i.round_row
    picked = sampled(i.ctx, i.seed, row.round, [s.host for s in i.submissions])
    for sub in i.submissions:
        if sub.host in picked:
            exchange.put_blob(row.epoch, row.round, role.index, payload_key(sub.host), Path(sub.path).read_bytes())
    if picked and i.base_path != i.ctx.initial_checkpoint:
        exchange.put_blob(row.epoch, row.round, role.index, BASE_KEY, i.base_path.read_bytes())


def _blob(exchange: ShardExchange, row: RoundRow, index: int, key: str) -> bytes:
    data = exchange.blob(row.epoch, row.round, index, key)
    if data is None:
        raise ShardMismatch(f"round {row.epoch}/{row.round}: shard {index} reported but did not put {key}")
    return data


def whole_update(i: ClosingInputs, role: ShardRole, exchange: ShardExchange, sub: SubmissionRow) -> dict[str, Tensor]:
    """A picked host's whole update: each shard's fragment payload, checked to be the one the host signed
    there (`unsigned_blob`), decoded with its fragment's spec."""
    codec, out = i.ctx.codec_for(i.round_row.round), {}
    row = i.round_row
    reports = {r.index: r for r in exchange.reports(row.epoch, row.round)}
    for k, fragment in enumerate(plan_fragments(role.whole_spec, role.count)):
        data = _blob(exchange, row, k, payload_key(sub.host))
        why = unsigned_blob(i, reports.get(k), k, sub.host, data)
        if why is not None:
            raise ShardMismatch(f"round {row.epoch}/{row.round}: {why}: the verifier's close waits (it judges no "
                                "host on such a blob)")
        out.update(decode_update(codec, data, fragment.spec(role.whole_spec)))
    return {name: out[name].float() for name in sorted(out)}


def unsigned_blob(i: ClosingInputs, report: FragmentReport | None, k: int, host: bytes, data: bytes) -> str | None:
    """Why shard k's payload blob of `host` is not the fragment payload the host signed at shard k (None:
    it is): the blob must hash to the digest and length of the header shard k's report names for the
    host, and that header must verify under the host's node key on chain. Otherwise a shard could make
    an honest host fail the replay with bytes it never sent. (A host no longer signed in, whose key the
    close does not hold, is checked against the report alone: the departed check excludes it anyway.)"""
    who = f"0x{host.hex()}"
    entry = None if report is None else next((h for h in report.hosts if h.host == host), None)
    if entry is None or entry.signed is None:
        return f"shard {k}'s report names no signed header of {who}'s fragment"
    signed = entry.signed
    if len(data) != signed.payload_length or hashlib.sha256(data).digest() != signed.payload_sha256:
        return (f"shard {k}'s payload blob of {who} ({len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}…) "
                f"is not the payload its report names ({signed.payload_length} bytes, sha256 "
                f"{signed.payload_sha256.hex()[:16]}…)")
    key = i.node_keys.get(host)
    if key is not None and not signed.submission(i.ctx, i.round_row, host).verify(signed.signature, key):
        return f"the header shard {k}'s report names for {who}'s fragment is not signed by {who}'s node key"
    return None


def whole_base(i: ClosingInputs, role: ShardRole, exchange: ShardExchange) -> dict[str, Tensor]:
    """The round's whole base: the initial checkpoint, or every shard's fragment of the last round's
    checkpoint, each verified against its leaf of the root on chain."""
    row = i.round_row
    if i.base_path == i.ctx.initial_checkpoint:
        return i.checkpoints.load(i.base_path, row.base_sha256)
    leaves = read_fragment_hashes(i.base_path)
    if len(leaves) != role.count or fragment_root(leaves) != row.base_sha256:
        raise ShardMismatch(f"{i.base_path}: its recorded fragment hashes do not make the root {row.base_sha256.hex()}")
    out: dict[str, Tensor] = {}
    for k, leaf in enumerate(leaves):
        part = safetensors_load(_blob(exchange, row, k, BASE_KEY))
        if bytes.fromhex(canonical_sha256(part)) != leaf:
            raise ShardMismatch(f"round {row.epoch}/{row.round}: shard {k}'s base fragment is not {leaf.hex()}")
        out.update(part)
    return out


# ---- the report ----------------------------------------------------------------------------------


def report(i: ClosingInputs, role: ShardRole, base: Mapping[str, Tensor], skip: bool) -> FragmentReport:
    row = i.round_row
    hosts = tuple(_host_fragment(i, s) for s in i.submissions)
    earlier = tuple((s.round, s.host, s.sketch) for s in i.earlier)
    return FragmentReport(
        row.epoch, row.round, role.index, role.count, tuple(sorted(role.fragment.names)), skip, hosts, earlier,
        _public(i, role, base),
    )


@contextlib.contextmanager
def _decoded(i: ClosingInputs, sub: SubmissionRow) -> Iterator[Iterator[tuple[str, Tensor]]]:
    """A stored fragment payload's tensors in sorted name order, fp32, decoded one at a time from the
    memory-mapped file: a close holds one decoded tensor of a host, not its fragment (nor a copy of
    its bytes). The payload passed its checks at ingest, so its names and shapes are the fragment's."""
    codec = i.ctx.codec_for(i.round_row.round)

    def tensors(data: memoryview) -> Iterator[tuple[str, Tensor]]:
        with decoding():  # a codec's error is the sender's (Rejected), as decode_update says; a reader's is not
            parts = codec.decode_parts(data, i.ctx.spec)
        while True:
            with decoding():
                part = next(parts, None)
            if part is None:
                return
            yield part[0], part[1].float()

    with open(sub.path, "rb") as f, mapped(f) as data:
        yield tensors(data)


def _host_fragment(i: ClosingInputs, sub: SubmissionRow) -> HostFragment:
    """Per-tensor squared norms summed as the ingest check (`validate.square_norm`) and as the clip
    (`robust._norm`) sum them: the verifier adds them in sorted order into the unsharded norms."""
    scan, clip = [], []
    with _decoded(i, sub) as tensors:
        for _, t in tensors:
            scan.append(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2)
            clip.append(float(t.double().square().sum()))
    return HostFragment(sub.host, sub.started_ms, sub.received_ms, tuple(scan), tuple(clip), sub.sketch,
                        SignedFragment.of(sub))


def sketch_at(role: ShardRole, tensors: Mapping[str, Tensor]) -> bytes:
    """The fragment's count sketch at its global coordinates (fragment sketches sum to the whole one)."""
    sketcher = Sketcher()
    for name in sorted(tensors):
        sketcher.add_at(role.offsets[name], tensors[name].float())
    return sketcher.result().numpy().tobytes()


def _public(i: ClosingInputs, role: ShardRole, base: Mapping[str, Tensor]) -> tuple[tuple[str, bytes], ...]:
    out = [("the base model", sketch_at(role, base))]
    epoch, round_ = i.round_row.epoch, i.round_row.round
    for r in range(round_ - 1, max(0, round_ - 1 - PUBLIC_ROUNDS), -1):
        path = _sketch_path(i.store, epoch, r)
        if path.exists():
            out.append((f"round {r}'s aggregate", path.read_bytes()))
    return tuple(out)


# ---- aggregate and step the fragment -------------------------------------------------------------


def _scaled(tensors: Iterator[tuple[str, Tensor]], norm: float, tau: float | None) -> Iterator[tuple[str, Tensor]]:
    """`robust._scale` with the whole update's norm, tensor by tensor: the fragment of the unsharded
    clipped update (each freshly decoded tensor scaled in place: the same single fp32 rounding)."""
    if tau is None or norm <= tau or norm == 0.0:
        yield from tensors
        return
    factor = torch.tensor(tau / norm, dtype=torch.float32)
    for name, t in tensors:
        yield name, t.mul_(factor)


def aggregate_fragment(i: ClosingInputs, role: ShardRole, verdict: Verdict) -> dict[str, Tensor]:
    """The verdict's hosts' clipped fragments averaged, streamed from their files: the round holds the
    sum (one fragment) and one decoded tensor, and the mean is taken in the sum's memory."""
    by_host = {s.host: s for s in i.submissions}
    avg = StreamingAverager(role.spec)
    for host in verdict.aggregated:  # increasing address, as the unsharded average
        with _decoded(i, by_host[host]) as tensors:
            avg.add_parts(host.hex(), _scaled(tensors, verdict.clip_norms[host], verdict.tau))
    return avg.take_result()


def step_fragment(i: ClosingInputs, role: ShardRole, verdict: Verdict, base: Mapping[str, Tensor]) -> bytes:
    """Aggregate, outer-step and write this shard's fragment; returns the fragment's canonical hash."""
    ctx, row = i.ctx, i.round_row
    sent = prepare_broadcast(ctx.broadcast, aggregate_fragment(i, role, verdict), ctx.codec_name,
                             round_seed(ctx.epoch_seed, row.round), i.prev_residual)
    update = sent.update
    step_from = base  # the round's base unless the recipe overlaps rounds (then one round older)
    if i.step_base is not None and i.step_base != (i.base_path, row.base_sha256):
        step_from = load_fragment(i.checkpoints, *i.step_base, role, ctx.initial_checkpoint)
    params = {name: t.float().clone() for name, t in step_from.items()}
    del step_from
    outer = OuterOptimizer(ctx.outer_lr, ctx.outer_momentum)
    if i.prev_outer_state is not None:
        outer.restore(*read_outer_state(i.prev_outer_state))
    outer.step(params, update)
    meta = {
        "epoch": str(row.epoch), "round": str(row.round), "base_sha256": row.base_sha256.hex(),
        "rule": verdict.rule, "fragment": f"{role.index}/{role.count}",
    }
    if ctx.model_config is not None:
        meta[MODEL_CONFIG_KEY] = ctx.model_config
    sha = i.checkpoints.save(i.store.checkpoint_path(row.epoch, row.round), params, meta)
    save_broadcast(i.store.update_path(row.epoch, row.round), sent, meta)
    sketch = sketch_at(role, update)
    atomic_write(_sketch_path(i.store, row.epoch, row.round), lambda tmp: tmp.write_bytes(sketch))
    _save_durably(i.store.outer_state_path(row.epoch, row.round), outer.buffers, {"steps": str(outer.steps)})
    return sha

