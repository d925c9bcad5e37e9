"""The streaming ingest check (`validate.scan_update`, `Sketcher`) against the whole-update path it
replaced: the same norm and sketch bit for bit, and the same refusal in the same precedence."""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
from torch import Tensor

from gonka_node.aggregator import validate
from gonka_node.aggregator.reasons import Reason, Rejected
from gonka_node.aggregator.validate import (
    Sketcher,
    check_update,
    count_sketch,
    decode_update,
    mapped,
    scan_update,
    warm_sketch_tables,
)
from training.codec_base import _NUMEL
from training.codecs import HEADER_SIZE, CodecError, get_codec

# Tensors that cross the sketch's chunk boundary (65,536) and one that ends mid-block for int8.
SPEC = {"a.weight": (300, 250), "b.bias": (1001,), "c.weight": (70_000,)}


def update(seed: int, scale: float = 1e-3) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) * scale for n, s in SPEC.items()}


def reference_sketch(u: Mapping[str, Tensor], buckets: int = 4096) -> Tensor:
    """The whole-vector formula the sketch has always had (fp32 sign product, fp64 index_add)."""
    flat = torch.cat([u[n].reshape(-1).float() for n in sorted(u)])
    idx = torch.arange(flat.numel(), dtype=torch.int64)
    bucket = ((idx * 1_103_515_245 + 12_345) % 2_147_483_647) % buckets
    sign = ((((idx * 69_069 + 1) % 2_147_483_647) & 1) * 2 - 1).to(torch.float32)
    return torch.zeros(buckets, dtype=torch.float64).index_add_(0, bucket, (flat * sign).double()).float()


def test_sketch_equals_the_whole_vector_formula_bit_for_bit() -> None:
    u = update(1)
    assert torch.equal(count_sketch(u), reference_sketch(u))


def test_sketch_past_the_hash_cache_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    u = update(2)
    monkeypatch.setattr(validate, "SKETCH_CACHE_ELEMENTS", 1000)  # only the first tensor's table is cached
    assert torch.equal(count_sketch(u), reference_sketch(u))


def test_warmed_tables_leave_the_first_sketch_nothing_to_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the engine computes before the first upload: every table the cache keeps (here the cache
    ends after b.bias), so the first payload's sketch hashes only the tensor past the cache, and the
    sketch is unchanged."""
    monkeypatch.setattr(validate, "SKETCH_CACHE_ELEMENTS", 75_000 + 1_001)
    validate._sketch_hash.cache_clear()
    assert warm_sketch_tables(SPEC) == 76_001
    assert validate._sketch_hash.cache_info().currsize == 2
    computed: list[tuple[int, int]] = []
    real = validate._hash_range
    monkeypatch.setattr(validate, "_hash_range", lambda o, n, b: computed.append((o, n)) or real(o, n, b))
    u = update(4)
    assert torch.equal(count_sketch(u), reference_sketch(u))
    assert computed == [(76_001, 65_536), (141_537, 4_464)]  # c.weight only, chunk by chunk


def test_a_shard_warms_the_tables_at_its_fragments_coordinates() -> None:
    validate._sketch_hash.cache_clear()
    assert warm_sketch_tables({"c.weight": (70_000,)}, {"c.weight": 76_001}) == 70_000
    bucket, _ = validate._sketch_hash(76_001, 70_000, 4096)
    assert validate._sketch_hash.cache_info().hits == 1
    assert int(bucket[0]) == ((76_001 * 1_103_515_245 + 12_345) % 2_147_483_647) % 4096


def test_sketcher_fed_tensor_by_tensor_equals_count_sketch() -> None:
    u = update(3)
    s = Sketcher()
    for name in sorted(u):
        s.add(u[name])
    assert s.offset == sum(t.numel() for t in u.values())
    assert torch.equal(s.result(), count_sketch(u))


@pytest.mark.parametrize("codec_name", ["int8", "fp32", "bf16", "int4", "topk"])
def test_scan_equals_decode_then_check(codec_name: str) -> None:
    codec = get_codec(codec_name)
    data = codec.encode(update(4))
    old = check_update(decode_update(codec, data, SPEC), SPEC, 1e9)
    norm, sketch = scan_update(codec, data, SPEC, 1e9)
    assert norm == old.norm
    assert torch.equal(sketch, old.sketch)


def test_scan_reads_a_memory_mapped_file(tmp_path: Path) -> None:
    codec = get_codec("int8")
    data = codec.encode(update(5))
    (tmp_path / "p").write_bytes(data)
    with open(tmp_path / "p", "rb") as f, mapped(f) as view:
        got = scan_update(codec, view, SPEC, 1e9)
    assert got[0] == scan_update(codec, data, SPEC, 1e9)[0]


def refusal(data: bytes, codec_name: str = "fp32", max_norm: float = 1e9) -> tuple[Reason, str]:
    with pytest.raises(Rejected) as scanned:
        scan_update(get_codec(codec_name), data, SPEC, max_norm)
    with pytest.raises(Rejected) as whole:
        check_update(decode_update(get_codec(codec_name), data, SPEC), SPEC, max_norm)
    assert (scanned.value.reason, scanned.value.message) == (whole.value.reason, whole.value.message)
    return scanned.value.reason, scanned.value.message


def test_refusals_match_the_whole_update_path() -> None:
    good = get_codec("fp32").encode(update(6))
    assert refusal(good, max_norm=1e-6)[0] is Reason.NORM_TOO_LARGE
    assert refusal(good[:-4])[0] is Reason.UNDECODABLE
    assert refusal(get_codec("fp32").encode({"a.weight": torch.zeros(3)}))[0] is Reason.WRONG_SHAPE
    raw = bytearray(good)
    at = HEADER_SIZE + _NUMEL.size + 4 * 300 * 250 + _NUMEL.size + 4 * 7  # b.bias[7]
    raw[at : at + 4] = struct.pack("<f", float("nan"))
    assert refusal(bytes(raw)) == (Reason.NON_FINITE, "fp32 payload: tensor b.bias contains NaN or infinity")
    raw = bytearray(good)
    raw[HEADER_SIZE] ^= 0xFF  # garbage in the first tensor's numel field
    assert refusal(bytes(raw))[0] is Reason.WRONG_SHAPE


class LateGarbage:
    """A codec whose first tensor is non-finite and whose last one fails to decode."""

    def decode(self, data: bytes, spec: Mapping[str, tuple[int, ...]]) -> dict[str, Tensor]:
        return dict(self.decode_parts(data, spec))

    def decode_parts(self, data: bytes | memoryview, spec: Mapping[str, tuple[int, ...]]) -> Iterator[tuple[str, Tensor]]:
        names = sorted(spec)
        yield names[0], torch.full(spec[names[0]], float("inf"))
        yield names[1], torch.zeros(spec[names[1]])
        raise CodecError("section of c.weight is garbage")

    def for_round(self, round_seed: int) -> LateGarbage:
        return self


def test_a_decoding_error_anywhere_beats_a_failed_check() -> None:
    """The old path decoded every tensor before checking any: a later decoding error still wins."""
    with pytest.raises(Rejected) as exc:
        scan_update(LateGarbage(), b"", SPEC, 1e9)
    assert exc.value.reason is Reason.UNDECODABLE
    assert "c.weight is garbage" in exc.value.message
