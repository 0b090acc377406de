"""TBA's replay buffer: trajectories already trained on, replayed by reward and recency.

What it keeps and how it samples follow the authors' buffer (bbartoldson/TBA `src/buffer_utils.py`):
per prompt, the newest `capacity_per_prompt` trajectories by the policy version that generated them
(a response seen again replaces its older copy); a replayed group is a prompt taken in turn (each
seen prompt once before any again, in random order) and `group_size` of its trajectories drawn by
softmax(`reward_priority` x reward), with replacement only when it keeps fewer. Unlike theirs the
buffer also has an overall bound (`capacity`, oldest evicted first) so that the trainer's memory
is bounded whatever the dataset's size. Kept by the one trainer process, in memory; `StepReplay`
is how the trainer's steps use it.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from asyncrl.api.spec import AsyncRLJob
from asyncrl.api.status_report import ReplayReport
from asyncrl.transport.wire import TrajectoryGroup, TrajectorySample

REPLAY_ENGINE_ID = "replay"
"""`engine_id` of a replayed group: it was not generated for this step."""


@dataclass
class ReplayItem:
    """One kept trajectory: the sample, log pi_ref of its response, its age and its bytes."""

    sample: TrajectorySample
    ref_sum: float
    version: int
    order: int
    """Insertion counter: among equal versions, the overall bound evicts the earliest kept first."""

    @property
    def nbytes(self) -> int:
        s = self.sample
        return int(s.response_ids.nbytes + s.behav_logprobs.nbytes + s.versions.nbytes)


@dataclass
class PromptEntry:
    """A prompt's tokens and its kept trajectories, oldest first."""

    prompt_ids: np.ndarray
    items: list[ReplayItem] = field(default_factory=list)


@dataclass(frozen=True)
class ReplayedGroup:
    """A group drawn from the buffer, with the reference log-probs of its samples (in order)."""

    group: TrajectoryGroup
    ref_sums: list[float]


@dataclass(frozen=True)
class ReplayStats:
    """What the buffer holds (shown in status as `replay`)."""

    trajectories: int
    prompts: int
    bytes: int
    capacity: int


def softmax_priorities(rewards: Sequence[float], inverse_temperature: float) -> np.ndarray:
    """Sampling probabilities softmax(inverse_temperature x reward), shifted by the max for safety."""
    z = np.asarray(rewards, dtype=np.float64) * inverse_temperature
    p = np.exp(z - z.max())
    return p / p.sum()


def sample_version(sample: TrajectorySample) -> int:
    """The policy version that generated a sample: its oldest token's (-1 when it has none)."""
    versions = sample.versions[sample.versions >= 0] if len(sample.versions) else sample.versions
    return int(versions.min()) if len(versions) else -1


class ReplayBuffer:
    """The trainer's buffer of trained trajectories, by prompt (see the module docstring)."""

    def __init__(self, *, job: str, group_size: int, capacity_per_prompt: int, capacity: int,
                 reward_priority: float) -> None:
        for name, value in (("group_size", group_size), ("capacity_per_prompt", capacity_per_prompt),
                            ("capacity", capacity)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        if reward_priority < 0:
            raise ValueError(f"reward_priority must be >= 0, got {reward_priority!r}")
        self.job, self.group_size = job, group_size
        self.capacity_per_prompt, self.capacity, self.reward_priority = capacity_per_prompt, capacity, reward_priority
        self.prompts: dict[str, PromptEntry] = {}
        self._order = itertools.count()
        self._unvisited: list[str] = []
        self._replayed = itertools.count(1)
        self._bytes = 0

    def __len__(self) -> int:
        return sum(len(e.items) for e in self.prompts.values())

    def stats(self) -> ReplayStats:
        prompt_bytes = sum(int(e.prompt_ids.nbytes) for e in self.prompts.values())
        return ReplayStats(trajectories=len(self), prompts=len(self.prompts), bytes=self._bytes + prompt_bytes,
                           capacity=self.capacity)

    def add(self, group: TrajectoryGroup, ref_sums: Sequence[float]) -> None:
        """Keep a trained group's trajectories with their reference log-probs."""
        if len(ref_sums) != len(group.samples):
            raise ValueError(f"ref_sums has {len(ref_sums)} entries for the {len(group.samples)} samples of group "
                             f"{group.group_id}")
        entry = self.prompts.setdefault(group.prompt_id, PromptEntry(np.array(group.prompt_ids)))
        new: dict[bytes, ReplayItem] = {}
        for s, r in zip(group.samples, ref_sums, strict=True):  # (a response twice in the group: the first)
            new.setdefault(s.response_ids.tobytes(), ReplayItem(s, float(r), sample_version(s), next(self._order)))
        kept = [it for it in entry.items if it.sample.response_ids.tobytes() not in new]
        # oldest first by version; within a version the new before the old (a stable sort, as TBA's)
        entry.items = sorted([*new.values(), *kept], key=lambda it: it.version)
        del entry.items[:-self.capacity_per_prompt]
        self._evict_overall()
        self._bytes = sum(it.nbytes for e in self.prompts.values() for it in e.items)

    def _evict_overall(self) -> None:
        """Drop the oldest trajectories overall while more than `capacity` are kept."""
        excess = len(self) - self.capacity
        if excess <= 0:
            return
        oldest = sorted(((it.version, it.order, pid) for pid, e in self.prompts.items() for it in e.items))[:excess]
        gone = {(pid, order) for _, order, pid in oldest}
        for pid in {pid for _, _, pid in oldest}:
            entry = self.prompts[pid]
            entry.items = [it for it in entry.items if (pid, it.order) not in gone]
            if not entry.items:
                del self.prompts[pid]

    def sample_groups(self, count: int, rng: np.random.Generator, *, now: float) -> list[ReplayedGroup]:
        """`count` replayed groups (none while the buffer is empty)."""
        return [self._sample_group(rng, now) for _ in range(count)] if self.prompts else []

    def _next_prompt(self, rng: np.random.Generator) -> str:
        """A prompt not replayed since every kept prompt last was (TBA's offline prompt set)."""
        self._unvisited = [pid for pid in self._unvisited if pid in self.prompts]
        if not self._unvisited:
            self._unvisited = sorted(self.prompts)
        return self._unvisited.pop(int(rng.integers(len(self._unvisited))))

    def _sample_group(self, rng: np.random.Generator, now: float) -> ReplayedGroup:
        pid = self._next_prompt(rng)
        entry = self.prompts[pid]
        p = softmax_priorities([it.sample.reward for it in entry.items], self.reward_priority)
        picks = rng.choice(len(entry.items), size=self.group_size, p=p, replace=len(entry.items) < self.group_size)
        items = [entry.items[int(i)] for i in picks]
        samples = [dataclasses.replace(it.sample, sample_index=k) for k, it in enumerate(items)]
        group = TrajectoryGroup(job=self.job, group_id=f"replay-{next(self._replayed)}", prompt_id=pid,
                                prompt_ids=entry.prompt_ids, samples=samples, engine_id=REPLAY_ENGINE_ID,
                                created_at=now, published_at=now)
        return ReplayedGroup(group, [it.ref_sum for it in items])


class StepReplay:
    """algorithm.replay as the trainer's steps use it: how many of a step's slots replayed groups
    fill and which (a function of the seed and the step only, so a resumed run draws the slots the
    lost life would have), what each step keeps, and the report."""

    def __init__(self, buffer: ReplayBuffer, *, seed: int, batch_size: int, on_policy_prob: float) -> None:
        self.buffer, self.seed, self.batch_size, self.on_policy_prob = buffer, seed, batch_size, on_policy_prob
        self.replayed_total = 0

    @classmethod
    def for_job(cls, job: AsyncRLJob) -> StepReplay | None:
        """The job's replay (None without algorithm.replay)."""
        algo = job.spec.algorithm
        if algo.replay is None:
            return None
        buffer = ReplayBuffer(job=job.metadata.name, group_size=algo.group_size,
                              capacity_per_prompt=algo.replay.capacity_per_prompt, capacity=algo.replay.capacity,
                              reward_priority=algo.replay.reward_priority)
        return cls(buffer, seed=job.spec.seed, batch_size=algo.batch_size, on_policy_prob=algo.replay.on_policy_prob)

    def _rng(self, step: int, stream: int) -> np.random.Generator:
        """Stream 0 draws the slots, 1 the groups."""
        return np.random.default_rng((self.seed, step, stream))

    def slots(self, step: int) -> int:
        """Of the batchSize group slots of the step after `step`, how many the buffer fills: each with
        probability 1 - onPolicyProb (TBA), none while it is empty, and at least one slot left for a
        fresh group."""
        if not self.buffer.prompts:
            return 0
        b = self.batch_size
        return min(int(self._rng(step, 0).binomial(b, 1.0 - self.on_policy_prob)), b - 1)

    def draw(self, step: int) -> list[ReplayedGroup]:
        """The groups that fill `slots(step)`: the same draw (the buffer is unchanged in between)."""
        slots = self.slots(step)
        return self.buffer.sample_groups(slots, self._rng(step, 1), now=time.time()) if slots else []

    def keep(self, groups: Sequence[TrajectoryGroup], ref_sums: Sequence[float], *, replayed: int) -> ReplayReport:
        """After a step: keep its fresh `groups` (`ref_sums`: their samples' log pi_ref, in order), count
        the `replayed` groups it trained, and say what the buffer holds."""
        starts = itertools.accumulate((len(g.samples) for g in groups), initial=0)
        for g, start in zip(groups, starts):
            self.buffer.add(g, ref_sums[start:start + len(g.samples)])
        self.replayed_total += replayed
        held = self.buffer.stats()
        return ReplayReport(trajectories=held.trajectories, prompts=held.prompts, bytes=held.bytes,
                            capacity=held.capacity, replayed_groups=self.replayed_total)
