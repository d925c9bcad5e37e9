"""`decode_update` turns a codec's refusal into a reject reason by the error's class, never its text."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
import torch
from torch import Tensor

from gonka_node.aggregator.reasons import Reason, Rejected
from gonka_node.aggregator.validate import Codec, decode_update
from training.codecs import (
    HEADER_SIZE,
    CodecError,
    MalformedSectionError,
    NonFiniteError,
    SpecMismatchError,
    get_codec,
)

SPEC = {"b": (7,), "w": (5, 7)}
INT8 = get_codec("int8:block=4")


def _payload() -> bytes:
    return INT8.encode({n: torch.ones(s) for n, s in SPEC.items()})


def _reason(data: bytes, codec: Codec = INT8) -> tuple[Reason, str]:
    with pytest.raises(Rejected) as info:
        decode_update(codec, data, SPEC)
    return info.value.reason, info.value.message


def test_real_payloads_get_the_reasons_they_always_got() -> None:
    other = INT8.encode({"x": torch.ones(3)})
    assert _reason(other)[0] is Reason.WRONG_SHAPE
    overflow = bytearray(_payload())
    at = HEADER_SIZE + 8
    overflow[at : at + 8] = np.array([3.0e38], "<f4").tobytes() + b"\x7f" * 4
    assert _reason(bytes(overflow)) == (Reason.NON_FINITE, "int8 payload: tensor b contains NaN or infinity")
    reason, message = _reason(_payload()[:-1])
    assert reason is Reason.UNDECODABLE and message.startswith("payload does not decode: int8 payload is")


class _Refusing:
    """A codec whose messages say the opposite of their class: only the class may decide the reason."""

    def __init__(self, error: CodecError) -> None:
        self.error = error

    def decode(self, data: bytes, spec: Mapping[str, tuple[int, ...]]) -> dict[str, Tensor]:
        raise self.error

    def for_round(self, round_seed: int) -> _Refusing:
        return self


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (SpecMismatchError("NaN or infinity"), Reason.WRONG_SHAPE),
        (NonFiniteError("encoded for a different tensor spec"), Reason.NON_FINITE),
        (MalformedSectionError("tensor spec; NaN or infinity; elements, spec has"), Reason.UNDECODABLE),
    ],
)
def test_the_reason_follows_the_class_not_the_message(error: CodecError, reason: Reason) -> None:
    assert _reason(_payload(), _Refusing(error))[0] is reason
