"""The replay check: recompute a host's round and compare it with what the host sent.

With the recipe's `round_state = "fresh"` a round is a pure function of public data — the round's base
checkpoint, the host's assigned windows (its slot, the epoch seed) and the round number — so the
aggregator can run the very code an honest host runs (`training.worker.replay_round`) and compare the
result with the decoded payload. Honest hosts match (on the same hardware cosine ≥ 0.9999 and norm
ratio within 1 ± 0.0001 with int8, whose rounding and error feedback are all that differ),
while a host that trained on any other data — another slot's windows, the held-out split — shares
only the direction common to all hosts (cosine 0.20–0.79 on the devnet and tiny models, docs/benchmarks.md), and a
reversed, scaled, zero or random update fails on direction or length. A failing update is excluded,
unpaid, and the reason is kept as slashing evidence that anyone can re-check by running the same
replay.

Which hosts are replayed: each with the epoch's `replay_probability` p (on chain, set by governance),
decided by the round's commit–reveal seed (`chosen_for_replay`), so a host cannot know while it trains
or submits whether it will be checked; the epoch's stake rule (min_stake × p ≥ reward_per_round) makes
cheating a losing bet (docs/SECURITY.md). The cost: one host-round of compute per replay.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor, cat

from gonka_node.aggregator.validate import cosine
from training.data import Windows
from training.inner import InnerConfig
from training.model import Llama
from training.worker import Assignment, Rebase, replay_round

MISMATCH = "replay mismatch"  # reason prefix; gonka_node.slashing turns it into evidence
PASSED = "replay:"  # reason prefix of a host whose round the replay reproduced
NO_OPENING = "no opening"  # reason prefix of a challenged top-k host that did not open (not slashable)
PICK_TAG = b"gonka-replay-pick-v2"


@dataclass(frozen=True)
class ReplayData:
    """What replaying a round needs besides the base weights (fixed for the epoch)."""

    model_factory: Callable[[], Llama]
    inner: InnerConfig  # the recipe's, with round_state = "fresh"
    windows: Windows
    epoch_seed: int
    max_slots: int
    beacon: Callable[[], bytes] | None = None  # the assignment's post-sign-in randomness, when the recipe asks


def chosen_for_replay(fraction: float, seed: bytes, round_: int, hosts: Iterable[bytes]) -> set[bytes]:
    """The hosts to replay: each independently with probability `fraction`, decided by the round's seed.

    The seed is the chain's commit–reveal result (`Registry.round_seed`): the aggregators committed to
    it before the round took submissions and revealed it only once they were fixed, so no host can
    know, or grind its payload to change, whether it will be checked, and no aggregator can choose the
    pick after seeing the submissions. Anyone recomputes the pick from the seed on chain."""
    if fraction <= 0:
        return set()
    bar = int(fraction * 2**64)
    picked = set()
    for host in hosts:
        draw = hashlib.sha256(PICK_TAG + seed + round_.to_bytes(8, "big") + bytes(host)).digest()
        if fraction >= 1 or int.from_bytes(draw[:8], "big") < bar:
            picked.add(bytes(host))
    return picked


def replay_comparison(
    data: ReplayData, round_: int, slot: int, base: Mapping[str, Tensor], update: Mapping[str, Tensor],
    rebases: Sequence[Rebase] = (),
) -> tuple[float, float]:
    """(cosine, norm ratio |update| / |replay|) between `update` (decoded) and the replay of `slot`'s
    round from `base` (moving on the way as `rebases` say: an eager round's late forecast or merge),
    over all tensors in fp64."""
    replay = replay_update(data, round_, slot, base, rebases)
    names = sorted(replay)
    u = cat([update[n].double().flatten() for n in names])
    r = cat([replay[n].double().flatten() for n in names])
    r_norm = float(r.norm())
    return cosine(u, r), float(u.norm()) / r_norm if r_norm > 0 else float("inf")


def replay_update(
    data: ReplayData, round_: int, slot: int, base: Mapping[str, Tensor], rebases: Sequence[Rebase] = ()
) -> dict[str, Tensor]:
    """The pseudo-gradient an honest host of `slot` computes in `round_` from `base` (and `rebases`)."""
    return replay_round(
        data.model_factory(),
        data.inner,
        data.windows,
        Assignment(data.epoch_seed, slot, data.max_slots, data.beacon() if data.beacon else b""),
        round_,
        base,
        rebases=rebases,
    )


def verdict(
    round_: int, slot: int, cos: float, ratio: float, min_cosine: float, norm_tolerance: float
) -> tuple[bool, str]:
    """(passed, the reason line kept with the contribution): the update must point where the replay
    does (cosine ≥ `min_cosine`) and be as long (norm ratio within 1 ± `norm_tolerance`): a scaled
    honest update has the replay's direction but not its length."""
    what = f"cosine {cos:+.4f}, norm ratio {ratio:.4f} with the replay of slot {slot}'s round {round_}"
    if cos >= min_cosine and abs(ratio - 1.0) <= norm_tolerance:
        return True, f"{PASSED} {what}"
    return False, (
        f"{MISMATCH}: {what} from the round's base (needs cosine ≥ {min_cosine:g} and norm ratio within "
        f"1 ± {norm_tolerance:g}): not the training of its assignment that the recipe prescribes"
    )
