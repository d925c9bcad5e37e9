"""A host's answer to the challenge of its top-k round (docs/PROTOCOL.md "Challenge and opening").

Picked for the replay, a host opens its residual before and after the round's compress (e_{r−1}, e_r)
on the chunks the round's seed samples for it. It recomputes that sample itself and refuses one that is
not the seed's (else the aggregator could choose chunks after seeing the roots), and it checks its own
opening against the roots it signed before anything is sent: an opening that does not verify is signed
evidence against the host, so one built from a state that is not the signed one (a lost or replaced
state) stays here, with a line saying why.
"""

from __future__ import annotations

from collections.abc import Mapping

from nacl.signing import SigningKey
from torch import Tensor

from gonka_node.core.opening import challenge, encode_body, signed_opening
from gonka_node.core.recipe import Recipe
from gonka_node.host.store import Progress
from proto.gonka.v1 import aggregator_pb2 as pb
from training.residual_commit import ChunkLayout, open_chunks, verify_opening, zero_root


class ChallengeRefused(ValueError):
    """A challenge this host does not answer; the message says why in one line."""


def sample_settings(recipe: Recipe) -> tuple[float, int]:
    """The epoch's challenge sample: (share of chunks, minimum elements), the recipe's `residual_sample`
    and `residual_sample_min`."""
    return recipe.residual_sample, recipe.residual_sample_min


def checked_sample(
    status: pb.SubmissionStatus, round_: int, host: bytes, layout: ChunkLayout, fraction: float, minimum: int
) -> tuple[int, ...]:
    """The chunks `status` challenges, when they are the sample of its round seed for this host and round;
    ChallengeRefused otherwise."""
    sample = challenge(bytes(status.round_seed), round_, host, layout, fraction, minimum)
    asked = tuple(int(i) for i in status.challenged_chunks)
    if asked != sample:
        raise ChallengeRefused(
            f"round {round_}: the aggregator's challenge ({len(asked)} chunks) is not the sample of the round "
            f"seed {bytes(status.round_seed).hex()[:16]}… for this host ({len(sample)} chunks); not opened"
        )
    return sample


def opening_body(
    previous: Mapping[str, Tensor], current: Mapping[str, Tensor], layout: ChunkLayout, sample: tuple[int, ...],
    previous_root: bytes, residual_root: bytes, round_: int,
) -> bytes:
    """The serialized `ResidualOpening` of e_{r−1} (`previous`) and e_r (`current`) on `sample`, once
    both verify against the roots this host signed; ChallengeRefused when one does not."""
    opened = open_chunks(previous, layout, sample), open_chunks(current, layout, sample)
    for which, opening, root in (("e_{r−1}", opened[0], previous_root), ("e_r", opened[1], residual_root)):
        if not verify_opening(root, opening, layout, sample):
            raise ChallengeRefused(
                f"round {round_}: the residual {which} this host holds does not open to the root it signed "
                f"({root.hex()[:16]}…): its state is not the one that signed it; not opened"
            )
    return encode_body(*opened)


def signed_roots(progress: Progress, round_: int, layout: ChunkLayout) -> tuple[bytes, bytes]:
    """(e_{r−1}'s root, e_r's root) as this host signed them: the root of its last submitted round before
    `round_` (the zero root before its first), and `round_`'s own."""
    mine = progress.residual_roots.get(str(round_))
    if mine is None:
        raise ChallengeRefused(f"round {round_}: this host recorded no residual root for the round; not opened")
    earlier = [int(k) for k in progress.submitted if int(k) < round_]
    if not earlier:
        return zero_root(layout), bytes.fromhex(mine)
    last = progress.residual_roots.get(str(max(earlier)))
    if last is None:
        raise ChallengeRefused(f"round {round_}: this host recorded no residual root for its previous submitted "
                               f"round {max(earlier)}; not opened")
    return bytes.fromhex(last), bytes.fromhex(mine)


def build_opening(
    status: pb.SubmissionStatus, info: pb.RoundInfo, host: bytes, key: SigningKey, layout: ChunkLayout,
    sample: tuple[float, int], roots: tuple[bytes, bytes], residuals: tuple[Mapping[str, Tensor], Mapping[str, Tensor]],
) -> tuple[pb.OpeningHeader, bytes]:
    """The signed header and the body answering `status`'s challenge of round `info.round` (`sample`:
    the recipe's share of chunks and minimum elements; `roots` and `residuals`: e_{r−1}'s and e_r's)."""
    round_ = int(info.round)
    chunks = checked_sample(status, round_, host, layout, *sample)
    body = opening_body(*residuals, layout, chunks, *roots, round_)
    return signed_opening(info, round_, host, roots[0], roots[1], body, key), body
