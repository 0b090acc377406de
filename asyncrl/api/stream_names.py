"""The one place that names a job's Redis keys.

Every key of a job carries the same Redis Cluster hash tag, `{<job>/<uid>}` (`{<job>}` for local
runs, which have no uid), so all of them live in one slot and a Lua script or MULTI may touch
several of them (publish + admission, ack + trained set). Components build the names with
`asyncrl.api.runtime.Runtime.stream_names(job)`, which adds the uid of the deployment.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "asyncrl"
CONSUMER_GROUP = "trainers"


@dataclass(frozen=True)
class StreamNames:
    """Key names of one job. Build with `StreamNames.for_job(job, uid)` (or `Runtime.stream_names`)."""

    job: str
    base: str
    """`asyncrl:{<job>[/<uid>]}`: the prefix, with the hash tag, of every key of the job."""
    trajectories: str
    """Stream of encoded TrajectoryGroups (field `data`, plus `gid` for inspection)."""
    consumer_group: str
    """The one consumer group of trainers on `trajectories`."""
    dead_letter: str
    """Stream of entries that failed to decode: source id, error text, raw payload."""
    versions: str
    """Stream of VersionEvents (new weights published)."""
    engines: str
    """Hash engine_id -> JSON EngineInfo (registry of inference engines, the workers' heartbeats)."""
    engine_weights: str
    """Hash engine_id -> JSON EngineWeights: the version the trainer loaded into each engine."""
    trained: str
    """Sorted set of the group ids whose training step was committed (dedupe of duplicate deliveries),
    scored by their entry's time; pruned by the ack script (streams.py). Was a plain set under the
    key `trained`: a new key, so an upgraded job never meets the old type."""
    admission: str
    """Hash with the admission state: `version`, `accepted`, `dropped`."""
    admission_leases: str
    """Sorted set lease_id -> expiry (server time, ms) of running groups."""
    admission_released: str
    """Sorted set lease_id -> release time (ms): makes a retried release a no-op."""
    outcome: str
    """String: the trainer's recorded TrainerOutcome (JSON), set once when training ends."""
    recovery: str
    """Hash of job-wide recovery counters (`trainer_starts`, `engine_restarts`, `engine_resyncs`;
    asyncrl/transport/recovery.py), written by the trainer."""
    eval_requests: str
    """Stream of held-out evaluation requests (one per policy version), read by rollout workers
    through the consumer group `evaluators`."""
    eval_results: str
    """Stream of finished evaluations (JSON EvalRecord), read by the trainer."""

    @classmethod
    def for_job(cls, job: str, uid: str = "") -> StreamNames:
        """Names for `job` (a Kubernetes-style name; braces would break the hash tag).

        `uid` (the AsyncRLJob's metadata.uid) goes into every key, so a job deleted and re-created
        with the same name never reads the old run's streams; local runs have none.
        """
        for what, value in (("job name", job), ("job uid", uid)):
            if (not value and what == "job name") or any(c in value for c in "{}/") \
                    or any(c.isspace() for c in value):
                raise ValueError(f"invalid {what} for Redis keys: {value!r}")
        base = f"{PREFIX}:{{{job}/{uid}}}" if uid else f"{PREFIX}:{{{job}}}"
        return cls(job=job, base=base, trajectories=f"{base}:trajectories", consumer_group=CONSUMER_GROUP,
                   dead_letter=f"{base}:dead-letter", versions=f"{base}:versions",
                   engines=f"{base}:engines", engine_weights=f"{base}:engines:weights",
                   trained=f"{base}:trained-ids",
                   admission=f"{base}:admission", admission_leases=f"{base}:admission-leases",
                   admission_released=f"{base}:admission-released", outcome=f"{base}:outcome",
                   recovery=f"{base}:recovery",
                   eval_requests=f"{base}:eval-requests", eval_results=f"{base}:eval-results")

    def all_keys(self) -> list[str]:
        """Every key of the job (for cleanup when the job is deleted, and for tests)."""
        return [self.trajectories, self.dead_letter, self.versions, self.engines, self.engine_weights,
                self.trained, self.admission, self.admission_leases, self.admission_released, self.outcome,
                self.recovery, self.eval_requests, self.eval_results]

    def rollout_cursor(self, shard: str) -> str:
        """The resumable prompt cursor of one rollout shard (`shared`, or `I-of-N`)."""
        return f"{self.base}:rollout-cursor:{shard}"
