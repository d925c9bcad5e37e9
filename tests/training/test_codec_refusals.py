"""Every refusal of the codecs, word for word (what a host operator or an aggregator log shows), and the
bounds of every codec option exactly at their edges."""

from __future__ import annotations

import math
import re
import struct

import numpy as np
import pytest
import torch

from training.codecs import (
    HEADER_SIZE,
    BlockQuantCodec,
    CodecError,
    ErrorFeedback,
    PayloadSizeError,
    SharedMaskCodec,
    TopKCodec,
    get_codec,
    round_seed,
    spec_digest,
)

SPEC = {"w": (5,)}


def payload(name: str, values: list[float] | None = None) -> bytearray:
    x = torch.tensor(values if values is not None else [0.5, -1.0, 0.25, 2.0, -0.125])
    return bytearray(get_codec(name).encode({"w": x}))


def refused(name: str, data: bytes | bytearray, message: str, spec: dict = SPEC) -> None:
    with pytest.raises(CodecError, match=f"^{re.escape(message)}$"):
        get_codec(name).decode(bytes(data), spec)


def patched(data: bytearray, at: int, raw: bytes) -> bytearray:
    out = bytearray(data)
    out[at : at + len(raw)] = raw
    return out


def test_header_refusals() -> None:
    good = payload("fp32")
    refused("fp32", good[:10], "payload is 10 bytes, shorter than the 32-byte codec header")
    refused("fp32", patched(good, 0, b"GNKD"), "bad magic b'GNKD': not a gonka codec payload (expected b'GNKC')")
    refused("fp32", patched(good, 4, b"\x02"), "unsupported codec payload version 2 (this build reads 1)")
    refused("fp32", patched(good, 5, b"\x02"), "payload was encoded with codec 'bf16', this decoder is 'fp32'")
    refused("fp32", patched(good, 5, b"\x63"), "payload was encoded with codec 'unknown id 99', this decoder is 'fp32'")
    refused("fp32", patched(good, 6, b"\x01\x00"), "reserved header field is 1, must be 0")
    refused("fp32", patched(good, 8, b"\x01"), "fp32 payload parameters (1, 0, 0) differ from the expected (0, 0, 0)")
    refused("fp32", patched(good, 20, b"\x02"),
            f"fp32 payload was encoded for a different tensor spec (2 tensors, digest {spec_digest(SPEC).hex()})")
    refused("fp32", good, f"fp32 payload was encoded for a different tensor spec (1 tensors, digest "
            f"{spec_digest(SPEC).hex()})", spec={"v": (5,)})


def test_length_and_numel_refusals() -> None:
    good = payload("bf16")
    refused("bf16", good[:-1], "bf16 payload is 49 bytes, expected 50 for this spec (truncated)")
    refused("bf16", good + b"\0", "bf16 payload is 51 bytes, expected 50 for this spec (trailing bytes)")
    refused("bf16", patched(good, HEADER_SIZE, struct.pack("<Q", 6)),
            "bf16 payload: tensor w claims 6 elements, spec has 5")


def test_section_refusals() -> None:
    first = HEADER_SIZE + 8
    refused("fp32", patched(payload("fp32"), first + 4, struct.pack("<f", math.inf)),
            "fp32 payload: tensor w contains NaN or infinity")
    refused("bf16", patched(payload("bf16"), first + 2, b"\x80\xff"), "bf16 payload: tensor w contains NaN or infinity")
    for name, bad in (("int8", -1.0), ("int4", math.nan)):
        refused(name, patched(payload(name), first, struct.pack("<f", bad)),
                f"{name} payload: tensor w has a negative or non-finite block scale")
    refused("int8", patched(payload("int8"), first + 4, b"\x00"), "int8 payload: tensor w has code 0, outside [-127, 127]")
    refused("int4", patched(payload("int4"), first + 4, b"\x80"), "int4 payload: tensor w has code 0, outside [-7, 7]")
    refused("int4", patched(payload("int4"), first + 6, b"\x88"), "int4 payload: tensor w has non-zero padding bits")
    topk = "topk:chunk=4,k=2,bits=2"  # chunks of 4 and 1: (lo, hi) twice, then 3 positions, 3 codes
    refused(topk, patched(payload(topk), first, struct.pack("<ff", 2.0, 1.0)),
            "topk payload: tensor w has a non-finite or inconsistent chunk scale (need 0 ≤ lo ≤ hi)")
    refused(topk, patched(payload(topk), first, struct.pack("<f", -1.0)),
            "topk payload: tensor w has a non-finite or inconsistent chunk scale (need 0 ≤ lo ≤ hi)")
    refused(topk, patched(payload(topk), first + 16, bytes([0b01_01_01])),
            "topk payload: tensor w has a position out of range of its chunk")  # position 1 in a 1-chunk
    refused(topk, patched(payload(topk), first + 16, bytes([0b00_01_01])),
            "topk payload: tensor w has positions not strictly increasing within a chunk")
    refused(topk, patched(payload(topk), first + 16, bytes([0b1100_0000 | 0b00_11_01])),
            "topk payload: tensor w has non-zero padding bits")
    mask = "mask:stride=1,bits=2,chunk=8"
    refused(mask, patched(payload(mask), first, struct.pack("<f", -0.5)),
            "mask payload: tensor w has a negative or non-finite step")


def test_encoding_a_non_finite_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^int8\.encode: w contains NaN or infinity$"):
        get_codec("int8").encode({"ok": torch.zeros(2), "w": torch.tensor([1.0, math.nan])})


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: BlockQuantCodec(3, 8), "BlockQuantCodec: bits must be 4 or 8, got 3"),
        (lambda: BlockQuantCodec(8, 0), "BlockQuantCodec: block must be in [1, 2^20], got 0"),
        (lambda: BlockQuantCodec(8, (1 << 20) + 1), "BlockQuantCodec: block must be in [1, 2^20], got 1048577"),
        (lambda: TopKCodec(chunk=1, k=1), "TopKCodec: chunk must be in [2, 2^24], got 1"),
        (lambda: TopKCodec(chunk=(1 << 24) + 1, k=1), "TopKCodec: chunk must be in [2, 2^24], got 16777217"),
        (lambda: TopKCodec(chunk=8, k=0), "TopKCodec: k must be in [1, chunk=8], got 0"),
        (lambda: TopKCodec(chunk=8, k=9), "TopKCodec: k must be in [1, chunk=8], got 9"),
        (lambda: TopKCodec(bits=3), "TopKCodec: value bits must be 1, 2, 4 or 8, got 3"),
        (lambda: SharedMaskCodec(stride=0), "SharedMaskCodec: stride must be in [1, 65536], got 0"),
        (lambda: SharedMaskCodec(stride=65537), "SharedMaskCodec: stride must be in [1, 65536], got 65537"),
        (lambda: SharedMaskCodec(bits=1), "SharedMaskCodec: value bits must be 2, 4 or 8, got 1"),
        (lambda: SharedMaskCodec(chunk=0), "SharedMaskCodec: chunk must be in [1, 2^24), got 0"),
        (lambda: SharedMaskCodec(chunk=1 << 24), "SharedMaskCodec: chunk must be in [1, 2^24), got 16777216"),
        (lambda: ErrorFeedback(get_codec("fp32"), decay=1.5), "ErrorFeedback: decay must be in [0, 1], got 1.5"),
        (lambda: ErrorFeedback(get_codec("fp32"), decay=-0.1), "ErrorFeedback: decay must be in [0, 1], got -0.1"),
        (lambda: ErrorFeedback(get_codec("fp32"), decay=math.nan), "ErrorFeedback: decay must be in [0, 1], got nan"),
        (lambda: get_codec("zip"), "unknown codec 'zip'; choose one of fp32, bf16, int8, int4, topk, mask"),
        (lambda: get_codec("int8:block"), "codec option 'block' in 'int8:block' must be key=integer"),
        (lambda: get_codec("int8:block=x"), "codec option 'block=x' in 'int8:block=x' must be key=integer"),
        (lambda: get_codec("int8:block=1=2"), "codec option 'block=1=2' in 'int8:block=1=2' must be key=integer"),
        (lambda: get_codec("fp32:block=3"), "codec 'fp32' does not take options ['block']"),
        (lambda: get_codec("fp32").encoded_size({"w": (2, -1)}), "spec: w has an invalid shape (2, -1)"),
        (lambda: get_codec("fp32").encoded_size({"w": (2.0,)}), "spec: w has an invalid shape (2.0,)"),
    ],
)
def test_bad_options_are_refused_word_for_word(make, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        make()


def test_option_bounds_are_inclusive_where_documented() -> None:
    assert BlockQuantCodec(8, 1).params() == (8, 1, 0) and BlockQuantCodec(4, 1 << 20).params() == (4, 1 << 20, 0)
    assert TopKCodec(chunk=2, k=2).params() == (2, 2, 2) and TopKCodec(chunk=1 << 24, k=1, bits=1).index_bits == 24
    assert SharedMaskCodec(stride=1).params()[0] == 1 and SharedMaskCodec(stride=65536).params()[0] == 65536
    assert SharedMaskCodec(chunk=(1 << 24) - 1, bits=8).params()[1] == 8 << 24 | (1 << 24) - 1
    assert ErrorFeedback(get_codec("fp32"), decay=0.0).decay == 0.0
    assert get_codec("int8: block = 64").params() == (8, 64, 0)  # spaces around options are ignored


def test_error_feedback_refuses_another_codec_or_other_tensors() -> None:
    ef = ErrorFeedback(get_codec("int8"), decay=0.5)
    ef.compress({"w": torch.ones(4)})
    with pytest.raises(ValueError, match=r"^ErrorFeedback\.compress: tensor names differ from the previous round's$"):
        ef.compress({"v": torch.ones(4)})
    other = ErrorFeedback(get_codec("int4"), decay=0.5)
    with pytest.raises(ValueError, match=r"^ErrorFeedback\.load_state_dict: saved codec/decay int8/0\.5 differ from int4/0\.5$"):
        other.load_state_dict(ef.state_dict())
    assert other.residual == {}


def test_error_feedback_keeps_what_was_not_sent_with_its_decay() -> None:
    """e ← decay·e + Δ; send encode(e); keep e − decode(sent): checked against the formula in fp32."""
    codec = get_codec("topk:chunk=4,k=1,bits=2")
    ef = ErrorFeedback(codec, decay=0.5)
    d1, d2 = torch.tensor([1.0, 0.5, -0.25, 0.125]), torch.tensor([0.0, 1.0, 0.0, -2.0])
    sent1 = codec.decode(ef.compress({"w": d1}), {"w": (4,)})["w"]
    assert torch.equal(ef.residual["w"], d1 - sent1)
    target = (d1 - sent1) * torch.tensor(0.5) + d2
    sent2 = codec.decode(ef.compress({"w": d2}), {"w": (4,)})["w"]
    assert torch.equal(sent2, codec.decode(codec.encode({"w": target}), {"w": (4,)})["w"])
    assert torch.equal(ef.residual["w"], target - sent2)
    state = ef.state_dict()
    assert state == {"codec": "topk", "decay": 0.5, "residual": state["residual"], "previous": state["previous"]}
    assert torch.equal(state["previous"]["w"], d1 - sent1)  # e_{r−1}, kept for a challenge of this round
    # The state shares the residual tensors (no copy: ~5 GB each at 1.2B) and stays as of the call, since
    # a compress replaces them and never updates one in place.
    assert state["residual"]["w"] is ef.residual["w"] and state["previous"]["w"] is ef.previous["w"]
    kept = state["residual"]["w"].clone()
    ef.compress({"w": d1})
    assert torch.equal(state["residual"]["w"], kept) and ef.previous["w"] is state["residual"]["w"]
    assert not torch.equal(ef.residual["w"], kept)


def test_block_scales_and_codes_are_what_the_format_says() -> None:
    """int8, block 4: scale = absmax / 127, codes q + 128 (never 0), round half to even."""
    x = torch.tensor([1.27, -0.635, 0.0, 0.005, 2.0])
    data = get_codec("int8:block=4").encode({"w": x})
    at = HEADER_SIZE + 8
    scales = np.frombuffer(data[at : at + 8], dtype="<f4")
    assert scales.tolist() == [np.float32(np.float32(1.27) / np.float32(127)), np.float32(np.float32(2.0) / np.float32(127))]
    assert list(data[at + 8 :]) == [255, 128 - 64, 128, 128, 255]  # −63.5 → −64 and 0.5 → 0: halves go to even


def test_more_option_edges_and_defaults() -> None:
    assert TopKCodec(chunk=8, k=1).params() == (8, 1, 2) and TopKCodec(chunk=2, k=1).index_bits == 1
    assert TopKCodec().params() == (4096, 64, 2) and SharedMaskCodec().params() == (4, 2 << 24 | 256, 0)
    assert SharedMaskCodec(chunk=1).params()[1] == 2 << 24 | 1
    assert SharedMaskCodec(seed=(1 << 32) + 5).params()[2] == 5  # the header holds the seed mod 2^32
    assert get_codec("int8").name == "int8" and get_codec("int4").name == "int4"


def test_an_empty_spec_is_a_header_alone() -> None:
    for name in ("fp32", "int4", "topk", "mask"):
        data = get_codec(name).encode({})
        assert len(data) == HEADER_SIZE and get_codec(name).decode(data, {}) == {}


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "int4:block=3", "topk:chunk=4,k=2,bits=2", "mask:stride=2,bits=4,chunk=3"])
def test_wider_tensors_are_encoded_as_their_fp32_rounding(name: str) -> None:
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(11, generator=g, dtype=torch.float64) / 3
    assert get_codec(name).encode({"w": wide}) == get_codec(name).encode({"w": wide.float()})


def test_error_feedback_holds_its_residual_in_fp32() -> None:
    wide = torch.tensor([1.0, 1 / 3, -0.1, 0.7], dtype=torch.float64)
    a, b = ErrorFeedback(get_codec("int4:block=2")), ErrorFeedback(get_codec("int4:block=2"))
    assert a.compress({"w": wide}) == b.compress({"w": wide.float()})
    assert a.residual["w"].dtype == torch.float32 and torch.equal(a.residual["w"], b.residual["w"])


def test_topk_signs_and_grid_of_what_it_keeps() -> None:
    one = get_codec("topk:chunk=4,k=2,bits=1")
    out = one.decode(one.encode({"w": torch.tensor([3.0, 0.0, 0.0, 0.0])}), {"w": (4,)})["w"]
    assert out[0] == 1.5 and sorted(out.tolist()) == [0.0, 0.0, 1.5, 1.5]  # a kept zero is not negative: +mean
    four = get_codec("topk:chunk=4,k=4,bits=4")  # span 0.3 < 1: seven steps of 0.3/7
    x = torch.tensor([0.1, -0.2, 0.3, 0.4])
    got = four.decode(four.encode({"w": x}), {"w": (4,)})["w"]
    step = (torch.tensor(0.4) - torch.tensor(0.1)) / 7.0
    grid = [torch.tensor(0.1) + m * step for m in (0.0, 2.0, 5.0, 7.0)]
    assert got.tolist() == [grid[0].item(), -grid[1].item(), grid[2].item(), grid[3].item()]
    two = get_codec("topk:chunk=4,k=4,bits=2")
    zero = two.decode(two.encode({"w": torch.tensor([0.0, 0.5, -0.5, 0.25])}), {"w": (4,)})["w"]
    assert zero[0].view(torch.int32).item() == 0  # +0.0, not −0.0


def test_a_mask_payload_of_zeros_decodes_to_positive_zeros() -> None:
    mask = get_codec("mask:stride=1,bits=2,chunk=4")
    out = mask.decode(mask.encode({"w": torch.zeros(6)}), {"w": (6,)})["w"]
    assert out.view(torch.int32).tolist() == [0] * 6


def test_decoded_tensors_are_fp32_whatever_torchs_default_dtype() -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for name in ("topk:chunk=4,k=2,bits=2", "mask:stride=2,bits=2,chunk=4"):
            x = torch.tensor([0.5, -1.0, 0.25, 2.0, -0.125], dtype=torch.float32)
            out = get_codec(name).decode(get_codec(name).encode({"w": x}), SPEC)["w"]
            assert out.dtype == torch.float32
    finally:
        torch.set_default_dtype(previous)


def test_round_seeds_are_the_documented_function_of_epoch_seed_and_round() -> None:
    """Hosts and the aggregator derive the shared mask from it: a changed formula splits the network."""
    assert [round_seed(0, r) for r in (0, 1, 7)] == [0, 1, 7]
    assert round_seed(3, 5) == 3 * 1_000_003 + 5 and round_seed(1, 0) != round_seed(0, 1_000_002)


def test_a_part_of_the_wrong_size_is_refused_with_the_size_its_tensor_needs() -> None:
    """The size a part must have depends on the tensor's name for the shared-mask codec (its mask
    does): the refusal names the tensor and both sizes."""
    codec = get_codec("mask:stride=2,bits=8,chunk=4,seed=3")
    part = codec.encode_tensor("w", torch.ones(40))
    with pytest.raises(PayloadSizeError, match=rf"^mask part of w is {len(part) - 1} bytes, expected {len(part)}$"):
        codec.decode_tensor("w", part[:-1], (40,))
    with pytest.raises(ValueError, match=r"^spec: w has an invalid shape \(-1,\)$"):
        codec.decode_tensor("w", part, (-1,))
