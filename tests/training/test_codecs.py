"""Codecs: error bounds, exact sizes, strict decoding of garbage, error feedback."""

from __future__ import annotations

import struct

import pytest
import torch

from training.codecs import (
    CODEC_NAMES,
    HEADER_SIZE,
    BlockQuantCodec,
    Codec,
    CodecError,
    ErrorFeedback,
    TopKCodec,
    get_codec,
    spec_of,
)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 33, generator=g) * 0.01,
        "model.norm.weight": torch.randn(7, generator=g),
        "empty": torch.zeros(0, 3),
        "zeros": torch.zeros(130),
    }


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_every_codec_round_trips_with_the_exact_announced_size(name: str) -> None:
    codec = get_codec(name)
    tensors = _tensors()
    payload = codec.encode(tensors)
    assert len(payload) == codec.encoded_size(spec_of(tensors))
    decoded = codec.decode(payload, spec_of(tensors))
    assert list(decoded) == sorted(tensors)
    for key, t in tensors.items():
        assert decoded[key].shape == t.shape and decoded[key].dtype == torch.float32
    assert torch.equal(decoded["zeros"], tensors["zeros"])  # an all-zero tensor stays exactly zero
    assert codec.encode(tensors) == payload  # encoding is deterministic


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_the_sparse_decode_lists_exactly_the_dense_decode_s_entries_that_are_not_plus_zero(name: str) -> None:
    # What an outer step taken ahead of its update finishes with (training.diloco.SpeculativeStep): every
    # position the dense decode fills with anything but +0, with its value bit for bit; positions a codec
    # kept with the value +0 may be listed too (stepping them changes nothing).
    codec = get_codec(name).for_round(7)
    tensors = _tensors()
    tensors["model.norm.weight"][2] = -0.0
    payload = codec.encode(tensors)
    dense, sparse = codec.decode(payload, spec_of(tensors)), codec.decode_sparse(payload, spec_of(tensors))
    assert list(sparse) == sorted(tensors)
    for key, t in dense.items():
        positions, values = sparse[key]
        assert positions.dtype == torch.int64 and values.dtype == torch.float32
        flat = t.reshape(-1)
        rebuilt = torch.zeros_like(flat)
        rebuilt[positions] = values
        assert torch.equal(rebuilt.view(torch.int32), flat.view(torch.int32)), key
        assert len(set(positions.tolist())) == positions.numel()
        listed = torch.zeros(flat.numel(), dtype=torch.bool)
        listed[positions] = True
        assert bool(listed[flat.view(torch.int32) != 0].all()), key
    with pytest.raises(CodecError, match="truncated"):
        codec.decode_sparse(payload[:-1], spec_of(tensors))
    # Which codecs an outer step is taken ahead for: 1/32 of the entries, not a quarter, not all.
    assert codec.sparse == (name == "topk")


def test_fp32_is_lossless_and_bf16_within_half_an_ulp() -> None:
    tensors = _tensors()
    exact = get_codec("fp32").decode(get_codec("fp32").encode(tensors), spec_of(tensors))
    assert all(torch.equal(exact[k], tensors[k]) for k in tensors)
    half = get_codec("bf16").decode(get_codec("bf16").encode(tensors), spec_of(tensors))
    for k, t in tensors.items():
        assert torch.equal(half[k], t.to(torch.bfloat16).float())  # what torch's RNE conversion gives
        assert ((half[k] - t).abs() <= t.abs() * 2.0**-8).all()


@pytest.mark.parametrize(("bits", "block"), [(8, 128), (8, 5), (4, 64), (4, 3)])
def test_block_quantization_error_is_at_most_half_a_step_per_block(bits: int, block: int) -> None:
    codec = BlockQuantCodec(bits, block)
    x = _tensors()["model.layers.0.mlp.up_proj.weight"]
    y = codec.decode(codec.encode({"x": x}), {"x": tuple(x.shape)})["x"]
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    for start in range(0, flat_x.numel(), block):
        xb, yb = flat_x[start : start + block], flat_y[start : start + block]
        half_step = xb.abs().max() / codec.qmax / 2
        assert (xb - yb).abs().max() <= half_step * (1 + 1e-6)
        assert yb.abs().max() == pytest.approx(xb.abs().max().item(), rel=1e-6)  # the absmax survives


def test_exact_byte_counts_written_out() -> None:
    spec = {"w": (10, 10), "b": (3,)}
    # header 32, then per tensor 8 bytes of numel plus the section:
    assert get_codec("fp32").encoded_size(spec) == 32 + (8 + 400) + (8 + 12)
    assert get_codec("bf16").encoded_size(spec) == 32 + (8 + 200) + (8 + 6)
    # int8, block 64: w has 2 blocks (8 bytes of scales) + 100 codes; b has 1 block + 3 codes
    assert get_codec("int8:block=64").encoded_size(spec) == 32 + (8 + 8 + 100) + (8 + 4 + 3)
    # int4, block 64: 50 bytes of codes for 100 elements, 2 bytes for 3 elements
    assert get_codec("int4:block=64").encoded_size(spec) == 32 + (8 + 8 + 50) + (8 + 4 + 2)
    # topk chunk 64, k 4, 2-bit values: w = chunks of 64 and 36 → 8 kept, 6-bit positions (6 bytes),
    # 2-bit values (2 bytes), (lo, hi) per chunk (16 bytes); b = 1 chunk of 3 → 3 kept: 18 bits → 3 bytes,
    # 6 bits → 1 byte, 8 bytes of scales
    assert get_codec("topk:chunk=64,k=4,bits=2").encoded_size(spec) == 32 + (8 + 16 + 6 + 2) + (8 + 8 + 3 + 1)


def test_topk_keeps_the_largest_entries_per_chunk_with_two_level_magnitudes() -> None:
    codec = TopKCodec(chunk=8, k=2, bits=2)
    x = torch.tensor([0.1, -5.0, 0.2, 0.0, 3.0, 0.0, 0.0, 0.0, 1.0, -2.0, 0.5])  # chunks of 8 and 3
    y = codec.decode(codec.encode({"x": x}), {"x": (11,)})["x"]
    # chunk 1 keeps -5 and 3 (lo 3, hi 5: both exact); chunk 2 keeps 1 and -2 (lo 1, hi 2)
    assert y.tolist() == [0.0, -5.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 1.0, -2.0, 0.0]


def test_topk_magnitudes_snap_to_the_nearest_grid_level() -> None:
    codec = TopKCodec(chunk=4, k=4, bits=4)  # 7 steps between lo and hi
    x = torch.tensor([1.0, 8.0, -4.4, 2.0])  # lo 1, hi 8, step 1: 4.4 → 4, 2 → 2
    y = codec.decode(codec.encode({"x": x}), {"x": (4,)})["x"]
    assert y.tolist() == [1.0, 8.0, -4.0, 2.0]


def test_topk_one_bit_sends_signs_times_the_chunk_mean_magnitude() -> None:
    codec = TopKCodec(chunk=8, k=2, bits=1)
    x = torch.tensor([0.1, -5.0, 0.2, 0.0, 3.0, 0.0, 0.0, 0.0, 1.0, -2.0, 0.5])  # chunks of 8 and 3
    payload = codec.encode({"x": x})
    # one fp32 per chunk (8 bytes), 4 kept × 3-bit positions → 2 bytes, 4 sign bits → 1 byte
    assert len(payload) == codec.encoded_size({"x": (11,)}) == HEADER_SIZE + 8 + (8 + 2 + 1)
    y = codec.decode(payload, {"x": (11,)})["x"]
    # chunk 1 keeps -5 and 3 (mean magnitude 4); chunk 2 keeps 1 and -2 (mean magnitude 1.5)
    assert y.tolist() == [0.0, -4.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0, 1.5, -1.5, 0.0]
    with pytest.raises(CodecError, match="scale"):
        codec.decode(_patch(payload, HEADER_SIZE + 8, struct.pack("<f", -1.0)), {"x": (11,)})


def test_topk_two_bit_payloads_are_unchanged_by_the_one_bit_option() -> None:
    # The protocol's existing topk bytes: a golden payload pinned before bits = 1 existed.
    x = torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0, -4.0])
    payload = TopKCodec(chunk=4, k=2, bits=2).encode({"x": x})
    assert payload[HEADER_SIZE:].hex() == (
        "0600000000000000" + "0000803f" + "00000040" + "00004040" + "00008040" + "4d" + "c4"
    )


def _payload(codec: Codec) -> tuple[bytes, dict[str, tuple[int, ...]]]:
    tensors = {"w": torch.linspace(-1, 1, 100).reshape(10, 10), "b": torch.tensor([0.5, -0.25, 2.0])}
    return codec.encode(tensors), spec_of(tensors)


def _patch(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new) :]


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_garbage_truncation_and_trailing_bytes_raise_codec_error(name: str) -> None:
    codec = get_codec(name)
    payload, spec = _payload(codec)
    cases = {
        "shorter than": payload[:10],
        "bad magic": b"XXXX" + payload[4:],
        "version": _patch(payload, 4, b"\x09"),
        "encoded with codec": _patch(payload, 5, bytes([99])),
        "reserved": _patch(payload, 6, b"\x01\x00"),
        "truncated": payload[:-1],
        "trailing bytes": payload + b"\x00",
        "different tensor spec": payload[:24] + b"\xff" * 8 + payload[32:],
        "claims": _patch(payload, HEADER_SIZE, struct.pack("<Q", 4)),  # "b" is first in sorted order
    }
    for message, data in cases.items():
        with pytest.raises(CodecError, match=message):
            codec.decode(data, spec)
    with pytest.raises(CodecError, match="different tensor spec"):
        codec.decode(payload, {**spec, "w": (100,)})
    with pytest.raises(CodecError, match="encoded with codec"):
        codec.decode(
            get_codec("fp32" if name != "fp32" else "bf16").encode({"b": torch.zeros(3)}), {"b": (3,)}
        )


def test_parameter_mismatch_is_rejected() -> None:
    payload, spec = _payload(get_codec("int8:block=64"))
    with pytest.raises(CodecError, match="parameters"):
        get_codec("int8:block=128").decode(payload, spec)


def test_non_finite_values_and_bad_scales_are_rejected() -> None:
    first = HEADER_SIZE + 8  # the first section in sorted order is tensor "b"
    payload, spec = _payload(get_codec("fp32"))
    with pytest.raises(CodecError, match="NaN or infinity"):
        get_codec("fp32").decode(_patch(payload, first, struct.pack("<f", float("nan"))), spec)
    payload, spec = _payload(get_codec("bf16"))
    with pytest.raises(CodecError, match="NaN or infinity"):
        get_codec("bf16").decode(_patch(payload, first, b"\x80\x7f"), spec)  # bf16 +inf
    for name in ("int8", "int4"):
        payload, spec = _payload(get_codec(name))
        with pytest.raises(CodecError, match="block scale"):
            get_codec(name).decode(_patch(payload, first, struct.pack("<f", float("inf"))), spec)
        with pytest.raises(CodecError, match="block scale"):
            get_codec(name).decode(_patch(payload, first, struct.pack("<f", -1.0)), spec)
    payload, spec = _payload(get_codec("int8"))
    with pytest.raises(CodecError, match="code 0"):
        get_codec("int8").decode(_patch(payload, first + 4, b"\x00"), spec)


def test_topk_positions_are_checked() -> None:
    codec = TopKCodec(chunk=4, k=2, bits=2)
    spec = {"x": (6,)}  # chunks of 4 and 2: positions are 2 bits each, 4 kept entries → 1 byte
    payload = codec.encode({"x": torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0, -4.0])})
    positions_at = HEADER_SIZE + 8 + 16
    assert payload[positions_at] == 0b01_00_11_01  # chunk 1 keeps 1 and 3, chunk 2 keeps 0 and 1
    with pytest.raises(CodecError, match="out of range"):
        codec.decode(_patch(payload, positions_at, bytes([0b11_00_11_01])), spec)  # position 3 in a 2-chunk
    with pytest.raises(CodecError, match="strictly increasing"):
        codec.decode(_patch(payload, positions_at, bytes([0b01_00_01_01])), spec)  # 1, 1 in chunk 1
    with pytest.raises(CodecError, match="scale"):
        codec.decode(_patch(payload, HEADER_SIZE + 8, struct.pack("<ff", 2.0, 1.0)), spec)  # lo > hi
    # 4 values of 2 bits fill one byte exactly; a 3-element tensor leaves padding bits that must be zero
    three = codec.encode({"x": torch.tensor([1.0, 2.0, 3.0])})
    with pytest.raises(CodecError, match="padding"):
        codec.decode(three[:-1] + bytes([three[-1] | 0b1100_0000]), {"x": (3,)})


@pytest.mark.parametrize("bits", [2, 1])
def test_error_feedback_recovers_what_topk_dropped_over_rounds(bits: int) -> None:
    codec = TopKCodec(chunk=64, k=2, bits=bits)  # keeps 1/32 of the entries, 2-bit or sign-only values
    g = torch.Generator().manual_seed(1)
    base = torch.randn(4, 64, generator=g)  # a persistent direction, like a slowly varying gradient
    inputs = [{"w": base + 0.3 * torch.randn(4, 64, generator=g)} for _ in range(200)]
    ef, total_in = ErrorFeedback(codec), torch.zeros(4, 64)
    with_ef, without_ef = torch.zeros(4, 64), torch.zeros(4, 64)
    for delta in inputs:
        total_in += delta["w"]
        with_ef += codec.decode(ef.compress(delta), {"w": (4, 64)})["w"]
        without_ef += codec.decode(codec.encode(delta), {"w": (4, 64)})["w"]
    rel = lambda s: ((s - total_in).norm() / total_in.norm()).item()  # noqa: E731
    assert rel(with_ef) < 0.1 < 0.5 < rel(without_ef)
    # nothing is lost: what was sent plus what is still held equals what came in (up to fp32 rounding)
    assert torch.allclose(with_ef + ef.residual["w"], total_in, atol=1e-3)


def test_error_feedback_state_round_trips() -> None:
    codec = get_codec("int4")
    ef = ErrorFeedback(codec, decay=0.9)
    ef.compress({"w": torch.randn(50)})
    restored = ErrorFeedback(codec, decay=0.9)
    restored.load_state_dict(ef.state_dict())
    nxt = {"w": torch.randn(50)}
    assert restored.compress(nxt) == ef.compress(nxt)
    with pytest.raises(ValueError, match="decay"):
        ErrorFeedback(codec, decay=1.0).load_state_dict(ef.state_dict())


def test_get_codec_parses_options_and_rejects_unknown_ones() -> None:
    assert get_codec("topk:chunk=1024,k=16,bits=4").params() == (1024, 16, 4)
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("zip")
    with pytest.raises(ValueError, match="key=integer"):
        get_codec("int8:block")
    with pytest.raises(ValueError, match="does not take"):
        get_codec("fp32:block=3")
    with pytest.raises(ValueError, match="k must be"):
        get_codec("topk:chunk=8,k=9")
    with pytest.raises(ValueError, match="NaN"):
        get_codec("fp32").encode({"w": torch.tensor([float("inf")])})


def test_shared_mask_sends_each_entry_once_per_cycle_without_positions() -> None:
    base = get_codec("mask:stride=4,bits=2,chunk=16")
    n = 1000
    counts = torch.zeros(n)
    for round_seed in range(8, 12):  # one whole cycle
        counts[base.for_round(round_seed).mask(n, "w")] += 1
    assert torch.equal(counts, torch.ones(n))
    codec = base.for_round(9)
    sent = len(codec.mask(n, "w"))
    assert 200 < sent < 300  # about a quarter
    # 2 bits per sent value and one fp32 step per 16 sent values: no positions at all
    assert codec.encoded_size({"w": (n,)}) == 32 + 8 + 4 * -(-sent // 16) + -(-sent * 2 // 8)
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    y = codec.decode(codec.encode({"w": x}), {"w": (n,)})["w"]
    on = torch.zeros(n, dtype=torch.bool)
    on[codec.mask(n, "w")] = True
    assert torch.equal(y[~on], torch.zeros(int((~on).sum())))
    assert ((y[on] - x[on]).square().mean() / x[on].square().mean()).item() < 0.15  # ≈ 0.119 for Gaussian
    one_step = base.for_round(9).__class__(stride=4, bits=2, chunk=1024, seed=9)  # one step for all values
    z = one_step.decode(one_step.encode({"w": x}), {"w": (n,)})["w"][on]
    assert set((z.abs() / z.abs().min()).tolist()) == {1.0, 3.0}  # levels ±step/2, ±3·step/2


def test_shared_mask_payload_is_bound_to_its_round() -> None:
    base = get_codec("mask:stride=4")
    payload = base.for_round(5).encode({"w": torch.randn(100)})
    with pytest.raises(CodecError, match="parameters"):
        base.for_round(6).decode(payload, {"w": (100,)})


def test_error_feedback_with_a_shared_mask_delivers_everything_each_cycle() -> None:
    base = get_codec("mask:stride=4,bits=4")
    ef = ErrorFeedback(base)
    delta = torch.randn(500, generator=torch.Generator().manual_seed(0))
    total = torch.zeros(500)
    for round_seed, d in enumerate([delta, torch.zeros(500), torch.zeros(500), torch.zeros(500)]):
        codec = base.for_round(round_seed)
        total += codec.decode(ef.compress({"w": d}, codec), {"w": (500,)})["w"]
    # one Δ, then nothing: within one cycle each entry was sent once and carried its share (4-bit error)
    assert ((total - delta).norm() / delta.norm()).item() < 0.15
    assert torch.allclose(total + ef.residual["w"], delta, atol=1e-6)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_a_payload_is_its_header_and_independent_per_tensor_parts(name: str) -> None:
    # What lets a rig's processes encode the tensors they own and rank 0 just concatenate.
    codec = get_codec(name).for_round(12)
    tensors = _tensors(3)
    parts = {n: codec.encode_tensor(n, tensors[n]) for n in reversed(sorted(tensors))}  # any order
    assert codec.header(spec_of(tensors)) + b"".join(parts[n] for n in sorted(parts)) == codec.encode(tensors)
    for n, part in parts.items():
        assert torch.equal(codec.decode_tensor(n, part, tuple(tensors[n].shape)), codec.decode(
            codec.encode(tensors), spec_of(tensors))[n])
    with pytest.raises(CodecError, match=r"part of model.norm.weight is \d+ bytes, expected"):
        codec.decode_tensor("model.norm.weight", parts["model.norm.weight"][:-1], (7,))


def test_error_feedback_per_tensor_parts_equal_the_whole_payload_and_nan_changes_nothing() -> None:
    codec = get_codec("int4")
    whole, parted = ErrorFeedback(codec, 0.9), ErrorFeedback(codec, 0.9)
    for seed in (1, 2):
        delta = _tensors(seed)
        payload = whole.compress(delta)
        parts = b"".join(parted.compress_tensor(n, delta[n]) for n in sorted(delta))
        assert codec.header(spec_of(delta)) + parts == payload
        for n in delta:
            assert torch.equal(parted.residual[n], whole.residual[n])
    before = {n: t.clone() for n, t in whole.residual.items()}
    bad = _tensors(4)
    bad["zeros"][5] = float("nan")  # sorted after the first two names: they were compressed already
    with pytest.raises(ValueError, match="zeros contains NaN"):
        whole.compress(bad)
    assert all(torch.equal(whole.residual[n], before[n]) for n in before)


@pytest.mark.parametrize("name", [*CODEC_NAMES, "topk:chunk=64,k=5,bits=1", "topk:chunk=100,k=7,bits=4"])
def test_encode_kept_is_the_part_and_exactly_what_decoding_it_gives(name: str) -> None:
    # Error feedback's residual and an eager host's own forecast come from what the encoder kept, not
    # from decoding the bytes it wrote: that must be the decode bit for bit (signed zeros included), as
    # (positions, values) for a sparse codec.
    codec = get_codec(name).for_round(5)
    tensors = _tensors(6)
    tensors["model.norm.weight"][3] = -0.0
    tensors["tail"] = torch.randn(3, 4096 + 17, generator=torch.Generator().manual_seed(2))  # a short last chunk
    for key, t in tensors.items():
        part, kept = codec.encode_kept(key, t)
        assert part == codec.encode_tensor(key, t)
        if codec.sparse:
            assert isinstance(kept, tuple)
            positions, values = codec.decode_sparse(codec.header({key: tuple(t.shape)}) + part, {key: tuple(t.shape)})[key]
            assert torch.equal(kept[0], positions), key
            assert torch.equal(kept[1].view(torch.int32), values.view(torch.int32)), key
        else:
            assert isinstance(kept, torch.Tensor) and kept.shape == t.shape
            decoded = codec.decode_tensor(key, part, tuple(t.shape))
            assert torch.equal(kept.view(torch.int32), decoded.view(torch.int32)), key


@pytest.mark.parametrize("name", ["topk:chunk=64,k=4,bits=2", "topk:chunk=64,k=4,bits=1", "int8"])
def test_error_feedback_keeps_the_target_less_the_decoded_payload_bit_for_bit(name: str) -> None:
    codec = get_codec(name)
    ef, held = ErrorFeedback(codec), {}
    g = torch.Generator().manual_seed(3)
    for round_ in range(3):
        delta = {"w": torch.randn(5, 70, generator=g), "b": torch.randn(9, generator=g)}
        delta["b"][4] = -0.0  # round 0: −0 kept where nothing is sent (−0 − (+0) is −0)
        payload = ef.compress(delta)
        decoded = codec.decode(payload, spec_of(delta))
        for n, d in delta.items():
            target = held[n] + d if n in held else d.clone()
            assert torch.equal(ef.residual[n].view(torch.int32), (target - decoded[n]).view(torch.int32)), n
            held[n] = ef.residual[n]
        if round_ == 0:
            assert int(decoded["b"].view(torch.int32)[4]) == 0
            assert int(ef.residual["b"].view(torch.int32)[4]) == -(1 << 31)  # −0's bits, not +0's


def test_the_finite_check_finds_nan_and_either_infinity_anywhere() -> None:
    from training.codec_base import all_finite

    assert all_finite(torch.zeros(0)) and all_finite(torch.randn(1000)) and all_finite(torch.tensor([-0.0, 3e38]))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 517, 999):
            t = torch.randn(1000)
            t[at] = bad
            assert not all_finite(t), (bad, at)
            with pytest.raises(ValueError, match="w contains NaN or infinity"):
                get_codec("topk").encode_tensor("w", t)


@pytest.mark.parametrize("width", range(1, 17))
def test_packed_codes_are_bit_for_bit_the_little_endian_bit_stream_and_read_back(width: int) -> None:
    """Whatever path packs a width (whole bytes, 64-bit groups, single bits), the bytes are the codes'
    bits in little-endian order, zero-padded: the reference below, numpy's packbits of every bit."""
    import numpy as np

    from training.codec_base import _pack_codes, _unpack_codes

    rng = np.random.default_rng(width)
    for count in (0, 1, 2, 3, 7, 8, 9, 63, 1001):
        codes = rng.integers(0, 1 << width, count).astype(np.uint32)
        bits = (codes[:, None] >> np.arange(width, dtype=np.uint32)) & 1
        reference = np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little").tobytes()
        packed = _pack_codes(codes, width)
        assert packed == reference
        assert np.array_equal(_unpack_codes(memoryview(packed), count, width, "c", "t").astype(np.int64), codes)
        if (count * width) % 8:  # a set padding bit is refused, whichever path reads it
            spoiled = packed[:-1] + bytes([packed[-1] | 0x80])
            with pytest.raises(CodecError, match="non-zero padding bits"):
                _unpack_codes(memoryview(spoiled), count, width, "c", "t")


@pytest.mark.parametrize("name", ["topk:chunk=64,k=4,bits=2", "int8"])
@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_error_feedback_that_consumes_its_delta_sends_and_keeps_the_same_bits(name: str, decay: float) -> None:
    """`consume=True` (the worker's Δ, read no more) makes each residual in Δ's own memory instead of a new
    tensor: the payload and the residual are the same bits as without, and Δ is left alone without it."""
    codec = get_codec(name)
    plain, consuming = ErrorFeedback(codec, decay), ErrorFeedback(codec, decay)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        delta = {"w": torch.randn(5, 70, generator=g), "b": torch.randn(9, generator=g)}
        delta["b"][4] = -0.0
        kept = {n: t.clone() for n, t in delta.items()}
        given = {n: t.clone() for n, t in delta.items()}
        assert consuming.compress(given, consume=True) == plain.compress(delta)
        for n in delta:
            assert torch.equal(consuming.residual[n].view(torch.int32), plain.residual[n].view(torch.int32)), n
            assert consuming.residual[n].data_ptr() == given[n].data_ptr()  # made in Δ's memory
            assert plain.residual[n].data_ptr() != delta[n].data_ptr()
            assert torch.equal(delta[n].view(torch.int32), kept[n].view(torch.int32))  # not consumed: untouched


def test_topk_selects_the_same_entries_a_block_of_rows_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_select` takes rows a block at a time through a reused scratch buffer: the same part, ties
    (a chunk of zeros, one of repeated magnitudes) and a short last chunk included."""
    import training.codecs_sparse as sparse

    codec = TopKCodec(chunk=64, k=5, bits=2)
    t = torch.randn(37 * 64 + 9, generator=torch.Generator().manual_seed(5))
    t[:64] = 0.0
    t[64:128] = torch.round(t[64:128] * 2) / 2
    whole_part, (whole_at, whole_values) = codec.encode_kept("w", t)
    monkeypatch.setattr(sparse, "_SELECT_BLOCK", 3 * 64)  # 3 rows a block: 12 blocks, the last one short
    part, (at, values) = codec.encode_kept("w", t)
    assert part == whole_part and torch.equal(at, whole_at) and torch.equal(values, whole_values)
    assert sparse._scratches.buffer.numel() >= 3 * 64  # the blocks went through the scratch


def _block_quant_reference(codec: BlockQuantCodec, x: torch.Tensor) -> bytes:
    """The section as BlockQuantCodec wrote it in one piece, before it encoded a slab at a time."""
    import numpy as np

    from training.codec_base import _ceil_div, _pack_codes

    n = x.numel()
    blocks = torch.nn.functional.pad(x, (0, _ceil_div(n, codec.block) * codec.block - n)).view(-1, codec.block)
    scale = blocks.abs().amax(dim=1) / codec.qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe[:, None]).clamp_(-codec.qmax, codec.qmax).reshape(-1)[:n]
    codes = (q.to(torch.int64) + codec.qmax + 1).numpy().astype(np.uint8)
    return scale.numpy().astype("<f4").tobytes() + _pack_codes(codes, codec.bits)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_block_quant_writes_the_same_section_a_slab_at_a_time_and_keeps_its_decode(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import training.codecs_dense as dense

    codec = get_codec(name)
    assert isinstance(codec, BlockQuantCodec)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5 * codec.block + 37, generator=g) * 1e-3  # a short last block
    x[: codec.block] = 0.0  # a block of zeros: scale 0
    x[codec.block : 2 * codec.block] = -0.0  # of negative zeros: kept as +0, as decoded
    x[3 * codec.block] = 3e38  # a large value among small ones
    for slab in (1 << 22, codec.block, 2 * codec.block, 3):  # one slab, a block each, two, below a block
        monkeypatch.setattr(dense, "_SLAB", slab)
        section, kept = codec._encode_flat_kept(x, "w")
        assert section == _block_quant_reference(codec, x) == codec._encode_flat(x, "w"), slab
        decoded = codec._decode_flat(memoryview(section), x.numel(), "w")
        assert torch.equal(kept.view(torch.int32), decoded.view(torch.int32)), slab


@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_the_squares_of_delta_come_out_of_compress_as_sum_of_squares_gives_them_in_every_path(decay: float) -> None:
    """Δ's Σ x² for its norm is taken while compress reads Δ (consumed, with a residual to add) or on its
    own (first round, or Δ not given up): `sum_of_squares`' value to the bit either way."""
    from training.diloco import add_measuring, sum_of_squares

    g = torch.Generator().manual_seed(7)
    ef = ErrorFeedback(get_codec("topk:chunk=64,k=4,bits=2"), decay)
    for round_, consume in enumerate((True, True, False)):
        delta = {"w": torch.randn(3 * 65536 + 5, generator=g), "b": torch.randn(9, generator=g)}  # several slices
        want = {n: sum_of_squares(t) for n, t in delta.items()}
        squares: dict[str, float] = {}
        ef.compress(delta, consume=consume, squares=squares)
        assert squares == want, round_
    t, other = torch.randn(70000, generator=g), torch.randn(70000, generator=g)
    before, expected = t.clone(), t + other * torch.tensor(decay)
    assert add_measuring(t, other, decay) == sum_of_squares(before)  # of t as it was
    assert torch.equal(t.view(torch.int32), expected.view(torch.int32))
    with pytest.raises(ValueError, match="two contiguous fp32 tensors of one shape"):
        add_measuring(torch.zeros(4, 3).t(), torch.zeros(3, 4))


def test_a_consumed_delta_is_used_only_when_it_is_all_of_its_storage_and_not_the_residual() -> None:
    """A view into a larger tensor (a rig's gathered rows) would be saved whole with the residual made in
    it: such a Δ gets a fresh residual. A Δ that is the residual itself is refused, the state unchanged."""
    ef = ErrorFeedback(get_codec("int8"))
    ef.compress({"w": torch.randn(300), "e": torch.zeros(0)})
    rows = torch.randn(400)
    view = rows[:300]
    ef.compress({"w": view, "e": torch.zeros(0)}, consume=True)
    assert ef.residual["w"].untyped_storage().nbytes() == 300 * 4
    before = ef.residual["w"].clone()
    with pytest.raises(ValueError, match="w's Δ is its own residual"):
        ef.compress({"w": ef.residual["w"], "e": torch.zeros(0)}, consume=True)
    assert torch.equal(ef.residual["w"], before)
