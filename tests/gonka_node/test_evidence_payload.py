"""A replay mismatch's evidence keeps the payload it was found on (gonka_node/slashing.py): a voter
re-runs the replay from the record and public inputs alone, and checks the kept bytes are the ones the
host signed. On a real store, with a real signature."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from nacl.signing import SigningKey

from gonka_node.aggregator.replay import MISMATCH
from gonka_node.aggregator.store import ContributionRow, Store, SubmissionRow
from gonka_node.core.envelope import Submission
from gonka_node.slashing import (
    KIND_REPLAY_MISMATCH,
    EvidenceLog,
    RoundIdentity,
    collect_evidence,
    verify_evidence,
)

IDENT = RoundIdentity(chain_id=31337, registry=b"\x05" * 20, codec="int8")
BASE = b"\x0b" * 32


def test_a_dense_replay_mismatch_keeps_the_payload_a_voter_checks(tmp_path: Path) -> None:
    key, host = SigningKey(b"\x07" * 32), b"\x0a" * 20
    store = Store(tmp_path / "agg").open()
    store.open_round(1, 1, BASE, 10**15)
    payload = b"the host's signed int8 update"
    sub = Submission(chain_id=IDENT.chain_id, registry=IDENT.registry, epoch=1, round=1, host=host,
                     base_checkpoint_sha256=BASE, codec=IDENT.codec, payload_sha256=hashlib.sha256(payload).digest(),
                     payload_length=len(payload), tokens_trained=64, timestamp_ms=1_000, residual_root=b"\x01" * 32)
    part = tmp_path / "upload.part"
    part.write_bytes(payload)
    store.add_submission(SubmissionRow(1, 1, host, sub.payload_sha256, len(payload), 64, 1_000, sub.sign(key), 2_000,
                                       0.5, b"", str(store.payload_path(1, 1, host)), residual_root=sub.residual_root),
                         part)
    store.record_finalize_intent(1, 1, "finalizing", b"\x0c" * 32, bytes(32), 0, "mean", [
        ContributionRow(host, 0.0, 0, False, [f"{MISMATCH}: cosine +0.1000 with the replay of slot 0's round 1"])])
    evidence_dir = tmp_path / "evidence"
    [record] = collect_evidence(store, 1, IDENT, EvidenceLog(evidence_dir))
    assert record.kind == KIND_REPLAY_MISMATCH and record.payload_file == f"{sub.payload_sha256.hex()}.payload"
    assert (evidence_dir / record.payload_file).read_bytes() == payload
    voter_key = bytes(key.verify_key)
    assert verify_evidence(record, voter_key, evidence_dir)
    (evidence_dir / record.payload_file).write_bytes(payload + b"!")
    assert not verify_evidence(record, voter_key, evidence_dir)  # not the bytes the host signed


def test_a_record_names_its_payload_by_the_signed_digest_and_no_other_file(tmp_path: Path) -> None:
    """A record is the aggregator's words: one naming another file (a path elsewhere, a device) for its
    payload does not verify, whatever that file holds."""
    key, host = SigningKey(b"\x08" * 32), b"\x0d" * 20
    payload = b"bytes"
    sub = Submission(chain_id=IDENT.chain_id, registry=IDENT.registry, epoch=1, round=1, host=host,
                     base_checkpoint_sha256=BASE, codec=IDENT.codec, payload_sha256=hashlib.sha256(payload).digest(),
                     payload_length=len(payload), tokens_trained=1, timestamp_ms=1, residual_root=b"\x01" * 32)
    log = EvidenceLog(tmp_path / "evidence")
    ev = log._evidence(KIND_REPLAY_MISMATCH, sub, sub.sign(key), "replay mismatch", None,
                       f"{sub.payload_sha256.hex()}.payload")
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(payload)
    assert log.add(ev, {ev.payload_file: elsewhere})
    assert verify_evidence(ev, bytes(key.verify_key), log.root)
    assert not list(log.root.glob("*.part"))  # written whole, then renamed
    assert not verify_evidence(dataclasses.replace(ev, payload_file=str(elsewhere)), bytes(key.verify_key), log.root)
    (log.root / ev.payload_file).unlink()
    assert not verify_evidence(ev, bytes(key.verify_key), log.root)  # a record whose payload is gone
