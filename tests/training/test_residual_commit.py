"""training/residual_commit.py: commitments to the error-feedback residual and the top-k replay check's
pieces (openings, the challenge sample, the claimed Δ, whether a payload is the compression of its decode
plus the opened residual)."""

from __future__ import annotations

import hashlib
import itertools
import math
import struct
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import Tensor

from gonka_node.aggregator.replay import verdict
from training.codec_base import _NUMEL, HEADER_SIZE, _pack_codes
from training.codecs import (
    ErrorFeedback,
    HeaderError,
    MalformedSectionError,
    PayloadSizeError,
    TopKCodec,
    get_codec,
)
from training.residual_commit import (
    ChunkLayout,
    claimed_delta,
    commitment_layout,
    compare,
    gather_chunks,
    open_chunks,
    payload_misfit,
    residual_root,
    root_of_leaves,
    sample_chunks,
    tensor_leaves,
    verify_opening,
    zero_root,
)

SPEC = {"a": (10, 30), "b": (100,), "c": (5,)}  # chunks of 64: a → 0..4 (the 5th short), b → 5, 6, c → 7
LAYOUT = ChunkLayout.of(SPEC, 64)
TOPK = "topk:chunk=64,k=8,bits=2"


def _tensors(seed: int, scale: float = 1.0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(s, generator=g) for n, s in SPEC.items()}


def _topk() -> TopKCodec:
    codec = get_codec(TOPK)
    assert isinstance(codec, TopKCodec)
    return codec


def test_the_layout_cuts_each_tensor_in_sorted_name_order() -> None:
    assert LAYOUT.n_chunks == 8
    assert LAYOUT.locate(4) == ("a", 256, 300)  # a tensor's last chunk is short; none straddles two
    assert LAYOUT.locate(5) == ("b", 0, 64)
    assert LAYOUT.locate(7) == ("c", 0, 5)
    with pytest.raises(IndexError, match="chunk 8 is outside the layout's 8 chunks"):
        LAYOUT.locate(8)


def test_an_opening_verifies_against_its_root_and_carries_the_chunks() -> None:
    residual = _tensors(1)
    root = residual_root(residual, LAYOUT)
    sample = (0, 4, 6, 7)
    opening = open_chunks(residual, LAYOUT, sample)
    assert verify_opening(root, opening, LAYOUT, sample)
    assert torch.equal(opening.values(), gather_chunks(residual, LAYOUT, sample))
    assert opening.values()[:64].tolist() == residual["a"].reshape(-1)[:64].tolist()
    assert not verify_opening(residual_root(_tensors(2), LAYOUT), opening, LAYOUT, sample)  # another root


def test_a_flipped_byte_a_wrong_index_or_a_wrong_path_fails() -> None:
    residual = _tensors(1)
    root = residual_root(residual, LAYOUT)
    good = open_chunks(residual, LAYOUT, (2, 5))
    flipped = bytearray(good.chunks[0])
    flipped[7] ^= 0x01
    assert not verify_opening(root, replace(good, chunks=(bytes(flipped), good.chunks[1])), LAYOUT, (2, 5))
    # chunk 2's bytes and path presented as chunk 3 (a leaf binds its index)
    moved = replace(good, indices=(3, 5))
    assert not verify_opening(root, moved, LAYOUT, (3, 5))
    assert not verify_opening(root, replace(good, paths=(good.paths[1], good.paths[0])), LAYOUT, (2, 5))
    assert not verify_opening(root, replace(good, paths=(good.paths[0][:-1], good.paths[1])), LAYOUT, (2, 5))
    assert not verify_opening(root, good, LAYOUT, (2, 6))  # not the challenged sample
    assert verify_opening(root, good, LAYOUT, (5, 2))


def test_a_committed_non_finite_residual_does_not_verify() -> None:
    residual = _tensors(1)
    residual["b"][3] = math.nan
    opening = open_chunks(residual, LAYOUT, (5,))
    assert not verify_opening(residual_root(residual, LAYOUT), opening, LAYOUT, (5,))


def test_the_zero_root_is_the_residual_before_round_one() -> None:
    zeros = {n: torch.zeros(s) for n, s in SPEC.items()}
    assert zero_root(LAYOUT) == residual_root(zeros, LAYOUT) == residual_root({}, LAYOUT)
    zeros["c"][4] = 1e-30
    assert residual_root(zeros, LAYOUT) != zero_root(LAYOUT)
    ef = ErrorFeedback(_topk())
    ef.compress(_tensors(3))
    assert ef.previous == {} and residual_root(ef.previous, LAYOUT) == zero_root(LAYOUT)


def test_the_sample_is_a_pure_function_of_the_seed_and_stays_in_range() -> None:
    a = sample_chunks(b"seed-1", 1000, 0.01, 4)
    assert a == sample_chunks(b"seed-1", 1000, 0.01, 4)
    assert len(a) == 10 and list(a) == sorted(set(a)) and all(0 <= i < 1000 for i in a)
    assert a != sample_chunks(b"seed-2", 1000, 0.01, 4)
    assert len(sample_chunks(b"seed-1", 100, 0.01, 4)) == 4  # the minimum
    assert sample_chunks(b"seed-1", 3, 0.01, 4) == (0, 1, 2)  # never more than there are
    with pytest.raises(ValueError, match="fraction in"):
        sample_chunks(b"seed-1", 100, 0.0, 4)
    # The draw the protocol states: sha256(tag ‖ seed ‖ j) mod n for j = 0, 1, …, repeats skipped.
    draws = [int.from_bytes(hashlib.sha256(b"gonka-residual-sample-v1" + b"seed-1" + j.to_bytes(8, "big")).digest()[:8],
                            "big") % 1000 for j in range(40)]
    assert set(a) == set(list(dict.fromkeys(draws))[:10])
    # More than half wanted: the complement of that many drawn left out.
    most = sample_chunks(b"seed-1", 10, 0.7, 1)
    left = [int.from_bytes(hashlib.sha256(b"gonka-residual-sample-v1" + b"seed-1" + j.to_bytes(8, "big")).digest()[:8],
                           "big") % 10 for j in range(40)]
    assert set(most) == set(range(10)) - set(list(dict.fromkeys(left))[:3]) and len(most) == 7


def test_a_saved_error_feedback_restores_both_residuals_and_an_older_save_has_no_previous() -> None:
    """A host restarted between its upload and the round's challenge still opens e_{r−1} and e_r: both
    come back from its saved state (a save from before `previous` existed loads with none)."""
    ef = ErrorFeedback(_topk(), decay=0.9)
    ef.compress(_tensors(1))
    ef.compress(_tensors(2))
    again = ErrorFeedback(_topk(), decay=0.9)
    again.load_state_dict(ef.state_dict())
    for mine, theirs in ((again.residual, ef.residual), (again.previous, ef.previous)):
        assert sorted(mine) == sorted(SPEC) and all(torch.equal(mine[n], theirs[n]) for n in SPEC)
    older = {k: v for k, v in ef.state_dict().items() if k != "previous"}
    again.load_state_dict(older)
    assert again.previous == {} and all(torch.equal(again.residual[n], ef.residual[n]) for n in SPEC)


def test_error_feedback_keeps_the_previous_residual_without_copying_it() -> None:
    ef = ErrorFeedback(_topk(), decay=0.9)
    ef.compress(_tensors(1))
    first = dict(ef.residual)
    ef.compress(_tensors(2))
    assert all(ef.previous[n] is first[n] for n in SPEC)
    bad = _tensors(3)
    bad["b"][0] = math.inf
    with pytest.raises(ValueError):
        ef.compress(bad)
    assert all(ef.previous[n] is first[n] for n in SPEC)  # a refused Δ changes neither residual


def _honest_rounds(decay: float, rounds: int) -> list[tuple[dict[str, Tensor], bytes, ErrorFeedback]]:
    """(Δ, payload, the feedback right after) per round; the residuals are copied (dicts of the tensors)."""
    ef, out = ErrorFeedback(_topk(), decay), []
    for r in range(rounds):
        delta = _tensors(10 + r, scale=1.0 + r)
        payload = ef.compress(delta)
        snap = ErrorFeedback(ef.codec, decay)
        snap.residual, snap.previous = dict(ef.residual), dict(ef.previous)
        out.append((delta, payload, snap))
    return out


def _claimed(decay: float, payload: bytes, ef: ErrorFeedback, sample: tuple[int, ...]) -> Tensor:
    decoded = _topk().decode(payload, SPEC)
    prev = {n: ef.previous.get(n, torch.zeros(s)) for n, s in SPEC.items()}
    return claimed_delta(gather_chunks(decoded, LAYOUT, sample), gather_chunks(prev, LAYOUT, sample),
                         gather_chunks(ef.residual, LAYOUT, sample), decay)


def test_an_honest_claimed_delta_is_the_hosts_delta_up_to_the_rounding_of_its_target() -> None:
    everything = tuple(range(LAYOUT.n_chunks))
    delta, payload, ef = _honest_rounds(1.0, 1)[0]
    got, want = _claimed(1.0, payload, ef, everything), gather_chunks(delta, LAYOUT, everything).double()
    unsent = gather_chunks(_topk().decode(payload, SPEC), LAYOUT, everything) == 0
    assert torch.equal(got[unsent], want[unsent])  # round 1, unsent: e_r is Δ itself, bit for bit
    for decay in (1.0, 0.9):
        for delta, payload, ef in _honest_rounds(decay, 4):
            got = _claimed(decay, payload, ef, everything)
            want = gather_chunks(delta, LAYOUT, everything).double()
            e_now = gather_chunks(ef.residual, LAYOUT, everything).double()
            target = gather_chunks(_topk().decode(payload, SPEC), LAYOUT, everything).double() + e_now
            # fp32 rounds the target d·e + Δ and e_r = target − decode once each: 2⁻²⁴ of each
            assert bool(((got - want).abs() <= 2.0**-23 * (target.abs() + e_now.abs())).all())
            cos, ratio = compare(got, want)
            assert cos > 1 - 1e-12 and abs(ratio - 1) < 1e-8


def test_a_host_that_skipped_training_fails_the_verdict() -> None:
    """It sends C(d·e_{r−1}) and keeps the truthful residual: Δ̂ is zero. A scaled Δ keeps the direction
    and fails on length. The old dense comparison fails the honest host too."""
    decay, sample = 0.9, sample_chunks(b"round-3", LAYOUT.n_chunks, 0.5, 2)
    rounds = _honest_rounds(decay, 3)
    delta, payload, ef = rounds[-1]
    replay = gather_chunks(delta, LAYOUT, sample)
    assert verdict(3, 0, *compare(_claimed(decay, payload, ef, sample), replay), 0.9, 0.1)[0]
    dense = compare(gather_chunks(_topk().decode(payload, SPEC), LAYOUT, sample), replay)
    assert not verdict(3, 0, *dense, 0.9, 0.1)[0]
    for scale in (0.0, 2.0):
        cheat = ErrorFeedback(_topk(), decay)
        cheat.residual = dict(ef.previous)
        sent = cheat.compress({n: scale * t for n, t in delta.items()})
        cos, ratio = compare(_claimed(decay, sent, cheat, sample), replay)
        assert not verdict(3, 0, cos, ratio, 0.9, 0.1)[0]
        assert ratio == pytest.approx(scale, abs=1e-6)


ONE = {"w": (256,)}  # four chunks of the codec's 64: one commitment chunk each
ONE_LAYOUT = ChunkLayout.of(ONE, 64)
EVERY = tuple(range(4))


def _honest_one(bits: int) -> tuple[TopKCodec, Tensor, bytes]:
    """(codec, the target it compressed, the honest payload) of one tensor."""
    codec = get_codec(f"topk:chunk=64,k=8,bits={bits}")
    assert isinstance(codec, TopKCodec)
    target = torch.randn(256, generator=torch.Generator().manual_seed(bits))
    return codec, target, codec.encode({"w": target})


def _forged(codec: TopKCodec, payload: bytes, scales: Callable[[np.ndarray], np.ndarray],
            codes: Callable[[np.ndarray], np.ndarray]) -> bytes:
    """`payload` with its chunk scales and entry codes rewritten (positions kept): what a host that
    sends one thing and parks the difference in its residual would sign."""
    at = HEADER_SIZE + _NUMEL.size
    kept = codec._entries(memoryview(payload)[at:], 256, "w")
    table = np.stack([kept.lo.numpy(), kept.hi.numpy()], 1)[:, : codec.scales]
    section = (scales(table).astype("<f4").tobytes()
               + _pack_codes(kept.idx.numpy().astype(np.uint32), codec.index_bits)
               + _pack_codes(codes(kept.codes.numpy()).astype(np.uint8), codec.bits))
    forged = payload[:at] + section
    assert len(forged) == len(payload)
    return forged


def _misfit(codec: TopKCodec, payload: bytes, residual: Tensor) -> str | None:
    return payload_misfit(codec, payload, ONE, ONE_LAYOUT, EVERY, residual)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_an_honest_residual_fits_the_payload_that_left_it(bits: int) -> None:
    codec, target, payload = _honest_one(bits)
    residual = target - codec.decode(payload, ONE)["w"]  # what ErrorFeedback keeps
    assert _misfit(codec, payload, residual) is None
    assert payload_misfit(codec, payload, ONE, ONE_LAYOUT, (2,), residual[128:192]) is None  # one chunk alone


def test_honest_residuals_fit_their_payloads_round_after_round() -> None:
    codec, everything = _topk(), tuple(range(LAYOUT.n_chunks))
    for decay in (1.0, 0.9):
        rounds = _honest_rounds(decay, 4)
        for (_, before, _), (_, payload, ef) in itertools.pairwise(rounds):
            prev = gather_chunks(ef.previous, LAYOUT, everything)
            assert payload_misfit(codec, before, SPEC, LAYOUT, everything, prev) is None
            now = gather_chunks(ef.residual, LAYOUT, everything)
            assert payload_misfit(codec, payload, SPEC, LAYOUT, everything, now) is None


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_a_payload_that_is_not_the_compression_of_decode_plus_residual_does_not_fit(bits: int) -> None:
    codec, target, payload = _honest_one(bits)
    sign = 1 << (bits - 1)
    # The review's forgery: every sent sign flipped at the smallest magnitude, the top scale inflated
    # (bits 1: the mean), the difference parked in the residual. Its claimed Δ is the honest one exactly.
    flipped = _forged(codec, payload, lambda t: t * ([50.0] if bits == 1 else [1.0, 1e6]),
                      lambda c: (c ^ sign) & ~(sign - 1) if bits > 1 else c ^ 1)
    assert _misfit(codec, flipped, target - codec.decode(flipped, ONE)["w"]) is not None
    # Signs kept, every magnitude at lo (bits 1: the mean inflated), hi inflated: scales not attained.
    flat = _forged(codec, payload, lambda t: t * ([3.0] if bits == 1 else [1.0, 1e6]), lambda c: c & sign)
    why = _misfit(codec, flat, target - codec.decode(flat, ONE)["w"])
    assert why is not None and ("mean" in why if bits == 1 else "scales" in why), why
    # A larger unsent target than the smallest sent one: not the top-k.
    residual = target - codec.decode(payload, ONE)["w"]
    unsent = int(torch.nonzero(codec.decode(payload, ONE)["w"][:64] == 0)[0])
    injected = residual.clone()
    injected[unsent] = 10 * float(target.abs().max())
    why = _misfit(codec, payload, injected)
    assert why is not None and "top-k" in why and "elements 0..64" in why, why


def test_a_sent_value_beyond_half_a_step_of_its_target_does_not_fit() -> None:
    codec, target, payload = _honest_one(4)
    decoded = codec.decode(payload, ONE)["w"]
    residual = target - decoded
    sent = torch.nonzero(decoded[:64]).flatten().tolist()
    lo, hi = sorted(float(decoded[i].abs()) for i in sent)[::len(sent) - 1]
    inner = next(i for i in sent if lo < float(decoded[i].abs()) < hi)  # moving it keeps lo and hi attained
    moved = residual.clone()
    moved[inner] += math.copysign((hi - lo) / codec.levels * 0.6, float(decoded[inner]))
    why = _misfit(codec, payload, moved)
    assert why is not None and "half a step" in why, why


def test_the_payload_must_be_the_codecs_and_the_layout_whole_codec_chunks() -> None:
    codec, target, payload = _honest_one(2)
    residual = target - codec.decode(payload, ONE)["w"]
    with pytest.raises(HeaderError):
        payload_misfit(codec, get_codec("topk:chunk=64,k=4,bits=2").encode({"w": target}), ONE, ONE_LAYOUT, EVERY,
                       residual)
    with pytest.raises(ValueError, match="whole codec chunks"):
        payload_misfit(codec, payload, ONE, ChunkLayout.of(ONE, 96), (0, 1, 2), residual)
    # The commitment's chunk: 4096 elements rounded up to whole codec chunks; 4096 for other codecs.
    chunks = {name: commitment_layout(ONE, get_codec(name)).chunk
              for name in ("topk:chunk=64,k=8", "topk:chunk=8192,k=8", "topk:chunk=1000,k=8", "int8")}
    assert chunks == {"topk:chunk=64,k=8": 4096, "topk:chunk=8192,k=8": 8192, "topk:chunk=1000,k=8": 5000,
                      "int8": 4096}


def test_the_tree_is_the_one_the_protocol_states() -> None:
    """leaf_i = sha256(LEAF_TAG ‖ uint64_be(i) ‖ fp32 LE bytes), node = sha256(NODE_TAG ‖ left ‖ right), an
    odd last node moves up unchanged."""
    layout = ChunkLayout.of({"w": (5,)}, 2)  # chunks [0, 1], [2, 3], [4]
    w = torch.arange(5, dtype=torch.float32)

    def leaf(i: int, values: list[float]) -> bytes:
        data = struct.pack(f"<{len(values)}f", *values)
        return hashlib.sha256(b"gonka-residual-leaf-v1" + i.to_bytes(8, "big") + data).digest()

    def node(left: bytes, right: bytes) -> bytes:
        return hashlib.sha256(b"gonka-residual-node-v1" + left + right).digest()

    want = node(node(leaf(0, [0.0, 1.0]), leaf(1, [2.0, 3.0])), leaf(2, [4.0]))
    assert residual_root({"w": w}, layout) == want
    assert residual_root({"w": w[:2]}, ChunkLayout.of({"w": (2,)}, 2)) == leaf(0, [0.0, 1.0])


def test_owners_leaves_joined_in_layout_order_give_the_one_process_root() -> None:
    """A sharded rig: each process hashes the tensors it owns (numbering chunks by the whole layout), rank
    0 joins the leaves by name; the root is the one a process holding the whole residual computes."""
    residual = _tensors(3)
    owners = [{"a": residual["a"], "c": residual["c"]}, {"b": residual["b"]}]
    leaves = {name: tensor_leaves(own, LAYOUT, name) for own in owners for name in own}
    assert [len(leaves[n]) for n in ("a", "b", "c")] == [5, 2, 1]
    joined = root_of_leaves([leaf for name in sorted(leaves) for leaf in leaves[name]])
    assert joined == residual_root(residual, LAYOUT) != zero_root(LAYOUT)
    assert tensor_leaves({}, LAYOUT, "b") == tensor_leaves({"b": torch.zeros(100)}, LAYOUT, "b")  # absent: zero
    with pytest.raises(ValueError, match="at least one element"):
        root_of_leaves([])


def test_a_one_bit_value_sent_with_the_opposite_sign_of_its_target_does_not_fit() -> None:
    # With bits = 1 a sent value's distance to its target is not bounded (only the mean magnitude is
    # stored): its sign is what pins it.
    codec, target, payload = _honest_one(1)
    flipped = _forged(codec, payload, lambda t: t, lambda c: np.concatenate([c[:1] ^ 1, c[1:]]))
    why = _misfit(codec, flipped, target - codec.decode(flipped, ONE)["w"])
    assert why is not None and "opposite sign" in why, why


def test_an_opening_against_a_malformed_part_is_refused_naming_its_tensor() -> None:
    codec = _topk()
    part = bytearray(codec.encode_tensor("b", _tensors(4)["b"]))
    part[8:12] = struct.pack("<f", math.nan)  # the first chunk's lo scale, right after the element count
    with pytest.raises(MalformedSectionError, match=r"tensor b has a non-finite or inconsistent chunk scale"):
        codec.residual_misfit(bytes(part), SPEC["b"], "b", [(0, 100)], torch.zeros(100))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_honest_residuals_fit_across_wide_ranges_ties_and_exact_half_steps(bits: int) -> None:
    # The fp32 rounding of the quantiser and of e = target − decode is what the check's 2⁻²⁰ margin
    # absorbs; plain Gaussian targets never need it, these do (a check without the margin fails them:
    # ties and exact half-steps with every element sent, a 10⁻³⁰..10²⁰ mix in short chunks).
    g = torch.Generator().manual_seed(bits)
    n = 200
    ties = torch.randint(-3, 4, (n,), generator=g).float() * 1e-3
    halves = torch.tensor([1.0, 2.0, 3.0])[torch.randint(0, 3, (n,), generator=g)] * torch.sign(
        torch.randn(n, generator=g))
    mixed = torch.randn(n, generator=g) * 1e-30
    mixed[::7] = torch.randn(len(mixed[::7]), generator=g) * 1e20
    wide = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 8)
    for targets, chunk, k in ((ties, 64, 64), (halves, 64, 64), (mixed, 8, 5), (wide, 8, 5), (wide, 64, 5)):
        codec = get_codec(f"topk:chunk={chunk},k={k},bits={bits}")
        assert isinstance(codec, TopKCodec)
        ef = ErrorFeedback(codec, 0.9)
        spans = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
        for r in range(6):
            part = ef.compress_tensor("w", targets * (1.0 + r))
            assert codec.residual_misfit(part, (n,), "w", spans, ef.residual["w"].reshape(-1)) is None, (chunk, k, r)
    codec = get_codec("topk:chunk=64,k=5,bits=2")
    assert isinstance(codec, TopKCodec)
    part = codec.encode_tensor("w", wide)
    residual = wide - codec.decode_tensor("w", part, (n,))
    residual[3] = math.nan  # a non-finite residual fits no payload (whatever checked it before)
    spans = [(s, min(s + 64, n)) for s in range(0, n, 64)]
    assert "finite" in (codec.residual_misfit(part, (n,), "w", spans, residual) or "")


# Edges the mutation run (scripts/mutation.sh residual) found untested: the refusals' exact one-line
# messages, odd trees, the sample's bounds and which draw it takes, the figures `compare` gives.

def test_a_layout_refuses_a_chunk_below_one_and_unsorted_names_and_takes_a_chunk_of_one() -> None:
    assert ChunkLayout.of({"w": (3,)}, 1).n_chunks == 3
    with pytest.raises(ValueError, match=r"^ChunkLayout: chunk must be >= 1, got 0$"):
        ChunkLayout((("w", 3),), 0)
    with pytest.raises(ValueError, match=r"^ChunkLayout: tensors must be in sorted name order$"):
        ChunkLayout((("b", 3), ("a", 3)))


def test_an_empty_layout_has_no_commitment() -> None:
    empty = ChunkLayout(())
    for root in (lambda: zero_root(empty), lambda: residual_root({}, empty), lambda: root_of_leaves([])):
        with pytest.raises(ValueError, match=r"^a residual commitment needs at least one element$"):
            root()
    one = ChunkLayout.of({"w": (3,)}, 4)  # a single chunk: its leaf is the root
    assert zero_root(one) == residual_root({"w": torch.zeros(3)}, one)


def test_a_missing_or_non_fp32_tensor_is_committed_as_its_fp32_bytes() -> None:
    residual = _tensors(5)
    absent = open_chunks({}, LAYOUT, (4, 7))  # chunk 4: a's short last chunk (elements 256..300)
    assert absent.chunks == (bytes(4 * 44), bytes(4 * 5))
    assert verify_opening(zero_root(LAYOUT), absent, LAYOUT, (4, 7))
    assert absent.values().dtype == torch.float32 and absent.values().tolist() == [0.0] * 49
    half = {n: t.to(torch.bfloat16) for n, t in residual.items()}  # read as the fp32 values it holds
    widened = {n: t.float() for n, t in half.items()}
    assert residual_root(half, LAYOUT) == residual_root(widened, LAYOUT)
    assert open_chunks(half, LAYOUT, (5,)).chunks == open_chunks(widened, LAYOUT, (5,)).chunks
    with pytest.raises(ValueError, match=r"^b: 99 elements, the layout has 100$"):
        tensor_leaves({"b": torch.zeros(99)}, LAYOUT, "b")


def test_the_odd_last_chunk_opens_with_a_shorter_path_and_no_path_may_be_longer() -> None:
    layout = ChunkLayout.of({"w": (5,)}, 1)  # five leaves: the last moves up twice unchanged
    residual = {"w": torch.arange(5, dtype=torch.float32)}
    root = residual_root(residual, layout)
    every = tuple(range(5))
    opening = open_chunks(residual, layout, every)
    assert [len(p) for p in opening.paths] == [3, 3, 3, 3, 1]
    assert verify_opening(root, opening, layout, every)
    longer = replace(opening, paths=(*opening.paths[:4], (*opening.paths[4], bytes(32))))
    assert not verify_opening(root, longer, layout, every)


def test_an_opening_missing_a_chunk_or_with_a_chunk_too_long_fails() -> None:
    residual = _tensors(1)
    root, good = residual_root(residual, LAYOUT), open_chunks(residual, LAYOUT, (2, 5))
    assert not verify_opening(root, replace(good, chunks=good.chunks[:1]), LAYOUT, (2, 5))
    assert not verify_opening(root, replace(good, chunks=(good.chunks[0] + bytes(4), good.chunks[1])), LAYOUT,
                              (2, 5))


def _protocol_draws(seed: bytes, n: int, count: int) -> set[int]:
    picked: list[int] = []  # the first `count` distinct draws, in order
    for j in itertools.count():
        i = int.from_bytes(hashlib.sha256(b"gonka-residual-sample-v1" + seed + j.to_bytes(8, "big")).digest()[:8],
                           "big") % n
        picked += [] if i in picked else [i]
        if len(picked) == count:
            return set(picked)
    raise AssertionError("unreachable")


def test_the_sample_draws_up_to_half_directly_and_refuses_bounds_outside_the_domain() -> None:
    assert set(sample_chunks(b"s", 10, 0.4, 1)) == _protocol_draws(b"s", 10, 4)
    assert set(sample_chunks(b"s", 10, 0.5, 1)) == _protocol_draws(b"s", 10, 5)  # half: still drawn
    assert set(sample_chunks(b"s", 10, 0.6, 1)) == set(range(10)) - _protocol_draws(b"s", 10, 4)
    assert sample_chunks(b"s", 1, 0.5, 1) == (0,)
    assert sample_chunks(b"s", 5, 1.0, 1) == (0, 1, 2, 3, 4)
    for n, fraction in ((0, 0.5), (5, 1.5)):
        with pytest.raises(ValueError, match=r"need n_chunks >= 1, minimum >= 1 and fraction in \(0, 1\]"):
            sample_chunks(b"s", n, fraction, 4)


def test_compare_gives_the_cosine_and_the_norm_ratio_and_zero_vectors_edges() -> None:
    cos, ratio = compare(torch.tensor([0.3, 0.4], dtype=torch.float64), torch.tensor([0.5, 0.0], dtype=torch.float64))  # norms below 1
    assert cos == pytest.approx(0.6, abs=1e-12) and ratio == pytest.approx(1.0, abs=1e-12)
    assert compare(torch.tensor([1.0, 0.0]), torch.zeros(2)) == (0.0, math.inf)
    assert compare(torch.zeros(2), torch.tensor([1.0, 0.0])) == (0.0, 0.0)


def test_the_claimed_delta_is_decode_plus_residual_minus_the_decayed_previous_one() -> None:
    decoded, e_prev, e_now = torch.tensor([1.0, 0.0]), torch.tensor([0.5, -2.0]), torch.tensor([0.25, 1.0])
    for decay in (0.5, 1.0, 2.0):
        want = [1.0 + 0.25 - decay * 0.5, 1.0 + decay * 2.0]
        assert claimed_delta(decoded, e_prev, e_now, decay).tolist() == want


def test_payload_misfit_refusals_say_which_codec_size_and_tensor() -> None:
    codec, target, payload = _honest_one(2)
    residual = target - codec.decode(payload, ONE)["w"]
    with pytest.raises(HeaderError, match=r"^payload_misfit: the header is not topk\(64, 8, 2\)'s for this spec$"):
        payload_misfit(codec, get_codec("topk:chunk=64,k=4,bits=2").encode({"w": target}), ONE, ONE_LAYOUT, EVERY,
                       residual)
    size = codec.encoded_size(ONE)
    with pytest.raises(PayloadSizeError, match=rf"^payload_misfit: {size - 1} bytes, expected {size}$"):
        payload_misfit(codec, payload[:-1], ONE, ONE_LAYOUT, EVERY, residual)
    nan_scale = _forged(codec, payload, lambda t: np.where(np.arange(t.size).reshape(t.shape) == 0, np.nan, t),
                        lambda c: c)
    with pytest.raises(MalformedSectionError, match=r"tensor w has a non-finite or inconsistent chunk scale"):
        payload_misfit(codec, nan_scale, ONE, ONE_LAYOUT, EVERY, residual)


def _fit(bits: int, target: Tensor, residual: Tensor | None = None, chunk: int = 64, k: int = 8,
         spans: list[tuple[int, int]] | None = None) -> str | None:
    """`residual_misfit` of the honest part of `target` (`topk:chunk=…,k=…`) against `residual` (default:
    the honest one), over `spans` (default: one span of every chunk)."""
    codec = get_codec(f"topk:chunk={chunk},k={k},bits={bits}")
    assert isinstance(codec, TopKCodec)
    n = target.numel()
    part = codec.encode_tensor("w", target)
    if residual is None:
        residual = target - codec.decode_tensor("w", part, (n,))
    return codec.residual_misfit(part, (n,), "w", spans or [(0, n)], residual)


def test_residual_misfit_refuses_a_span_that_is_not_whole_chunks_inside_its_tensor() -> None:
    codec = _topk()
    part = codec.encode_tensor("b", _tensors(4)["b"])
    for start, end in ((64, 64), (32, 64), (0, 128)):
        with pytest.raises(ValueError, match=rf"^residual_misfit: span {start}\.\.{end} of b is not whole chunks of 64$"):
            codec.residual_misfit(part, SPEC["b"], "b", [(start, end)], torch.zeros(end - start))


@pytest.mark.parametrize("bits", [1, 2])
def test_an_honest_span_of_many_chunks_of_different_scales_fits_chunk_by_chunk(bits: int) -> None:
    # 25 chunks of 8 (3 sent each) in one span, each chunk's scale 2⁻¹²..2¹² apart: every check is per chunk.
    g = torch.Generator().manual_seed(bits)
    target = torch.randn(200, generator=g) * (2.0 ** torch.arange(-12, 13)).repeat_interleave(8)
    assert _fit(bits, target, chunk=8, k=3) is None
    assert _fit(bits, target.flip(0), chunk=8, k=3, spans=[(0, 96), (96, 200)]) is None


@pytest.mark.parametrize("bits", [1, 2])
def test_an_all_zero_tensor_fits_its_all_zero_payload(bits: int) -> None:
    # Every scale, target and margin is 0 here: a check that refuses on equality would refuse it.
    assert _fit(bits, torch.zeros(100)) is None


def test_an_unsent_target_may_exceed_the_smallest_sent_one_by_2_to_the_minus_20_of_the_largest() -> None:
    # bits = 2: sent 1 (×7) and 2 (lo = 1, hi = 2, each decoded exactly), so the margin is 2·2⁻²⁰.
    target = torch.zeros(64)
    target[:8] = torch.tensor([1.0] * 7 + [2.0])
    for excess, fits in ((1.5 * 2.0**-20, True), (2.5 * 2.0**-20, False)):
        residual = target.clone()
        residual[:8] = 0.0
        residual[40] = 1.0 + excess  # an unsent element's target is its residual
        why = _fit(2, target, residual)
        assert (why is None) == fits, (excess, why)
        assert fits or "not its top-k" in (why or "")


def test_a_one_bit_scale_may_miss_its_sent_targets_mean_by_k_2_to_the_minus_23_of_it_plus_the_margin() -> None:
    # bits = 1: eight sent targets of 1, the scale 1. One target raised by 8δ moves the mean by δ; the
    # bound is lo·k·2⁻²³ + 2⁻²⁰·largest = 2⁻²⁰ + (1 + 8δ)·2⁻²⁰, just above 2·2⁻²⁰.
    target = torch.zeros(64)
    target[:8] = 1.0
    for delta, fits in ((1.75 * 2.0**-20, True), (2.25 * 2.0**-20, False)):
        residual = torch.zeros(64)
        residual[3] = 8 * delta
        why = _fit(1, target, residual)
        assert (why is None) == fits, (delta, why)
        assert fits or "not the mean" in (why or "")


def test_a_sign_flip_within_the_margin_of_2_to_the_minus_20_of_the_largest_fits_and_beyond_it_does_not() -> None:
    # bits = 2: sent 2⁻²⁰ (= lo, decoded exactly) and 1 (×7, = hi), so the margin is exactly 2⁻²⁰.
    target = torch.zeros(64)
    target[:8] = torch.tensor([2.0**-20] + [1.0] * 7)
    for flipped_to, fits in ((-(2.0**-20), True), (-(2.0**-19), False)):
        residual = torch.zeros(64)
        residual[0] = flipped_to - 2.0**-20  # the sent +2⁻²⁰'s target is now `flipped_to`
        why = _fit(2, target, residual)
        assert (why is None) == fits, (flipped_to, why)
        assert fits or "opposite sign" in (why or "")


def test_a_tensor_s_leaves_hashed_on_several_threads_are_each_chunk_s_in_order() -> None:
    # 2,001 chunks of 64 (the last short): more than one thread's share, so the pool splits them.
    spec = {"big": (2000 * 64 + 5,), "small": (3,)}
    layout = ChunkLayout.of(spec, 64)
    g = torch.Generator().manual_seed(4)
    residual = {n: torch.randn(s, generator=g) for n, s in spec.items()}
    flat = residual["big"].numpy().astype("<f4").tobytes()
    expected = [hashlib.sha256(b"gonka-residual-leaf-v1" + i.to_bytes(8, "big") + flat[i * 256 : (i + 1) * 256]).digest()
                for i in range(2001)]
    assert tensor_leaves(residual, layout, "big") == expected
    assert residual_root(residual, layout) == root_of_leaves(expected + tensor_leaves(residual, layout, "small"))
