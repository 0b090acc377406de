"""What a rollout worker is given (WorkerConfig) and what it counts (WorkerStats).

Shared by the worker's parts: the executor (rollout/worker/worker.py), the group generator
(rollout/generation/groups.py), the view of its engine's weights (rollout/generation/engine_view.py)
and the evaluator (rollout/evaluation/service.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from asyncrl.rollout.engines.base import SamplingParams
from asyncrl.transport.content import GroupLimits

DEFAULT_ENGINE_OUTAGE_S = 180.0
"""How long a request waits for an unreachable engine before its group is dropped (a restarting
SGLang server reloads its model in well under this)."""


@dataclass
class WorkerConfig:
    """What one worker process needs, resolved once by rollout/worker/process.py from the spec and the pod.

    Not the spec itself, on purpose: most fields are per-process facts the spec cannot know (the
    engine id and URL from the pod, the shard, retry and heartbeat timings), and the three that
    come from the spec are already derived (`sampling` carries the tokenizer's stop ids). Tests and
    benchmarks build a worker without a job file from this record alone.
    """

    job: str
    engine_id: str
    group_size: int
    sampling: SamplingParams
    engine_url: str = ""
    """The URL the trainer uses to reach this worker's engine (registered in EngineRegistry)."""
    max_concurrent_requests: int = 64
    max_tokens_per_request: int | None = None
    """Segment cap (spec.rollout.maxTokensPerRequest): longer answers take consecutive requests."""
    max_retries: int = 3
    """Engine errors tolerated per sample before the group is dropped (an unreachable engine is
    waited for instead, see `engine_outage_s`)."""
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    """Base and cap of the exponential backoff between retries (jittered for outages)."""
    engine_outage_s: float = DEFAULT_ENGINE_OUTAGE_S
    """How long a sample waits for an unreachable engine (engine_unreachable) before the group is
    dropped; the worker is Degraded meanwhile."""
    heartbeat_s: float = 5.0
    log_every_s: float = 10.0
    max_groups: int | None = None
    """Stop after starting this many groups (tests, benchmarks); None = run until stopped."""
    rollout_index: int = 0
    rollout_replicas: int = 1
    """Number of fixed shards; 0 = one job-wide cursor shared by any number of workers (a
    Kubernetes Deployment's pods have no stable index, and scaling must not restart them)."""
    vocab_size: int | None = None
    """The model's vocabulary, when known: token ids at or above it make a group unpublishable."""
    max_response_tokens: int | None = None
    """The longest response of a publishable group (AsyncRLJobSpec.max_response_tokens: a multi-turn
    episode's are longer than one answer); None: `sampling.max_new_tokens`."""

    def group_limits(self) -> GroupLimits:
        """What a publishable group must respect beyond the wire format (see check_group)."""
        longest = self.sampling.max_new_tokens if self.max_response_tokens is None else self.max_response_tokens
        return GroupLimits(vocab_size=self.vocab_size, group_size=self.group_size, max_response_tokens=longest)


@dataclass
class WorkerStats:
    groups_published: int = 0
    groups_dropped: int = 0
    """Groups not published: a sample failed past its retries, or the group failed check_group."""
    groups_invalid: int = 0
    """Of `groups_dropped`: generated but untrainable (e.g. a NaN logprob from the engine)."""
    groups_unscored: int = 0
    """Of `groups_dropped`: a sample's reward failed past its retries (spec.reward.onError drop)."""
    groups_failed: int = 0
    """Of `groups_dropped`: an episode function failed past its retries (rollout/episodes/runner.py)."""
    samples: int = 0
    tokens: int = 0
    requests: int = 0
    request_errors: int = 0
    interrupted: int = 0
    """Segments that ended in "abort" and were continued (partial rollouts)."""
    segments: int = 0
    """Segments that reached `max_tokens_per_request` and were continued (long answers)."""
    held: int = 0
    """Segments held back while the trainer updated an engine without weight labels."""
    discarded: int = 0
    """Segments of such an engine generated again: an update ran beside them and which weights
    produced them is unknown (rare: needs an update to begin while the segment's answer is on its way)."""
    evaluations: int = 0
    """Evaluation requests completed (results handed to the trainer)."""
    evaluations_failed: int = 0
    """Evaluation passes that failed (their request was left pending and tried again)."""
    requeued: int = 0
    """Groups interrupted by their engine going away: their prompt was queued again, not dropped."""
    weight_waits: int = 0
    """Times the worker stopped generating because its engine's weights were unknown or beyond
    the admission bound (a restarted engine), until the trainer's catch-up loaded current ones."""
    restarts_seen: int = 0
    """Engine incarnations after the first one (restarts seen, or suspected)."""
    started: float = field(default_factory=time.monotonic)

    def tokens_per_second(self) -> float:
        return self.tokens / max(time.monotonic() - self.started, 1e-9)
