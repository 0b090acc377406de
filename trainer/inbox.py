"""Rank 0's side of the trajectory stream: buffer groups, drop over-stale ones, hand out batches.

Groups are read (this consumer's own pending entries first after a restart, then new ones) into a
buffer; once B fresh groups are buffered, the B oldest (by oldest token version, then creation time
and id) form the batch and the rest stay buffered, still pending in Redis, for the next step. A
group more than the staleness policy's `version_bound` (eta, or ceil(alpha)) versions behind the
trainer is dropped: admission gets its capacity back and it is acknowledged at once. The policy is
admission's own (`Admission.staleness`), so the inbox drops by the rule producers were admitted by.
Under the per-sample policy (ROLL's alpha) the bound is ceil(alpha) versions and, for a fractional
alpha, of the groups exactly ceil(alpha) versions old the oldest floor(frac(alpha) x B)
(`boundary_quota`) stay and the rest are dropped the same way (asyncrl/api/staleness.py; one
count, `dropped`, for both policies). A group that cannot be
trained (it does not decode, or fails `asyncrl.transport.content.check_group`: a NaN logprob,
lengths that disagree, ...) never reaches the buffer: the consumer dead-letters it with the reason
and acknowledges it, also when it was still pending from before a restart, so it cannot crash-loop
the trainer; admission gets its capacity back here too. With spec.algorithm.dynamicSampling (DAPO),
a buffered group whose rewards are all equal (`zero_signal`: its advantages are exactly 0, it
carries no gradient) is skipped the same way: admission gets its capacity back (so a producer makes
a replacement), it is acknowledged at once and counted, and the step keeps reading until B groups
with signal are buffered. A step draws at most `max_draws` groups (skipped + kept, oldest first):
once it has, it takes the groups with signal it kept, fewer than B (`batch_target`), or, when all
of them were skipped, the next group whatever its rewards: a run whose groups almost never carry
signal trains slowly and says so (the trainer warns and counts the step) instead of waiting
forever. Trained groups are acknowledged only at the next checkpoint (`ack_trained`, from
`Trainer.commit`; checkpoint.py says why), and a resumed trainer first acknowledges the window its
checkpoint already trained (`ack_restored`), before any read.

Nothing is stranded in a running trainer: every `pending_check_s` seconds a read also re-reads
this consumer's own pending list (`TrajectoryConsumer.recover_pending`: entries Redis delivered in
a reply the client lost) and reclaims entries idle for `reclaim_idle_ms` in any consumer's list
(`reclaim`: a previous pod of another name). Without it such entries wait for the next restart and,
at eta=0, hold admission capacity that no producer gets back. Entries buffered or trained here are
in flight in the consumer, so neither pass hands them out twice.

Admission cannot leak (`reconcile`, asyncrl/transport/admission.py says how): the inbox counts the
groups trained and acknowledged (`trained_acked`: the trainer sets it from its checkpoint on resume),
which with the stream's length tells admission how many accepted groups still exist. A drift two
checks in a row agree on is repaired and logged.

With spec.evaluation, rank 0 also reads the held-out evaluation results (`EvalInbox`, over
asyncrl/transport/evaluation.py's `EvalChannel`). It keeps no state across restarts: a new trainer
reads the results stream from its start, and what an earlier life already handled (the restored
report's evaluations, the eval lines left in metrics.jsonl) is told apart from what is new.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from asyncrl.api.status_report import EvalRecord
from asyncrl.api.weight_labels import Lineage, WeightLabel
from asyncrl.transport.admission import Admission, Drift
from asyncrl.transport.streams import Delivery, TrajectoryConsumer
from asyncrl.transport.wire import TrajectoryGroup

log = logging.getLogger("asyncrl.trainer.inbox")


@dataclass
class StreamIO:
    """Rank 0's connections: the trajectory consumer, admission, version channel, engine registry,
    and the evaluation channel (`EvalChannel`; needed only with spec.evaluation)."""

    redis: Any
    consumer: Any
    admission: Any
    versions: Any
    registry: Any
    evals: Any = None


class GroupInbox:
    """The groups rank 0 has read but not yet acknowledged, and the reads and acks that move them."""

    def __init__(self, consumer: TrajectoryConsumer, admission: Admission, *, batch_size: int,
                 lineage: Lineage | None = None, read_block_ms: int = 1000, pending_check_s: float = 30.0,
                 reclaim_idle_ms: int = 600_000, dynamic_sampling: bool = False,
                 max_draws: int | None = None) -> None:
        self.consumer = consumer
        self.admission = admission
        self.batch_size = batch_size
        self.staleness = admission.staleness
        """The job's staleness policy (admission's): the version bound and, per-sample, the boundary quota."""
        self.lineage = lineage if lineage is not None else Lineage()
        """The trainer's lineage: a group with a token of weights outside it is dropped (drop_ghosts)."""
        self.read_block_ms = read_block_ms
        self.pending_check_s = pending_check_s
        """How often a read also re-reads the own pending list and reclaims idle entries."""
        self.reclaim_idle_ms = reclaim_idle_ms
        """Idle time after which another consumer's entry is taken over: far above a step (streams.py)."""
        # (a restarted consumer reads its own pending list first anyway: the first pass can wait)
        self._last_pending_check = time.monotonic()
        self.buffer: list[Delivery] = []       # read, fresh, not yet trained (still pending in Redis)
        self.uncommitted: list[Delivery] = []  # trained since the last checkpoint (acked at the next one)
        self.dead_lettered = 0                 # entries the consumer dead-lettered (admission told)
        self.trained_acked = 0                 # groups trained and acknowledged (gone from the stream)
        self._drift = 0                        # the last check's unrepaired drift (repaired if the next agrees)
        self.dynamic_sampling = dynamic_sampling
        self.max_draws = max_draws if max_draws is not None else 4 * batch_size
        """With dynamic sampling: groups drawn for one step before it takes what it has (see the top)."""
        self.step_skipped = 0                  # zero-signal groups skipped since the last batch was taken

    async def drop_ghosts(self) -> int:
        """Drop buffered groups with a token generated on weights outside the lineage (asyncrl.api.weight_labels:
        a timeline that a restart threw away, past the version this lineage resumed from): their
        labels name weights no checkpoint reproduces, so their staleness, the proximal policy and
        the admission bound would all be computed from a version they were not generated by.
        Admission frees their capacity, they are acked, as over-stale groups are."""
        keep: list[Delivery] = []
        ghosts: list[Delivery] = []
        for d in self.buffer:
            (keep if in_lineage(d.group, self.lineage) else ghosts).append(d)
        self.buffer = keep
        await self._discard(ghosts)
        return len(ghosts)

    async def drop_stale(self, version: int) -> int:
        """Drop buffered groups too old for `version`: admission frees their capacity, they are acked.

        With a `boundary_quota`, only the oldest that many of the groups exactly at the bound stay:
        they sort first, so all of them go into this step's batch, and at the next version they
        are past the bound; called before each `take_batch`, no batch holds more than the quota."""
        keep: list[Delivery] = []
        stale: list[Delivery] = []
        lag, quota = self.staleness.version_bound, self.staleness.boundary_quota(self.batch_size)
        if quota is not None:
            self._sort_buffer()
        at_bound = 0
        for d in self.buffer:
            if self.staleness.too_stale(d.group.oldest_version(), version):
                stale.append(d)
            elif quota is not None and 0 <= d.group.oldest_version() == version - lag:
                (keep if at_bound < quota else stale).append(d)
                at_bound += 1
            else:
                keep.append(d)
        self.buffer = keep
        await self._discard(stale)
        return len(stale)

    async def _discard(self, deliveries: list[Delivery]) -> None:
        """Groups read but never to be trained: admission gets their capacity back, then they are acked."""
        if deliveries:
            await self.admission.record_dropped(len(deliveries))
            await self.consumer.ack(deliveries)

    async def skip_zero_signal(self) -> list[TrajectoryGroup]:
        """With dynamic sampling: skip the buffered groups whose rewards are all equal among this
        step's draws (oldest first, until `batch_target` groups with signal are kept); admission frees
        their capacity, they are acked. Returns the groups skipped (none without dynamic sampling).

        A group is skipped only while the step has drawn fewer than `max_draws` (skipped + kept);
        once it has, the next group is kept whatever its rewards, so a step never waits for signal
        that does not come (see the top)."""
        if not self.dynamic_sampling or not self.buffer:
            return []
        self._sort_buffer()
        keep: list[Delivery] = []
        skipped: list[Delivery] = []
        kept = 0  # groups of this step's draws kept (the batch so far)
        for d in self.buffer:
            if kept >= self.batch_target(len(skipped)):  # the step's draws are over: the rest waits
                keep.append(d)
            elif zero_signal(d.group) and self.step_skipped + len(skipped) + kept < self.max_draws:
                skipped.append(d)
            else:
                keep.append(d)
                kept += 1
        self.buffer = keep
        await self._discard(skipped)
        self.step_skipped += len(skipped)
        return [d.group for d in skipped]

    def batch_target(self, more_skipped: int = 0) -> int:
        """Groups the step's batch takes: B; with dynamic sampling fewer once skips plus the batch
        would pass `max_draws`, but at least one."""
        if not self.dynamic_sampling:
            return self.batch_size
        return min(self.batch_size, max(self.max_draws - self.step_skipped - more_skipped, 1))

    def starved(self) -> bool:
        """True when dynamic sampling's `max_draws` cut this step's batch below B (see the top)."""
        return self.batch_target() < self.batch_size

    def take_batch(self, limit: int | None = None) -> list[TrajectoryGroup] | None:
        """The `batch_target` (B) oldest buffered groups (now uncommitted), at most `limit` (the rest
        of the step's batch comes from elsewhere: the replay buffer), or None while fewer are buffered."""
        target = self.batch_target() if limit is None else min(self.batch_target(), limit)
        if len(self.buffer) < target:
            return None
        self._sort_buffer()
        batch, self.buffer = self.buffer[:target], self.buffer[target:]
        self.uncommitted.extend(batch)
        self.step_skipped = 0
        return [d.group for d in batch]

    def _sort_buffer(self) -> None:
        self.buffer.sort(key=lambda d: (d.group.oldest_version(), d.group.created_at, d.group.group_id))

    async def read(self) -> None:
        """Read up to the missing number of groups (blocking briefly); a group already buffered is skipped.

        Every `pending_check_s` seconds, first recover entries stranded in the own pending list and
        reclaim idle ones (see the top)."""
        deliveries: list[Delivery] = []
        if time.monotonic() - self._last_pending_check >= self.pending_check_s:
            deliveries += await self.consumer.recover_pending()
            deliveries += await self.consumer.reclaim(self.reclaim_idle_ms)
            self._last_pending_check = time.monotonic()
        deliveries += await self.consumer.read(count=max(self.batch_size - len(self.buffer), 1),
                                               block_ms=self.read_block_ms)
        await self.release_dead_lettered()
        known = {d.group.group_id for d in self.buffer}
        for d in deliveries:
            if d.group.group_id not in known:
                self.buffer.append(d)
                known.add(d.group.group_id)

    async def release_dead_lettered(self) -> int:
        """Give admission back the capacity of entries the consumer dead-lettered since the last call.

        They were published (counted as accepted) but will never be trained; like over-stale groups,
        without this producers would be short of those slots for the rest of the job.
        """
        new = self.consumer.stats.dead_lettered - self.dead_lettered
        if new > 0:
            await self.admission.record_dead_lettered(new)
            self.dead_lettered += new
        return max(new, 0)

    async def reconcile(self) -> Drift:
        """Check admission's `accepted` against what exists; repair what the previous check saw too."""
        check = await self.admission.reconcile(self.trained_acked, repair=self._drift)
        if check.repaired:
            log.warning("admission drift repaired: %+d group(s) in 'accepted' (%s)", check.repaired,
                        "counted but neither in the stream nor trained: their capacity comes back"
                        if check.repaired < 0 else "in the stream but never counted")
        elif check.drift and not self._drift:
            log.info("admission drift of %+d group(s) seen; repaired if the next check sees it too", check.drift)
        self._drift = check.drift - check.repaired
        return check

    async def ack_restored(self, group_ids: Iterable[str]) -> int:
        """On resume, before any read: acknowledge the groups the restored checkpoint trained in its
        window (pending if the last life was killed between its checkpoint and its ack), so they
        are not trained again; returns how many pending entries that acknowledged."""
        return await self.consumer.ack_committed(group_ids)

    async def ack_trained(self) -> int:
        """Acknowledge every group trained since the last call (after a checkpoint); returns how many."""
        count = len(self.uncommitted)
        if self.uncommitted:
            await self.consumer.ack(self.uncommitted)
        self.uncommitted = []
        self.trained_acked += count
        return count


@dataclass
class StepDraw:
    """What rank 0 drew for one step's batch: dynamic sampling's per-step figures."""

    skipped: int = 0
    """Groups skipped for having no signal (`zero_signal`)."""
    batch: int = 0
    """Groups of the batch itself."""
    batch_zero_signal: int = 0
    """Groups of the batch without signal (all of them without dynamic sampling, a starved step's last)."""
    starved: bool = False
    """The batch is short: `max_draws` groups were drawn without B with signal."""
    dropped: int = 0
    """Groups dropped as too stale while this step's batch was read (`GroupInbox.drop_stale`)."""
    reward_sum: float = 0.0
    samples: int = 0
    """Sum and count of the rewards of every sample drawn (skipped and batch)."""

    def add(self, groups: Iterable[TrajectoryGroup], *, skipped: bool) -> None:
        for g in groups:
            if skipped:
                self.skipped += 1
            else:
                self.batch += 1
                self.batch_zero_signal += zero_signal(g)
            self.reward_sum += sum(float(s.reward) for s in g.samples)
            self.samples += len(g.samples)

    @property
    def zero_signal_fraction(self) -> float:
        """Of the groups drawn, the share without signal (0.0 when nothing was drawn)."""
        drawn = self.skipped + self.batch
        return (self.skipped + self.batch_zero_signal) / drawn if drawn else 0.0


def labels_of(group: TrajectoryGroup) -> set[WeightLabel]:
    """The labels of the weights that generated `group`'s tokens."""
    return {WeightLabel(v, t) for s in group.samples
            for v, t in zip(s.versions.tolist(), s.token_timelines().tolist())}


def in_lineage(group: TrajectoryGroup, lineage: Lineage) -> bool:
    """Whether every token of `group` was generated on weights of `lineage` (its label is)."""
    if lineage.timeline == 0 and all(s.timelines is None for s in group.samples):
        return True  # (every label is timeline 0's: the lineage's own)
    return all(lineage.contains(label) for label in labels_of(group))


def zero_signal(group: TrajectoryGroup) -> bool:
    """True when every reward of the group is the same: every estimator (grpo, dr_grpo, rloo) gives
    it advantages of exactly 0 (`compute_advantages` tests the same max == min), so it has no gradient."""
    rewards = [float(s.reward) for s in group.samples]
    return max(rewards, default=0.0) == min(rewards, default=0.0)


def eval_key(record: EvalRecord) -> tuple[int, float]:
    """What tells one evaluation result from another: its version and when it finished."""
    return record.policy_version, record.time


class EvalInbox:
    """Rank 0's side of the evaluation results: each read returns what arrived since the last one."""

    def __init__(self, channel: Any, *, handled: Iterable[tuple[int, float]] = (), page: int = 100) -> None:
        self.channel = channel
        self.after = "0-0"  # (a new trainer reads from the start: see the top)
        self.handled = set(handled)
        """`eval_key`s of results an earlier life (or an earlier read) already handled."""
        self.page = page

    async def request(self, version: int) -> bool:
        """Ask for an evaluation of `version`; False when it was asked for already (idempotent)."""
        return bool(await self.channel.request(version))

    async def read(self) -> tuple[list[EvalRecord], list[EvalRecord]]:
        """(every result read, the ones not handled before), oldest first; the new ones count as
        handled from now on."""
        read: list[EvalRecord] = []
        while True:
            entries = await self.channel.results(self.after, count=self.page)
            for entry_id, record in entries:
                self.after = entry_id
                read.append(record)
            if len(entries) < self.page:
                break
        new = []
        for record in read:
            if eval_key(record) not in self.handled:
                self.handled.add(eval_key(record))
                new.append(record)
        return read, new


def merge_evaluations(current: list[EvalRecord], read: Iterable[EvalRecord], limit: int) -> list[EvalRecord]:
    """One evaluation per policy version (a later result of a version replaces the earlier one),
    oldest version first, the newest `limit` kept."""
    by_version = {r.policy_version: r for r in current}
    for record in read:
        by_version[record.policy_version] = record
    return [by_version[v] for v in sorted(by_version)][-limit:]
