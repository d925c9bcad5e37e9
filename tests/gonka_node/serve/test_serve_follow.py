"""`--round latest`: the server follows the chain and switches to each newly finalized round under load,
without failing a request; a request in flight finishes on the round it started on."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from serve_world import ServeWorld, serve


@dataclass
class Answer:
    started: float
    ended: float
    rounds: set[int]  # every chunk's round (one, unless a stream changed models)
    sha: str
    header_sha: str
    error: Exception | None = None
    # when its response headers came: the server had chosen its model by then (a request sent earlier may
    # still wait for the server behind the others, past a switch: `started` does not bound the choice)
    answered: float = 0.0


class Load:
    """Clients asking in a loop (alternately streamed and not) until stopped."""

    def __init__(self, url: str, clients: int) -> None:
        self.answers: list[Answer] = []
        self.streaming = 0  # streams whose headers came and whose chunks still come
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(url, i)) for i in range(clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _client(self, url: str, index: int) -> None:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        turn = 0
        while not self._stop.is_set():
            turn += 1
            started = time.monotonic()
            try:
                answer = self._stream(client, index + turn) if turn % 2 else self._whole(client, index + turn)
            except Exception as exc:  # any failure is the finding: recorded, asserted on below
                answer = Answer(started, time.monotonic(), set(), "", "", exc)
            answer.started = started
            self.answers.append(answer)

    @staticmethod
    def _whole(client: openai.OpenAI, seed: int) -> Answer:
        raw = client.completions.with_raw_response.create(model="gonka-epoch-1", prompt="x", max_tokens=120,
                                                          seed=seed)
        answered = time.monotonic()
        gonka = raw.parse().model_extra["gonka"]
        return Answer(0, time.monotonic(), {gonka["round"]}, gonka["checkpoint_sha256"],
                      raw.headers["x-gonka-checkpoint-sha256"], answered=answered)

    def _stream(self, client: openai.OpenAI, seed: int) -> Answer:
        with client.completions.with_streaming_response.create(model="gonka-epoch-1", prompt="y", max_tokens=120,
                                                               seed=seed, stream=True) as raw:
            answered = time.monotonic()
            with self._lock:
                self.streaming += 1
            try:
                chunks = [chunk.model_extra["gonka"] for chunk in raw.parse()]
            finally:
                with self._lock:
                    self.streaming -= 1
            header = raw.headers["x-gonka-checkpoint-sha256"]
        return Answer(0, time.monotonic(), {c["round"] for c in chunks}, chunks[-1]["checkpoint_sha256"], header,
                      answered=answered)


class HeldStream(threading.Thread):
    """A stream whose first chunk is read, then no more until `release` is set: a request in flight for
    as long as the test wants (the load's own streams may all end between two polls of a switch)."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url, self.first, self.release = url, threading.Event(), threading.Event()
        self.answer: Answer | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        client = openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0)
        try:
            with client.completions.with_streaming_response.create(model="gonka-epoch-1", prompt="z",
                                                                   max_tokens=120, seed=7, stream=True) as raw:
                answered = time.monotonic()
                chunks = iter(raw.parse())
                rounds = [next(chunks).model_extra["gonka"]]
                self.first.set()
                self.release.wait(120)
                rounds += [chunk.model_extra["gonka"] for chunk in chunks]
                self.answer = Answer(answered, time.monotonic(), {c["round"] for c in rounds},
                                     rounds[-1]["checkpoint_sha256"], raw.headers["x-gonka-checkpoint-sha256"],
                                     answered=answered)
        except Exception as exc:  # asserted on by the test
            self.error = exc
            self.first.set()


def wait_for_round(handle, round_: int, timeout_s: float = 60.0) -> tuple[float, float]:
    """When round `round_` became the newest served: between the two times returned (the last poll that
    saw another, the first that saw it)."""
    deadline, before = time.monotonic() + timeout_s, time.monotonic()
    while time.monotonic() < deadline:
        seen = time.monotonic()
        if handle.served()[0].provenance.round == round_:
            return before, seen
        before = seen
        time.sleep(0.01)
    raise AssertionError(f"round {round_} was not served within {timeout_s} s")


def test_a_new_round_is_served_under_load_without_a_failed_request(world: ServeWorld, tmp_path: Path):
    handle = serve(world, tmp_path, poll_s=0.1)
    try:
        assert [m.id for m in handle.served()] == ["gonka-epoch-1-round-2"]
        held = HeldStream(handle.url)
        with Load(handle.url, clients=4) as load:
            while len(load.answers) < 4 or not load.streaming:  # streams are under way when round 3 comes
                time.sleep(0.01)
            held.start()
            assert held.first.wait(60) and held.error is None, held.error
            world.finalize(3)
            before, after = wait_for_round(handle, 3)
            held.release.set()  # read on only once round 3 is served
            held.join(60)
            count = len(load.answers)
            while len(load.answers) < count + 8:
                time.sleep(0.01)
        assert [m.id for m in handle.served()] == ["gonka-epoch-1-round-3", "gonka-epoch-1-round-2"]
    finally:
        handle.stop()
    assert held.error is None and held.answer is not None, held.error
    load.answers.append(held.answer)
    assert [a.error for a in load.answers if a.error] == []
    for answer in load.answers:
        (round_,) = answer.rounds  # a stream never changes models midway
        assert answer.sha == answer.header_sha == world.shas[round_]
    assert {next(iter(a.rounds)) for a in load.answers} == {2, 3}
    across = [a for a in load.answers if a.answered < before and a.ended > after]
    assert across and all(a.rounds == {2} for a in across)  # in flight at the switch: finished on round 2
    assert all(a.rounds == {3} for a in load.answers if a.started > after)


def test_past_keep_rounds_the_oldest_is_retired(world: ServeWorld, tmp_path: Path):
    handle = serve(world, tmp_path, poll_s=0.1, keep_rounds=1)
    try:
        newest = handle.served()[0]
        client = openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0)
        assert client.completions.create(model=newest.id, prompt="a", max_tokens=2).model == newest.id
        next_round = newest.provenance.round + 1
        world.finalize(next_round)
        wait_for_round(handle, next_round)
        assert newest.engine.join(30)  # the retired round's engine thread ended
        with pytest.raises(openai.NotFoundError) as gone:
            client.completions.create(model=newest.id, prompt="a", max_tokens=2)
        assert f"gonka-epoch-1-round-{next_round}" in gone.value.message
    finally:
        handle.stop()
