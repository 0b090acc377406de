"""The trainer's `GET /status` document: one model shared by the trainer (writer), the status
endpoint (server), the operator's status mirror and `asyncrl run`'s progress line (readers)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TrainerPhase = Literal["Starting", "Waiting", "Training", "Publishing", "Evaluating", "Succeeded", "Failed",
                      "Stopped"]


class _Report(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StalenessReport(_Report):
    mean: float = 0.0
    """Mean version lag of the tokens trained in the last step."""
    max: int = 0
    """Largest version lag seen in the last step."""
    limit: int = 0
    """The version bound: groups older than this are dropped (eta, or ceil(alpha) for per-sample)."""
    policy: str = "global-budget"
    """spec.staleness.policy: global-budget (eta) or per-sample (ROLL's asyncRatio alpha)."""
    async_ratio: float | None = None
    """alpha under the per-sample policy, else None."""
    dropped: int = 0
    """Groups dropped as too stale since the job started (by either policy's bound)."""
    dropped_last_step: int = 0
    """Of `dropped`: those dropped while the last step's batch was read."""
    histogram: dict[str, int] = Field(default_factory=dict)
    """Version lag (as a string key) -> tokens trained at that lag, cumulative."""


class ImportanceWeightReport(_Report):
    """max / min / mean of one ratio over the last step's tokens."""

    max: float = 1.0
    min: float = 1.0
    mean: float = 1.0


class BehaviourReport(_Report):
    """How far the trained tokens are from the policy that sampled them (the staleness correction)."""

    full_ratio: ImportanceWeightReport = Field(default_factory=ImportanceWeightReport)
    """pi / pi_behav: the whole stale ratio (what M2PO measures)."""
    weight: ImportanceWeightReport = Field(default_factory=ImportanceWeightReport)
    """w = pi_prox / pi_behav after its cap: the decoupled loss's behaviour weight."""
    ess: float = 1.0
    """Effective sample size of w as a fraction, (sum w)^2 / (n sum w^2): 1 = no reweighting."""
    kl: float = 0.0
    """Approximate KL(pi_behav || pi), k3 estimator, mean per token."""


class EngineReport(_Report):
    url: str
    weight_version: int | None = None
    ready: bool = False
    fenced: str = ""
    """Why the trainer fenced this engine after a failed weight update ("" = not fenced)."""


class OutageReport(_Report):
    """One dependency the trainer cannot reach right now (asyncrl.health.Outage)."""

    dependency: str
    """"redis" or "engine". A plain string, not a Literal: an operator older than the trainer must
    still read the report (and see the outage) when a new kind of dependency appears."""
    target: str = ""
    """Where: host:port/db for Redis, the URL for an engine (never a password)."""
    since: float = 0.0
    """Unix time of the first failed attempt of this outage."""
    seconds: float = 0.0
    """How long it had lasted when the document was served."""
    last_error: str = ""
    failures: int = 0
    """Failed attempts so far."""
    window_s: float = 0.0
    """How long a request keeps retrying before it fails and the trainer gives up (and restarts)."""


class DegradedReport(_Report):
    """The trainer is waiting out an outage: training is paused, not failed. Set on the
    served report only while an outage lasts (trainer/status_api.py fills it in from the process's
    Health board); the operator turns it into the job's `Degraded` condition."""

    status: bool = True
    reason: str = ""
    """RedisUnavailable or EngineUnavailable (Redis wins when both are down)."""
    message: str = ""
    """Each outage: what, where, for how long, the last error, the window."""
    since: float | None = None
    """Unix time the oldest current outage began."""
    outages: list[OutageReport] = Field(default_factory=list)
    """Oldest first."""


class StepRecord(_Report):
    """One line of metrics.jsonl and one point of the dashboard's charts."""

    step: int
    policy_version: int
    reward_mean: float
    staleness_mean: float
    staleness_max: int
    loss: float = 0.0
    clip_fraction: float = 0.0
    tokens: int = 0
    step_seconds: float = 0.0
    proximal_seconds: float = 0.0
    weight_sync_seconds: float = 0.0
    time: float = 0.0
    """Unix time the step finished."""
    zero_signal_groups: int = 0
    """Groups skipped while drawing this step's batch because their rewards were all equal
    (spec.algorithm.dynamicSampling)."""


class EvalRecord(_Report):
    """One held-out evaluation of one policy version (spec.evaluation): a line of metrics.jsonl
    (with "event": "eval"), a point of the dashboard's eval chart, an entry of /status."""

    policy_version: int
    """The version the evaluation was asked for (the weights the engine served when it began)."""
    reward_mean: float
    """Mean reward over every eval answer."""
    pass_at_1: float
    """Mean over prompts of the fraction of correct answers (reward >= 1 counts as correct)."""
    pass_at_k: float | None = None
    """Fraction of prompts with at least one correct answer among k (only when k > 1)."""
    k: int = 1
    """Answers per prompt (evaluation.samplesPerPrompt)."""
    prompts: int = 0
    samples: int = 0
    on_version: float = 1.0
    """Fraction of answers generated wholly by `policy_version`: an answer cut short by a weight
    update is generated again from the start, on the newer weights."""
    response_length: float = 0.0
    """Mean answer length in tokens."""
    seconds: float = 0.0
    """Wall time of the evaluation."""
    engine_id: str = ""
    """The rollout engine that answered."""
    time: float = 0.0
    """Unix time the evaluation finished."""


class AdmissionReport(_Report):
    """The job's admission state (asyncrl/transport/admission.py) as the trainer last checked it."""

    accepted: int = 0
    """Groups counted as produced for training (minus those dropped or dead-lettered)."""
    running: int = 0
    """Live leases: groups being generated now."""
    capacity: int = 0
    """Groups that may start now."""
    drift: int = 0
    """The last check's drift not yet repaired (< 0: counted groups that exist nowhere)."""
    dead_lettered: int = 0
    """Groups dead-lettered since the job started (every trainer life; `dead_lettered` above is this one's)."""
    drift_lost: int = 0
    """Groups taken out of `accepted` by reconciliation since the job started."""
    drift_found: int = 0
    """Groups added to `accepted` by reconciliation since the job started."""
    leases_returned: int = 0
    """Leases of dead rollout workers returned by their replacements."""


class ReplayReport(_Report):
    """TBA's replay buffer (algorithm.replay): what it holds and what it has given."""

    trajectories: int = 0
    prompts: int = 0
    bytes: int = 0
    """Host memory of the kept token ids, log-probs and versions."""
    capacity: int = 0
    """The most trajectories it keeps (algorithm.replay.capacity)."""
    replayed_groups: int = 0
    """Groups trained from the buffer in this trainer's life (the buffer starts empty after a restart)."""


class TrainerReport(_Report):
    """What the trainer publishes about itself at `GET /status`."""

    job: str = ""
    phase: TrainerPhase = "Starting"
    message: str = ""
    reason: str = ""
    """Why training ended, once phase is Succeeded or Failed (the recorded outcome's reason:
    MaxStepsReached, WeightSyncFailed, NonFiniteWeights, ModelNotFound, ...)."""
    final_weights: str | None = None
    """The final weights directory, once the outcome is recorded."""
    outcome_restored: bool = False
    """True when this process found the job's outcome already recorded at start and serves it
    without having loaded the model or trained (a restarted trainer pod)."""
    step: int = 0
    policy_version: int = 0
    max_steps: int = 0
    groups_trained: int = 0
    tokens_trained: int = 0
    tokens_per_second: float = 0.0
    reward_mean: float | None = None
    """Mean reward of the last step's batch."""
    reward_history: list[float] = Field(default_factory=list)
    """Per-step mean reward, oldest first."""
    staleness: StalenessReport = Field(default_factory=StalenessReport)
    clip_fraction: float = 0.0
    clip_fraction_low: float = 0.0
    """Last step: fraction of tokens clipped at the lower bound (negative advantage, ratio below 1 - eps)."""
    clip_fraction_high: float = 0.0
    """Last step: fraction of tokens clipped at the upper bound (positive advantage, ratio above 1 + eps)."""
    bapo_clip_low: float = 0.0
    """Last step: BAPO's adapted lower ratio bound (algorithm.clipBounds 'bapo'); 0 when off."""
    bapo_clip_high: float = 0.0
    """Last step: BAPO's adapted upper ratio bound; 0 when off."""
    vcpo_lr_scale: float = 1.0
    """Last step: VCPO's learning-rate scale (algorithm.vcpo; the mean over the step's updates); 1 when off."""
    tb_beta: float | None = None
    """Last step: trajectory balance's reward temperature (objective tb); None otherwise."""
    replay: ReplayReport | None = None
    """TBA's replay buffer (algorithm.replay); None (absent) without one."""
    importance_weight: ImportanceWeightReport = Field(default_factory=ImportanceWeightReport)
    """u = pi / pi_prox, the trust-region ratio PPO clips (AReaL's "importance weight")."""
    behaviour: BehaviourReport = Field(default_factory=BehaviourReport)
    skipped_updates: int = 0
    """Optimizer updates skipped since the job started because the gradient norm was not finite."""
    dead_lettered: int = 0
    """Trajectory groups moved to the dead-letter stream (undecodable or untrainable) by this trainer."""
    zero_signal_groups: int = 0
    """Groups skipped since the job started because their rewards were all equal (no signal;
    spec.algorithm.dynamicSampling): acknowledged untrained, their admission capacity returned."""
    zero_signal_fraction: float = 0.0
    """Of the groups drawn for the last step, the fraction whose rewards were all equal (skipped with
    dynamicSampling, trained at advantage 0 without): what to tune the data's difficulty with."""
    dynamic_sampling_starved_steps: int = 0
    """Steps that drew dynamicSamplingMaxDraws groups without batchSize with signal and trained on fewer."""
    recovered_entries: int = 0
    """Stream entries this trainer re-read from its own pending list (a read reply it lost)."""
    reclaimed_entries: int = 0
    """Stream entries this trainer took over from a dead consumer's pending list."""
    admission: AdmissionReport = Field(default_factory=AdmissionReport)
    trainer_restarts: int = 0
    """Times the job's trainer started again after a crash or a kill (job total)."""
    engine_restarts: int = 0
    """Rollout engines seen coming back as a new incarnation (job total)."""
    engine_resyncs: int = 0
    """Engines the trainer's catch-up loaded with the current weights (job total)."""
    proximal_seconds: float = 0.0
    step_seconds: float = 0.0
    weight_sync_seconds: float = 0.0
    weight_transport: Literal["disk", "collective"] = "disk"
    """How published weights reach the engines (trainer.weightTransport)."""
    weight_sync_disk_fallbacks: int = 0
    """Collective sync: engine updates that fell back to disk (the group could not be formed, or a
    broadcast failed) in this trainer's life."""
    last_checkpoint: str | None = None
    rollout: list[EngineReport] = Field(default_factory=list)
    history: list[StepRecord] = Field(default_factory=list)
    """Recent steps (bounded), for the dashboard's charts."""
    started_at: float = 0.0
    updated_at: float = 0.0
    evaluations: list[EvalRecord] = Field(default_factory=list)
    """Held-out evaluations so far (spec.evaluation), oldest first, bounded."""
    degraded: DegradedReport | None = None
    """Set while the trainer waits out an outage of a dependency; None (absent from /status) when
    nothing is down. Typed here, not bolted onto the JSON, so the operator's mirror, which reads
    /status into this model, carries it to the job's status."""
