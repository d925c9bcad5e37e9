"""Round lifecycle: accept submissions for the open round, close it, finalize it once, open the next.

States (table `rounds`): open → finalizing → finalized, or open → skipping → skipped.

- A round closes as soon as every host signed in to the epoch has an accepted submission, or when its
  deadline passes with at least `quorum` accepted submissions.
- Deadline passed below quorum: the deadline moves by `extend_s`, at most `max_extensions` times;
  then the round is *skipped*: finalized on chain with the base checkpoint hash unchanged, no
  contributors and no reward, and the next round starts from the same checkpoint.
- A submission arriving once the round is closing, or after its deadline, is refused with LATE, and a
  stream still open when the round closes ends with LATE at once: no upload holds a round
  (`ingest.StreamGuard` also bounds each stream's idle time and total time; one stream per host).
- Copies are ordered by when each host's signed header arrived, not when its upload completed: a
  header commits to the payload digest before any payload byte travels, so whoever saw an honest
  host's bytes on the wire can only send its own header later.
- A receipt follows the sha256 and the durable store only (plus the checks that need no decode:
  envelope, signature, limits, round, duplicate, digest copy): the row is stored `pending` and its
  decode-time checks (names, shapes, finiteness, norm, sketch) run in a bounded pool afterwards
  (aggregator/deferred.py). The round's tick and close first wait for the round's pending checks; a
  payload that fails one is recorded as failed (evidence kept, as for a refusal) and is no submission.
- Closing: (compute, pure) score, copy detection, robust aggregate, outer step, checkpoint, rewards;
  (record) the intent, with everything the chain transaction will say; (chain) finalize unless the
  chain already shows this round finalized; (record) done. A restart in between re-reads the intent
  and checks the chain first, so a round is never finalized twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nacl.signing import SigningKey

from chain.client import round_result_hash
from chain.merkle import RewardTree
from chain.seed import new_secret
from gonka_node.aggregator.acceptance import ZERO32, Acceptance
from gonka_node.aggregator.broadcast import residual_path
from gonka_node.aggregator.chain_view import ChainView
from gonka_node.aggregator.challenges import deadline_ms, picked, sample
from gonka_node.aggregator.close import ClosingInputs, RoundOutcome, compute_outcome, reward_tree
from gonka_node.aggregator.deferred import CheckPool
from gonka_node.aggregator.eager import EagerBases
from gonka_node.aggregator.engine_types import (
    CheckpointIO,
    EpochContext,
    EvidenceSink,
    InFlight,
    OpeningsPending,
    SeedPending,
    clock_text,
)
from gonka_node.aggregator.ingest import StreamLimits
from gonka_node.aggregator.metrics import RoundMetrics
from gonka_node.aggregator.opened_replay import Opened
from gonka_node.aggregator.openings import OpeningDesk
from gonka_node.aggregator.publish import RoundPublisher
from gonka_node.aggregator.shard import ShardExchange, ShardPending
from gonka_node.aggregator.shard_close import close_fragment, keep_decision
from gonka_node.aggregator.store import RoundRow, ShardDecision, Store, now_ms
from gonka_node.aggregator.validate import warm_sketch_tables
from gonka_node.core.config import AggregationSettings, RoundSettings
from training.overlap import base_round

log = logging.getLogger(__name__)
DECODE_SLOTS = max(1, min(4, os.cpu_count() or 1))  # payloads decoded and checked at once


class RoundEngine(Acceptance):
    def __init__(
        self,
        ctx: EpochContext,
        settings: RoundSettings,
        aggregation: AggregationSettings,
        store: Store,
        chain: ChainView,
        checkpoints: CheckpointIO,
        signer: SigningKey,
        clock: Callable[[], int] = now_ms,
        evidence: EvidenceSink | None = None,
        exchange: ShardExchange | None = None,
    ) -> None:
        self.ctx, self.settings, self.aggregation = ctx, settings, aggregation
        self.exchange = exchange  # how this shard reaches the others (ctx.shard set); None: unsharded
        self.evidence = evidence
        self.store, self.chain, self.checkpoints, self.signer = store, chain, checkpoints, signer
        self.clock = clock
        self.current: RoundRow | None = None
        self.closing = False
        self.closed_for_submissions = asyncio.Event()  # set when the open round closes; new one per round
        self._in_flight: dict[bytes, InFlight] = {}
        self.stream_limits = StreamLimits(
            settings.stream_idle_s, settings.stream_setup_s, settings.min_upload_kib_per_s * 1024
        )
        # Payloads checked at once after their receipts, each in a worker thread (torch and numpy release
        # the GIL), each holding one decoded tensor (validate.scan_update): memory stays bounded by
        # slots × a tensor, whatever the backlog (aggregator/deferred.py).
        self.checks = CheckPool(DECODE_SLOTS, self._check_stored)
        offsets = None if ctx.shard is None else ctx.shard.offsets
        self.sketch_tables = self.checks.prepare(  # done: the first payload's sketch computes no table
            lambda: warm_sketch_tables(ctx.spec, offsets), "computing the sketch's hash tables"
        )
        self._check_errors: dict[tuple[int, int, bytes], int] = {}  # our failures to check a stored payload
        self._trees: dict[int, RewardTree | None] = {}
        self.round_closed = asyncio.Event()
        self._signin_closed_seen = False
        self._members_of_round: tuple[int, set[bytes]] | None = None  # (round, hosts that may submit)
        self._warmed: tuple[int, int] | None = None  # the round whose hosts' records were read ahead
        self._close_failed: bool | None = None  # skip flag of a close that failed and must be retried
        self._close_failures: tuple[int, int] = (0, 0)  # (attempts, first failure ms)
        self._opening_failed = 0  # failed attempts to open the next round (its seed commitment): retried
        self.metrics = RoundMetrics()  # what it reports (aggregator/metrics.py); set by whoever serves them
        # Writes each finalized round's files to the object store before the chain names them
        # (aggregator/publish.py); None: the data directory is the store (nothing to copy).
        self.publisher: RoundPublisher | None = None
        self._closing_since: float | None = None  # monotonic time the open round's close began
        self.openings = OpeningDesk(self)  # top-k challenges: OpenResidual's intake (aggregator/openings.py)
        self._opening_wait: tuple[int, int] | None = None  # the round whose wait for openings was logged

    # ---- start / resume ----------------------------------------------------------------------------

    def start(self) -> None:
        """Restore from disk: finish an interrupted finalization, else resume or open a round."""
        ctx = self.ctx
        for stored in self.store.rounds(ctx.epoch):
            if stored.state in ("finalizing", "skipping"):
                log.info("resuming the finalization of round %d/%d", ctx.epoch, stored.round)
                self._finish(stored)
        row = self._resume_or_open()
        self._warm_now(row)
        if row is not None and row.opened_ms < self.clock() - 1000:
            log.info(
                "resumed open round %d/%d with %d accepted submissions (deadline %s)",
                ctx.epoch, row.round, len(self.store.submitted_hosts(ctx.epoch, row.round)), clock_text(row.deadline_ms),
            )
        self._activate(row)

    def _open_and_warm(self) -> RoundRow | None:
        row = self._resume_or_open()
        self._warm_now(row)
        return row

    def _warm_now(self, row: RoundRow | None) -> None:
        """The round's hosts' chain records read in one pass before the round takes uploads (blocking:
        at start or in a thread), so that none of its uploads waits for a chain read of its own, nor for
        this pass, and a burst of uploads at the opening does not become a burst of reads. Best effort:
        on a chain failure the round's first tick tries again, and uploads read their own records."""
        if row is None or self._warmed == (row.epoch, row.round):
            return
        try:
            self.chain.warm_now(row.epoch)
        except Exception as exc:  # the chain is unreachable: nothing lost
            log.debug("round %d/%d: could not read the hosts' records ahead (%s)", row.epoch, row.round, exc)
            return
        self._warmed = (row.epoch, row.round)

    def _resume_or_open(self) -> RoundRow | None:
        """The round to take submissions for: the stored open one (its commitment sent if a crash or an
        outage came between the store and the chain), else the next one, opened now."""
        rows = self.store.rounds(self.ctx.epoch)
        if rows and rows[-1].state == "open":
            return self._commit(rows[-1])
        return self._open_after(rows[-1] if rows else None)

    def base_path(self, round_: int) -> Path:
        """Checkpoint a round trains from: the global model after its base round (the overlap rule)."""
        return self.global_path(base_round(round_, self.ctx.overlap))

    def global_path(self, after: int) -> Path:
        """The global model after round `after`: the last finalized round's checkpoint up to it, or the epoch's
        initial one."""
        last = self._last_finalized(after + 1)
        return self.ctx.initial_checkpoint if last is None else self.store.checkpoint_path(self.ctx.epoch, last)

    def global_sha256(self, after: int) -> bytes:
        """The hash of the global model after round `after` (closed; 0: the initial model). A skipped
        round records the model it left unchanged, so every closed row names it."""
        if after < 1:
            return self.ctx.initial_sha256
        row = self.store.get_round(self.ctx.epoch, after)
        assert row is not None and row.checkpoint_sha256 is not None, f"round {after} is not closed"
        return row.checkpoint_sha256

    def _open_after(self, last: RoundRow | None) -> RoundRow | None:
        """Open the round after `last` (None: the first; returns None when the epoch is over): its seed
        secret is stored, then its commitment sent on chain (blocking: run at start or in a thread).
        Submissions are taken only once the commitment is on chain, so the replay pick, which the
        secret decides, is fixed before any payload is seen."""
        ctx = self.ctx
        if last is not None and last.round >= ctx.n_rounds:
            return None
        round_ = 1 if last is None else last.round + 1
        base = self.global_sha256(base_round(round_, ctx.overlap))
        deadline = self.clock() + int(ctx.round_length_s * 1000)
        row = self._commit(self.store.open_round(ctx.epoch, round_, base, deadline, new_secret()))
        log.info("round %d/%d open until %s", ctx.epoch, round_, clock_text(deadline))
        return row

    def _commit(self, row: RoundRow) -> RoundRow:
        if row.seed_secret is None:  # a round opened by a version that kept no secret
            self.store.set_seed_secret(row.epoch, row.round, new_secret())
            row = self.store.get_round(row.epoch, row.round) or row
        assert row.seed_secret is not None
        self.chain.commit_seed(row.epoch, row.round, row.seed_secret)
        return row

    def _activate(self, row: RoundRow | None) -> None:
        """Start taking submissions for `row` (None: the epoch is over)."""
        self.current = row
        self.closing = False
        self.closed_for_submissions = asyncio.Event()
        decided = None if row is None else ShardDecision.of(row)
        if decided is not None:  # a shard restarted after deciding its close: no uploads, it closes as decided
            self.closing, self._close_failed = True, decided.skip
            self.closed_for_submissions.set()

    # ---- submissions -------------------------------------------------------------------------------

    # ---- closing -----------------------------------------------------------------------------------

    async def tick(self) -> None:
        """Close, extend or skip the open round when its rule says so (called periodically)."""
        if self._opening_failed:  # the next round's commitment did not reach the chain: again
            await self._open_next()
            return
        r = self.current
        if r is None:
            return
        if self.closing:
            # Ticks run one at a time, so a round still closing here is one whose close failed
            # (the chain was unreachable): finish it from what is on disk.
            if self._close_failed is not None:
                await self.close(skip=self._close_failed)
            return
        await self._warm_members(r)
        # What counts is checked: the round's pending checks first (uploads go on meanwhile).
        self.resume_checks()
        await self.checks.drain(r.epoch, r.round)
        accepted = self.store.submitted_hosts(r.epoch, r.round, checked_only=True)
        everyone = await self._everyone_submitted(r, accepted)
        if everyone or (self.clock() > r.deadline_ms and len(accepted) >= self.settings.quorum):
            await self.close(skip=False)
        elif self.clock() > r.deadline_ms and r.extensions < self.settings.max_extensions:
            deadline = self.clock() + int(self.settings.extend_s * 1000)
            self.store.extend_round(r.epoch, r.round, deadline)
            self.current = self.store.get_round(r.epoch, r.round)
            log.info(
                "round %d/%d below quorum (%d): extended to %s", r.epoch, r.round, len(accepted), clock_text(deadline)
            )
        elif self.clock() > r.deadline_ms:
            await self.close(skip=True)

    async def _warm_members(self, r: RoundRow) -> None:
        """Once per round, the hosts' chain records read in one pass (uploads then authenticate from the
        cache), if the opening could not (`_warm_now`); best effort: on a chain failure each upload reads
        its own record, as without."""
        if self._warmed == (r.epoch, r.round):
            return
        self._warmed = (r.epoch, r.round)
        try:
            await self.chain.warm(r.epoch)
        except Exception as exc:  # the chain is unreachable: nothing lost, uploads read it themselves
            log.debug("round %d/%d: could not read the hosts' records ahead (%s)", r.epoch, r.round, exc)

    async def _signin_closed(self, epoch: int) -> bool:
        """Whether the chain's latest block is past the epoch's sign-in window (cached once true)."""
        if self._signin_closed_seen:
            return True
        end = await self.chain.signin_end(epoch)
        self._signin_closed_seen = await self.chain.chain_time() >= end
        return self._signin_closed_seen

    async def _everyone_submitted(self, r: RoundRow, accepted: set[bytes]) -> bool:
        """Whether every host that may submit in the round has been accepted.

        "Everyone" means everyone who can still sign in too: while the sign-in window is open a later host
        may join (and the registry refuses to finalize before the window ends). Once it is closed the set
        can only shrink (a host leaves or is slashed), so it is read once per round, after the window:
        never from a cache filled while hosts were still joining."""
        if not accepted or not await self._signin_closed(r.epoch):
            return False
        if self._members_of_round is None or self._members_of_round[0] != r.round:
            members = await asyncio.to_thread(self.chain.members, r.epoch)
            self._members_of_round = (r.round, {m.address for m in members})
        hosts = self._members_of_round[1]
        return bool(hosts) and hosts <= accepted

    async def close(self, skip: bool) -> None:
        r = self.current
        assert r is not None
        # From here on, submissions of this round are refused as LATE, and uploads still streaming end
        # with LATE now: nothing a host holds open delays the close. No stream can store a payload after
        # this line, since the check and the store's insert run on this event loop without a pause.
        self.closing = True
        self.closed_for_submissions.set()
        self._closing_since = self._closing_since or time.monotonic()
        # No payload can be stored from here on; those stored before are checked before the close reads them.
        self.resume_checks()
        await self.checks.drain(r.epoch, r.round)
        if any(p.round == r.round for p in self.store.pending_submissions(r.epoch)):  # a check of ours failed
            self._close_failed = skip
            log.warning("round %d/%d: payloads still unchecked; the close waits for them", r.epoch, r.round)
            return
        try:
            row = await asyncio.to_thread(self._close_sync, r, skip)
        except (ShardPending, OpeningsPending) as exc:  # waiting on others is not failing: retried quietly
            self._close_failed = skip
            log.debug("round %d/%d: %s", r.epoch, r.round, exc)
            return
        except Exception as exc:  # the chain (or a disk) failed: keep refusing, retry at the next tick
            self._note_close_failure(r, skip, exc)
            return
        self._report_closed(row)
        if self._close_failures[0]:
            log.warning(
                "round %d/%d: closing completed after %d failed attempts over %.1f s (state %s)",
                r.epoch, r.round, self._close_failures[0], (self.clock() - self._close_failures[1]) / 1000,
                row.state,
            )
        self._close_failed, self._close_failures = None, (0, 0)
        # `current` stays the closed round (closing: late uploads hear LATE) until the next round's seed
        # commitment is on chain and it takes submissions.
        self.round_closed.set()
        self.round_closed = asyncio.Event()
        await self._open_next()

    def _report_closed(self, row: RoundRow) -> None:
        seconds, self._closing_since = time.monotonic() - (self._closing_since or time.monotonic()), None
        wanted = self.metrics.wants_contributions
        self.metrics.round_closed(row, seconds, self.store.contributions(row.epoch, row.round) if wanted else [])

    async def _open_next(self) -> None:
        """Open the next round (its seed committed on chain first); on failure, again at the next tick,
        saying so once and then every 50 attempts."""
        try:
            self._activate(await asyncio.to_thread(self._open_and_warm))
        except Exception as exc:  # the chain is unreachable: the commitment is retried every tick
            if self._opening_failed % 50 == 0:
                log.warning("epoch %d: opening the next round (committing its seed on chain) failed %d time(s) "
                            "(%s: %s); retrying every tick", self.ctx.epoch, self._opening_failed + 1,
                            type(exc).__name__, exc)
            self._opening_failed += 1
            return
        self._opening_failed = 0

    def _note_close_failure(self, r: RoundRow, skip: bool, exc: Exception) -> None:
        """One line when closing first fails, then one every 50 attempts: the retry runs every tick."""
        count, since = self._close_failures
        self._close_failed, self._close_failures = skip, (count + 1, since or self.clock())
        state = self.store.get_round(r.epoch, r.round)
        where = state.state if state is not None else "?"
        if count == 0:
            log.warning(
                "round %d/%d: closing failed (state %s, %s: %s); submissions stay refused, retrying every tick",
                r.epoch, r.round, where, type(exc).__name__, exc,
            )
        elif count % 50 == 0:
            log.warning("round %d/%d: closing still failing after %d attempts (%s)", r.epoch, r.round, count + 1, exc)

    def _close_sync(self, r: RoundRow, skip: bool) -> RoundRow:
        recorded = self.store.get_round(r.epoch, r.round)
        if recorded is not None and recorded.state in ("finalizing", "skipping"):
            return self._finish(recorded)  # the intent of an earlier, failed attempt: never recompute it
        # A shard's one report covers what it decides here, kept before the seed is revealed.
        decision = keep_decision(self.store, r, skip) if self.ctx.shard is not None else None
        seed = self._revealed_seed(r)
        if skip and self.ctx.shard is None:  # a shard's skip goes through the verdict: every shard skips
            self.store.record_finalize_intent(
                r.epoch, r.round, "skipping", self.global_sha256(r.round - 1), ZERO32, 0, "skipped", []
            )
        else:
            outcome = self._compute(r, seed, decision, self._await_openings(r))
            if outcome.aggregated == 0:  # nothing worth aggregating: same as a skip, but scores are kept
                self.store.record_finalize_intent(
                    r.epoch, r.round, "skipping", self.global_sha256(r.round - 1), ZERO32, 0, "skipped",
                    outcome.contributions,
                )
            else:
                self.store.record_finalize_intent(
                    r.epoch,
                    r.round,
                    "finalizing",
                    outcome.checkpoint_sha256,
                    outcome.rewards_root,
                    outcome.total_reward,
                    outcome.rule,
                    outcome.contributions,
                    outcome.heldout,
                )
        row = self.store.get_round(r.epoch, r.round)
        assert row is not None
        return self._finish(row)

    def _revealed_seed(self, r: RoundRow) -> bytes:
        """Reveal this aggregator's secret now that the round's submissions are fixed, and return the
        round's seed once every aggregator that committed has revealed (else raise: the close is retried
        next tick, as for any chain failure)."""
        assert r.seed_secret is not None
        stored = self.store.get_round(r.epoch, r.round)
        if stored is not None and stored.round_seed is not None:  # complete before (a close that waits, a restart)
            return stored.round_seed
        seed = self.chain.reveal_seed(r.epoch, r.round, r.seed_secret)
        if not seed.complete:
            raise SeedPending(
                f"round {r.epoch}/{r.round}: {seed.reveals} of {seed.commits} aggregators revealed their seed"
            )
        self.store.set_round_seed(r.epoch, r.round, seed.seed, self.clock())  # the openings' clock starts
        return seed.seed

    def _await_openings(self, r: RoundRow) -> dict[bytes, Opened]:
        """In a top-k round, each challenged host's opening (aggregator/challenges.py), once every one is
        stored or the deadline passed; before that raise OpeningsPending (the close is retried each tick,
        and a restarted aggregator resumes the wait from the seed time it stored)."""
        row = self.store.get_round(r.epoch, r.round)
        assert row is not None and row.round_seed is not None
        chosen = picked(self.ctx, row, self.store.submitted_hosts(r.epoch, r.round, checked_only=True))
        if not chosen:
            return {}
        due = deadline_ms(row, self.aggregation.opening_timeout_s)
        # A host that left or was slashed is excluded (`departed`) whatever it opens: not waited for. The
        # chain is read outside the lock, which an opening's store takes on the event loop.
        awaited = chosen & self._members_now(r.epoch) if chosen - self.store.openings(r.epoch, r.round).keys() \
            else chosen
        with self.openings.lock:  # an opening is stored before the deadline or this sees the deadline passed
            stored = self.store.openings(r.epoch, r.round)
            missing = awaited - stored.keys()
            if missing and self.clock() <= due:
                if self._opening_wait != (r.epoch, r.round):  # said once per round; the wait is retried each tick
                    self._opening_wait = (r.epoch, r.round)
                    log.info("round %d/%d: waiting for %d challenged hosts to open their residual (due by %s)",
                             r.epoch, r.round, len(missing), clock_text(due))
                raise OpeningsPending(f"round {r.epoch}/{r.round}: {len(missing)} of {len(chosen)} challenged hosts "
                                      f"have not opened their residual (due by {clock_text(due)})")
        layout = self.openings.layout
        return {h: Opened(sample(self.ctx, layout, row, h), due, stored.get(h),
                          self.store.previous_submission(r.epoch, r.round, h)) for h in sorted(chosen)}

    def _members_now(self, epoch: int) -> set[bytes]:
        return {m.address for m in self.chain.members(epoch)}

    def _compute(
        self, r: RoundRow, seed: bytes, decision: ShardDecision | None, opened: Mapping[bytes, Opened]
    ) -> RoundOutcome:
        """Round `r`'s outcome: the whole close, or a shard's close of its fragment as `decision` says."""
        inputs = self._closing_inputs(r, seed, opened)
        if decision is None:
            return compute_outcome(inputs)
        return self._close_fragment(inputs, decision)

    def _closing_inputs(self, r: RoundRow, seed: bytes, opened: Mapping[bytes, Opened] | None = None) -> ClosingInputs:
        """Everything round `r`'s close reads (gonka_node/aggregator/close.py), gathered before it computes."""
        ctx = self.ctx
        members = self.chain.members(r.epoch)
        return ClosingInputs(
            ctx=ctx,
            round_row=r,
            seed=seed,
            submissions=self.store.submissions(r.epoch, r.round),
            earlier=[s for row in self.store.rounds(r.epoch) if row.round < r.round
                     for s in self.store.submissions(r.epoch, row.round)],
            slots={m.address: m.slot for m in members},
            node_keys={m.address: m.node_key for m in members},
            base_path=self.base_path(r.round),
            step_base=(self.global_path(r.round - 1), self.global_sha256(r.round - 1)),
            prev_residual=self._prev_residual(r.round),
            prev_outer_state=self._prev_outer_state(r.round),
            eager=self._eager_bases(r.round) if ctx.overlap == "eager" else None,
            opened=opened or {},
            store=self.store,
            checkpoints=self.checkpoints,
            aggregation=self.aggregation,
        )

    def _close_fragment(self, inputs: ClosingInputs, decision: ShardDecision) -> RoundOutcome:
        """A shard's close of its fragment (gonka_node/aggregator/shard_close.py)."""
        assert self.ctx.shard is not None and self.exchange is not None  # a shard's engine has both
        return close_fragment(inputs, self.ctx.shard, self.exchange, decision, self.settings.max_update_norm)

    def _last_finalized(self, before: int) -> int | None:
        """The last finalized round before `before` (None: none; a skipped round leaves the model as it was)."""
        return next((row.round for row in reversed(self.store.rounds(self.ctx.epoch))
                     if row.round < before and row.state == "finalized"), None)

    def _prev_residual(self, round_: int) -> Path | None:
        """The compressed broadcast's residual after the last finalized round before `round_`."""
        last = self._last_finalized(round_)
        return None if last is None else residual_path(self.store.update_path(self.ctx.epoch, last))

    def _eager_bases(self, round_: int) -> EagerBases:
        """What the replay rebuilds each host's eager base of `round_` from (aggregator/eager.py): the outer momentum
        after round − 2, the hosts' accepted payloads of round − 1, the model after round − 1 (a merge's)."""
        ctx, prev, load = self.ctx, round_ - 1, self.checkpoints.load
        previous = {s.host: Path(s.path) for s in self.store.submissions(ctx.epoch, prev)} if prev >= 1 else {}
        return EagerBases(ctx.codec_for(prev), ctx.spec, ctx.outer_lr, ctx.outer_momentum, self._prev_outer_state(prev),
                          previous, ctx.forecast_step, ctx.merge_step,
                          lambda: load(self.global_path(prev), self.global_sha256(prev)))

    def _prev_outer_state(self, round_: int) -> Path | None:
        last = self._last_finalized(round_)
        return None if last is None else self.store.outer_state_path(self.ctx.epoch, last)

    def _finish(self, row: RoundRow) -> RoundRow:
        """Put the recorded intent on chain unless the chain already has it; then mark it done."""
        assert (
            row.checkpoint_sha256 is not None
            and row.rewards_root is not None
            and row.total_reward is not None
        )
        if self.publisher is not None and row.state == "finalizing":  # every attempt: a resume re-writes
            self.publisher.publish(row.epoch, row.round)
        on_chain = self.chain.round_result(row.epoch, row.round)
        n = sum(1 for c in self.store.contributions(row.epoch, row.round) if c.reward > 0)
        if on_chain.finalized:
            if (bytes(on_chain.checkpoint_sha256), bytes(on_chain.rewards_root)) != (
                row.checkpoint_sha256,
                row.rewards_root,
            ):
                raise RuntimeError(
                    f"round {row.epoch}/{row.round} is finalized on chain with checkpoint "
                    f"{bytes(on_chain.checkpoint_sha256).hex()}, but this aggregator computed {row.checkpoint_sha256.hex()}"
                )
            tx = b""
            log.warning(
                "round %d/%d was already finalized on chain with the recorded checkpoint %s…: "
                "not sending finalize again", row.epoch, row.round, row.checkpoint_sha256.hex()[:16],
            )
        elif (voted := self._own_vote(row, n)) is not None:
            tx = b""
            log.warning(
                "round %d/%d: this aggregator already voted for the recorded result (%s…) before a restart; "
                "not voting again, the round finalizes when the other aggregators' votes reach the quorum",
                row.epoch, row.round, voted.hex()[:16],
            )
        else:
            result = self.chain.finalize_round(
                row.epoch,
                row.round,
                row.checkpoint_sha256,
                row.rewards_root,
                n,
                row.total_reward,
            )
            tx = _tx_bytes(result)
            log.info(
                "round %d/%d finalized on chain: checkpoint %s…, %d paid, tx %s",
                row.epoch, row.round, row.checkpoint_sha256.hex()[:16], n, tx.hex() or "?",
            )
        self.store.mark_finalized(row.epoch, row.round, tx, skipped=row.state == "skipping")
        done = self.store.get_round(row.epoch, row.round)
        assert done is not None
        return done

    def _own_vote(self, row: RoundRow, n: int) -> bytes | None:
        """This account's vote for the round if it has one (a vote sent before a crash, with a quorum of
        several aggregators not yet reached); None if it has not voted. A vote for another result than the
        recorded intent cannot happen without tampering with the store: refuse to go on."""
        assert row.checkpoint_sha256 is not None and row.rewards_root is not None and row.total_reward is not None
        vote = self.chain.round_vote(row.epoch, row.round)
        if vote == bytes(32):
            return None
        mine = round_result_hash(row.checkpoint_sha256, row.rewards_root, n, row.total_reward)
        if vote != mine:
            raise RuntimeError(
                f"round {row.epoch}/{row.round}: this aggregator's vote on chain {vote.hex()} is not the "
                f"recorded intent's result {mine.hex()}"
            )
        return vote

    # ---- serving results ---------------------------------------------------------------------------

    def reward_tree(self, round_: int) -> RewardTree | None:
        if round_ not in self._trees:
            rewards = {c.host: c.reward for c in self.store.contributions(self.ctx.epoch, round_)}
            self._trees[round_] = reward_tree(self.ctx, self.ctx.epoch, round_, rewards)
        return self._trees[round_]

    async def run(self, stop: asyncio.Event, interval_s: float = 0.2) -> None:
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:  # a failed close is retried next tick; the intent on disk keeps it safe
                log.exception("round tick failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)


def _tx_bytes(result: Any) -> bytes:
    """The transaction hash in what a finalize call returned (a receipt, or an object with tx_hash)."""
    value = result.get("transactionHash") if isinstance(result, Mapping) else getattr(result, "tx_hash", result)
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, str) and value.startswith("0x"):
        return bytes.fromhex(value[2:])
    return b""
