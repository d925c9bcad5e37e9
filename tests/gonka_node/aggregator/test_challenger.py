"""The aggregator puts its slashable evidence on chain as bonded challenges after each round.

A real server and chain: host 1 signs a payload with NaN in it (garbage no honest software signs; it
gets a receipt, then fails its checks), hosts 2 and 3 are honest. After the round closes, `Challenger.settle` files one challenge with the
evidence's sha256 from the aggregator's account and votes to uphold it (quorum 1): host 1's whole
stake is slashed, the aggregator gets its bond back plus the challenger's share, and host 1's stake
can no longer be withdrawn whatever the time.
"""

from __future__ import annotations

import struct

from agg_harness import AGGREGATOR, Harness, expire
from test_rejections import envelope, good_payload, stream
from test_round import wait_state

from chain.types import CHALLENGER_SHARE_BPS
from gonka_node.aggregator.challenger import Challenger
from gonka_node.aggregator.reasons import Reason


def test_garbage_is_challenged_and_slashed_after_the_round(harness: Harness) -> None:
    h = harness
    h.schedule(3)
    cheat, *honest = h.hosts
    payloads = {host.index: h.payload(h.honest_update(host, 1)) for host in honest}  # before the clock runs
    nan = bytearray(good_payload(h))
    nan[40:44] = struct.pack("<f", float("nan"))
    server = h.start_server()
    with server.client() as client:
        info = client.open_round()
        assert client.submit_raw(stream(envelope(info, cheat, bytes(nan)), cheat.key, bytes(nan))).accepted
        assert client.checked(info.epoch, info.round, cheat.address).reason == Reason.NON_FINITE.value
        for host in honest:
            client.submit(info, host.address, payloads[host.index], host.key)
    # The cheat never gets in: the round closes at its deadline with the other two (moved here, not
    # waited for in real time, which a loaded machine could miss with the uploads still going).
    server.run(expire(server.engine))
    assert wait_state(server, h.epoch, 1, ("finalized",)) == "finalized"

    chain = h.world.client(0)
    aggregator = h.world.client(AGGREGATOR)
    stake = chain.host_info(h.epoch, cheat.account.address).stake
    before = aggregator.gnk_balance()
    decisions = Challenger(server.engine, server.engine.evidence).settle()  # type: ignore[arg-type]
    assert [(d.host, d.evidence.kind, d.amount) for d in decisions] == [(cheat.account.address, "garbage", stake)]

    (challenge,) = chain.challenges(h.epoch)
    assert (challenge.host, challenge.challenger, challenge.status) == (
        cheat.account.address, aggregator.address, "upheld")
    assert challenge.evidence_hash == decisions[0].evidence.hash
    assert chain.host_info(h.epoch, cheat.account.address).slashed == stake
    assert aggregator.gnk_balance() - before == stake * CHALLENGER_SHARE_BPS // 10_000  # bond back + share
    assert Challenger(server.engine, server.engine.evidence).settle() == []  # once per host
    h.world.backend.increase_time(10**7)  # past the epoch's rounds and its challenge window
    assert h.world.client(cheat.index).withdraw_stake(h.epoch) == 0  # nothing left to take
    assert h.world.client(honest[0].index).withdraw_stake(h.epoch) == stake  # honest stake comes back
