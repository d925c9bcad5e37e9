"""Stop sequences and incremental UTF-8: what is streamed concatenates to what is decoded at once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gonka_node.serve.text import TextAssembler, token_text


def run(data: bytes, stops: list[bytes]) -> tuple[str, bool, list[int]]:
    assembler = TextAssembler(stops)
    pieces, offsets = [], []
    for byte in data:
        released = assembler.push(byte)
        pieces.append(released.text)
        offsets += released.offsets
        if released.stopped:
            return "".join(pieces), True, offsets
    closing = assembler.close()
    return "".join([*pieces, closing.text]), False, offsets + list(closing.offsets)


def expected(data: bytes, stops: list[bytes]) -> tuple[str, bool]:
    """Where the earliest stop sequence ends first, the text is everything before that match."""
    ends = [(data.find(s) + len(s), data.find(s)) for s in stops if s in data]
    if not ends:
        return data.decode("utf-8", "replace"), False
    end = min(ends)[0]
    start = min(data.find(s) for s in stops if s in data[:end])
    return data[:start].decode("utf-8", "replace"), True


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=60) | st.text(max_size=30).map(lambda t: t.encode("utf-8")),
    st.lists(st.binary(min_size=1, max_size=4) | st.sampled_from([b"\n", b"ab", "é".encode()]), max_size=3),
)
def test_streamed_text_is_the_text_before_the_first_stop(data: bytes, stops: list[bytes]):
    text, stopped, offsets = run(data, stops)
    assert (text, stopped) == expected(data, stops)
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    assert sum(1 for _ in offsets) <= len(data)


def test_a_stop_sequence_is_never_sent_even_in_part():
    assembler = TextAssembler([b"END"])
    assert [assembler.push(b).text for b in b"xyEN"] == ["x", "y", "", ""]  # "EN" may begin "END"
    released = assembler.push(ord("D"))
    assert (released.text, released.stopped) == ("", True)
    assembler = TextAssembler([b"END"])
    assert "".join(assembler.push(b).text for b in b"ENx") == "ENx"  # not a stop after all: released


def test_multibyte_characters_wait_for_their_last_byte():
    assembler = TextAssembler()
    first, second = (assembler.push(b) for b in "é".encode())
    assert (first.text, second.text) == ("", "é")
    assert (first.offsets, second.offsets) == ((0,), (0,))  # both bytes belong to character 0
    assembler.push(0xC3)  # half a character, then the end
    assert assembler.close().text == "\ufffd"


def test_every_byte_token_has_its_own_name():
    names = [token_text(bytes((t,))) for t in range(256)]
    assert len(set(names)) == 256
    assert (names[65], names[10], names[0xE9]) == ("A", "\n", "bytes:\\xe9")
