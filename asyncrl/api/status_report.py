"""The trainer's `GET /status` document: one model shared by the trainer (writer), the status
endpoint (server), the operator's status mirror and `asyncrl run`'s progress line (readers)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.api.figures import counter, figures, gauge, is_number, not_exported, per_key

TrainerPhase = Literal["Starting", "Waiting", "Training", "Publishing", "Evaluating", "Succeeded", "Failed",
                      "Stopped"]


class _Report(BaseModel):
    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)


class StalenessReport(_Report):
    """The version bound and what it dropped (the last step's lags are in `StepMetrics`)."""

    limit: Annotated[int, gauge("staleness_limit")] = 0
    """The version bound: groups older than this are dropped (eta, or ceil(alpha) for per-sample)."""
    policy: str = "global-budget"
    """spec.staleness.policy: global-budget (eta) or per-sample (ROLL's asyncRatio alpha)."""
    async_ratio: Annotated[float | None, gauge("staleness_async_ratio")] = None
    """alpha under the per-sample policy, else None (NaN in Prometheus)."""
    dropped: Annotated[int, counter("stale_groups_dropped")] = 0
    """Groups dropped as too stale since the job started (by either policy's bound; their admission
    capacity is given back)."""
    histogram: dict[str, int] = Field(default_factory=dict)
    """Version lag (as a string key) -> tokens trained at that lag, cumulative (the Prometheus
    histogram `asyncrl_trainer_token_staleness`)."""


class EngineReport(_Report):
    url: str
    weight_version: int | None = None
    ready: bool = False
    fenced: str = ""
    """Why the trainer fenced this engine after a failed weight update ("" = not fenced)."""


class OutageReport(_Report):
    """One dependency the trainer cannot reach right now (asyncrl.infra.health.Outage)."""

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
    served report only while an outage lasts (trainer/report/status_api.py fills it in from the process's
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


class StallReport(_Report):
    """Training stands still and the pipeline says why: no group was accepted for training for
    `spec.trainer.stallAfterSeconds` while groups were being dropped, or while no rollout worker
    generated any (trainer/report/stall.py decides). Set on the report only while the stall lasts;
    the operator turns it into the job's `Degraded` condition and its reason."""

    reason: str = ""
    """The dominant cause, CamelCase: RewardFailures, EpisodeFailures, GenerationFailures,
    EngineUnreachable, TooStale, or NoGroupsProduced (nothing generated, nothing dropped). A plain
    string, not a Literal: an operator older than the trainer must still read a new cause."""
    message: str = ""
    """The cause in words, with its count, the last error and the other causes seen (how long it
    has lasted is `seconds`)."""
    count: int = 0
    """Groups the dominant cause dropped (or interrupted) since the last accepted group."""
    last_error: str = ""
    """The newest error text of the dominant cause (a verifier's exception, an engine's answer)."""
    since: float = 0.0
    """Unix time of the last accepted group or step (or of the first rollout engine's registration)."""
    seconds: Annotated[float, gauge("stalled_seconds", "How long no group has been accepted for training while "
                                    "groups were dropped or none generated (0: not stalled).")] = 0.0
    """How long no group has been accepted, when the report was made."""
    dropped: dict[str, int] = Field(default_factory=dict)
    """Every cause seen since `since` (its counter's name, as in `recovery`) -> groups."""


class ReplayReport(_Report):
    """TBA's replay buffer (algorithm.replay): what it holds and what it has given."""

    trajectories: Annotated[int, gauge("replay_trajectories")] = 0
    """Trajectories in the buffer (0 without one)."""
    prompts: Annotated[int, gauge("replay_prompts")] = 0
    """Prompts whose trajectories the buffer holds."""
    bytes: Annotated[int, gauge("replay_bytes")] = 0
    """Host memory of the kept token ids, log-probs and versions."""
    capacity: Annotated[int, gauge("replay_capacity")] = 0
    """The most trajectories it keeps (algorithm.replay.capacity)."""
    replayed_groups: Annotated[int, gauge("replayed_groups")] = 0
    """Groups trained from the buffer in this trainer's life (the buffer starts empty after a restart)."""


class StepRecord(_Report):
    """One point of the dashboard's charts: the head of a step's record (`StepMetrics`)."""

    step: Annotated[int, not_exported("the x axis: the report's `step` is the gauge")]
    """The step's number (1 for the first)."""
    policy_version: Annotated[int, not_exported("the report's `policy_version` is the gauge")]
    """The version the step's update published (trained from the one before it)."""
    reward_mean: float
    """Mean reward of the step's trained batch (NaN in Prometheus before the first step)."""
    staleness_mean: float
    """Mean version lag of the tokens trained in the step."""
    staleness_max: int
    """Largest version lag trained in the step."""
    loss: float = 0.0
    """The step's loss: the sum of its micro-batch losses, averaged over its optimizer updates."""
    clip_fraction: float = 0.0
    """Fraction of the step's tokens whose ratio was clipped."""
    tokens: int = 0
    """Response tokens trained (of the fresh groups; context inside a response, such as a tool's
    output, is not: see `masked_tokens`)."""
    step_seconds: float = 0.0
    """Wall time since the previous step ended."""
    proximal_seconds: float = 0.0
    """Time spent on the proximal policy's log-probs (recompute's forward, or the log-linear blend)."""
    weight_sync_seconds: float = 0.0
    """Time the step's own publish took (it comes before the step is recorded): writing the weights
    and updating the engines."""
    time: Annotated[float, gauge("last_step_timestamp_seconds")] = 0.0
    """Unix time the step finished."""
    zero_signal_groups: Annotated[int, not_exported("the report's `zero_signal_groups` is the counter")] = 0
    """Groups skipped while drawing this step's batch because their rewards were all equal
    (spec.algorithm.dynamicSampling)."""
    reward_by_source: Annotated[dict[str, float], per_key(
        "reward_mean_by_source", "source", "Mean reward of the last step's groups from each mixture source.")] = \
        Field(default_factory=dict)
    """Mixture source (spec.datasets) -> mean reward of the step's groups drawn from it (sources
    the step had no group of are left out); empty for a job with one dataset."""


class StepMetrics(StepRecord):
    """Every figure of one step: a line of metrics.jsonl, `last_step` of /status and of the job's
    status, the trainer's Prometheus gauges, the trackers' and the dashboard's "last step" card.
    A figure added here reaches all of them (trainer/step/stats.py computes them)."""

    model_config = ConfigDict(extra="forbid")
    EXPORT_EVERY_NUMBER: ClassVar[bool] = True

    tokens_per_second: float = 0.0
    """Trained tokens per second of wall time over the step."""
    reward_mean_drawn: float = 0.0
    """Mean reward of every sample drawn for the step, skipped groups too (with dynamicSampling the
    trained batch's `reward_mean` is not the policy's)."""
    response_length: float = 0.0
    """Mean answer length in tokens."""
    masked_tokens: int = 0
    """Tokens of the step's responses fed to the model as context but outside the loss (a tool's
    output inside a multi-turn response; 0 for single-turn answers)."""
    turns_mean: float = 0.0
    """Mean model turns per episode of the step (spec.rollout.episode; 0 for single-turn answers)."""
    tool_calls: int = 0
    """Tool calls made in the step's episodes."""
    tool_errors: int = 0
    """Of `tool_calls`: those answered with an error (malformed, unknown tool, raised, timed out)."""
    tool_seconds: float = 0.0
    """Mean time one episode of the step spent in tool calls."""
    generate_seconds: float = 0.0
    """Mean time one episode of the step spent generating (its turns' requests, beside `tool_seconds`)."""
    episodes_failed: int = 0
    """Groups dropped so far because an episode function failed past its retries (the job's total,
    `recovery.episode_failures`, as of this step)."""
    clip_fraction_low: Annotated[float, gauge("clip_fraction_by_side", "Fraction of tokens clipped in the last "
                                               "step at the lower (A < 0) or upper (A > 0) ratio bound.",
                                               side="low")] = 0.0
    """Fraction of tokens clipped at the lower bound (negative advantage, ratio below 1 - eps)."""
    clip_fraction_high: Annotated[float, gauge("clip_fraction_by_side", side="high")] = 0.0
    """Fraction of tokens clipped at the upper bound (positive advantage, ratio above 1 + eps)."""
    dual_clip_fraction: float = 0.0
    """Fraction of tokens where the dual clip (algorithm.dualClip) bound the loss."""
    behav_filtered_fraction: float = 0.0
    """Fraction of tokens masked out by the behaviour-weight cap's filter mode."""
    importance_weight_mean: Annotated[float, gauge("importance_weight", "Trust-region ratio u = pi/pi_prox of "
                                                   "the last step.", stat="mean")] = 1.0
    """u = pi / pi_prox, the trust-region ratio PPO clips (AReaL's "importance weight"): mean."""
    importance_weight_max: Annotated[float, gauge("importance_weight", stat="max")] = 1.0
    """u: largest over the step's tokens."""
    importance_weight_min: Annotated[float, gauge("importance_weight", stat="min")] = 1.0
    """u: smallest over the step's tokens."""
    full_ratio_mean: Annotated[float, gauge("full_ratio", "Stale ratio pi/pi_behav of the last step.",
                                            stat="mean")] = 1.0
    """pi / pi_behav, the whole stale ratio (what M2PO measures): mean."""
    full_ratio_max: Annotated[float, gauge("full_ratio", stat="max")] = 1.0
    """pi / pi_behav: largest over the step's tokens."""
    full_ratio_min: Annotated[float, gauge("full_ratio", stat="min")] = 1.0
    """pi / pi_behav: smallest over the step's tokens."""
    behav_weight_mean: Annotated[float, gauge("behaviour_weight", "Behaviour weight w = pi_prox/pi_behav of "
                                              "the last step.", stat="mean")] = 1.0
    """w = pi_prox / pi_behav after its cap, the decoupled loss's behaviour weight: mean over kept tokens."""
    behav_weight_max: Annotated[float, gauge("behaviour_weight", stat="max")] = 1.0
    """w: largest over the kept tokens."""
    behav_weight_min: Annotated[float, gauge("behaviour_weight", stat="min")] = 1.0
    """w: smallest over the kept tokens."""
    behav_ess: Annotated[float, gauge("behaviour_ess")] = 1.0
    """Effective sample size of w as a fraction, (sum w)^2 / (n sum w^2): 1 = no reweighting."""
    behav_kl: Annotated[float, gauge("behaviour_kl")] = 0.0
    """Approximate KL(pi_behav || pi), k3 estimator, mean per token."""
    m2_before: float = 0.0
    """M2PO: the second moment of the log ratio before masking (0 when off)."""
    m2_after: float = 0.0
    """M2PO: the second moment after masking."""
    m2_masked_fraction: float = 0.0
    """M2PO: fraction of tokens masked."""
    bapo_clip_low: Annotated[float, gauge("bapo_clip_bound", "BAPO's adapted ratio bound of the last step "
                                          "(algorithm.bapo; 0 when off).", side="low")] = 0.0
    """BAPO's adapted lower ratio bound (token-weighted mean over micro-batches); 0 when off."""
    bapo_clip_high: Annotated[float, gauge("bapo_clip_bound", side="high")] = 0.0
    """BAPO's adapted upper ratio bound; 0 when off."""
    vcpo_lr_scale: float = 1.0
    """VCPO's learning-rate scale (algorithm.vcpo.essScaling; the mean over the step's updates); 1 when off."""
    vcpo_baseline_shift: float | None = None
    """VCPO's baseline: mean absolute shift of the groups' baselines from their mean rewards (None when off)."""
    tb_beta: float | None = None
    """Trajectory balance's reward temperature (objective tb; None otherwise)."""
    tb_log_z_mean: float | None = None
    """Trajectory balance: mean over the step's sequences of their group's log Z."""
    tb_residual_rms: float | None = None
    """Trajectory balance: root mean square of the balance residual."""
    entropy: float = 0.0
    """Mean entropy of the policy over the trained tokens."""
    grad_norm: float = 0.0
    """Gradient norm before clipping, mean over the step's updates."""
    padding_fraction: float = 0.0
    """Of the positions fed to the model, the fraction that were padding."""
    compute_seconds: float = 0.0
    """Time of the step's forward and backward passes and optimizer updates."""
    updates: int = 0
    """Optimizer updates (minibatches) in the step."""
    skipped_updates: Annotated[int, gauge("skipped_updates_last_step")] = 0
    """Updates of the step skipped because the gradient norm was not finite."""
    skipped_updates_total: Annotated[int, not_exported("the report's `skipped_updates` is the counter")] = 0
    """Updates skipped since the job started."""
    dropped_step: Annotated[int, gauge("stale_groups_dropped_last_step")] = 0
    """Groups dropped as too stale while the step's batch was read."""
    dropped: Annotated[int, not_exported("the report's `staleness.dropped` is the counter")] = 0
    """Groups dropped as too stale since the job started."""
    zero_signal_groups_total: Annotated[int, not_exported("the report's `zero_signal_groups` is the counter")] = 0
    """Groups skipped for equal rewards since the job started."""
    zero_signal_fraction: float = 0.0
    """Of the groups drawn for the step, the fraction whose rewards were all equal (skipped with
    dynamicSampling, trained at advantage 0 without): what to tune the data's difficulty with."""
    dynamic_sampling_starved: int = 0
    """1 when the step drew dynamicSampling.maxDraws groups without batchSize with signal."""
    replayed_groups: Annotated[int, gauge("replayed_groups_last_step")] = 0
    """Groups of the step trained from TBA's replay buffer (algorithm.replay)."""
    replay: ReplayReport | None = None
    """What the replay buffer holds after the step (None without one)."""
    AXES: ClassVar[tuple[str, ...]] = ("step", "time")
    """Fields that place the step rather than measure it: not among `numbers()`."""

    def numbers(self) -> dict[str, float]:
        """Every number that has a value, but the axes: what the experiment trackers log and the
        operator mirrors to the job's status (the staleness histogram is a table)."""
        return {f.name: float(f.value) for f in figures(self)
                if is_number(f.field.annotation) and f.value is not None and f.name not in self.AXES}

    staleness_histogram: Annotated[dict[str, int], not_exported(
        "a table: the report's cumulative `staleness.histogram` is the Prometheus histogram")] = \
        Field(default_factory=dict)
    """Version lag (as a string key) -> tokens of the step trained at that lag."""
    groups_by_source: Annotated[dict[str, int], per_key("groups_by_source_last_step", "source")] = \
        Field(default_factory=dict)
    """Mixture source -> the step's groups drawn from it (the report's `groups_by_source` counts since the start)."""


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
    pass_at_1_by_source: dict[str, float] = Field(default_factory=dict)
    """Source of held-out prompts (spec.evaluation.datasets) -> its pass@1; empty with one dataset."""
    reward_by_source: dict[str, float] = Field(default_factory=dict)
    """Source of held-out prompts -> the mean reward of its answers; empty with one dataset."""


class AdmissionReport(_Report):
    """The job's admission state (asyncrl/transport/admission.py) as the trainer last checked it."""

    accepted: Annotated[int, gauge("admission_groups", "The job's admission state: accepted groups, running "
                                   "leases, free capacity, unrepaired drift.", figure="accepted")] = 0
    """Groups counted as produced for training (minus those dropped or dead-lettered)."""
    running: Annotated[int, gauge("admission_groups", figure="running")] = 0
    """Live leases: groups being generated now."""
    capacity: Annotated[int, gauge("admission_groups", figure="capacity")] = 0
    """Groups that may start now."""
    drift: Annotated[int, gauge("admission_groups", figure="drift")] = 0
    """The last check's drift not yet repaired (< 0: counted groups that exist nowhere)."""


class RecoveryReport(_Report):
    """What the job recovered from, in totals since it started: /status `recovery`, Prometheus
    counters, the dashboard's Recovery card, and the job's `status.recovery` (asyncrl.api.spec's
    RecoveryStatus is this model under the API's camelCase names); the operator sends an Event for
    each figure that grows."""

    dead_lettered: Annotated[int, not_exported("the report's `dead_lettered` is the counter")] = 0
    """Trajectory groups the trainer refused (`asyncrl dead-letters NAME --uid UID` lists them)."""
    drift_lost: Annotated[int, counter("admission_drift_repaired_groups", "Groups admission's reconciliation "
                                       "took out of (lost) or added to (found) 'accepted'.", direction="lost")] = 0
    """Admission slots reconciliation gave back: groups counted as produced that existed nowhere."""
    drift_found: Annotated[int, counter("admission_drift_repaired_groups", direction="found")] = 0
    """Groups reconciliation counted: published, but their release never landed."""
    leases_returned: Annotated[int, counter("admission_leases_returned")] = 0
    """Admission leases of killed rollout workers returned by their replacements."""
    reward_failures: Annotated[int, counter("reward_failed_groups")] = 0
    """Groups dropped unpublished because a reward could not be computed (spec.reward.onError drop):
    never trained with a made-up reward; `asyncrl dead-letters` lists them with the reason."""
    episode_failures: Annotated[int, counter("episode_failed_groups")] = 0
    """Groups dropped unpublished because an episode function (spec.rollout.episode) failed past
    episodeLimits.retries: never trained with a made-up reward; `asyncrl dead-letters` lists them."""
    generation_failures: Annotated[int, counter("generation_failed_groups")] = 0
    """Groups dropped unpublished because a sample kept failing on its engine (past
    spec.rollout's request retries) or the group could not be trained."""
    engine_requeues: Annotated[int, counter("engine_requeued_groups")] = 0
    """Groups interrupted because their engine went away (unreachable past the worker's outage
    window, or aborting again and again): their prompts were queued again, nothing was lost."""
    recovered_entries: Annotated[int, counter("recovered_entries")] = 0
    """Stream entries the current trainer re-read after a lost read reply."""
    reclaimed_entries: Annotated[int, counter("reclaimed_entries")] = 0
    """Stream entries the current trainer took over from a dead consumer."""
    fenced_engines: Annotated[int, gauge("fenced_engines")] = 0
    """Rollout engines the trainer fenced now (failing weight updates; retried in the background)."""
    trainer_restarts: Annotated[int, counter("restarts", "Restarts seen in the job: the trainer's own, and "
                                             "rollout engines coming back as a new incarnation.",
                                             component="trainer")] = 0
    """Times the trainer started again after a crash or a kill."""
    engine_restarts: Annotated[int, counter("restarts", component="engine")] = 0
    """Rollout engines seen coming back as a new incarnation."""
    engine_resyncs: Annotated[int, counter("engine_resyncs")] = 0
    """Engines the trainer loaded with the current weights after they joined, restarted or lagged."""
    ghost_groups_dropped: Annotated[int, counter("ghost_groups_dropped")] = 0
    """Groups generated on weights a trainer restart threw away (a dead timeline's newest versions), dropped."""


class TrainerReport(_Report):
    """What the trainer publishes about itself at `GET /status`. Its figures reach Prometheus as
    their fields' metadata says (asyncrl/api/figures.py); the last step's are in `last_step`."""

    job: str = ""
    """The job's name."""
    phase: TrainerPhase = "Starting"
    """Starting, Waiting, Training, Publishing, Evaluating, Succeeded, Failed or Stopped (the Prometheus
    enum `asyncrl_trainer_phase`)."""
    message: str = ""
    """What the trainer is doing or why it stopped, in words."""
    reason: str = ""
    """Why training ended, once phase is Succeeded or Failed (the recorded outcome's reason:
    MaxStepsReached, WeightSyncFailed, NonFiniteWeights, ModelNotFound, ...)."""
    final_weights: str | None = None
    """The final weights directory, once the outcome is recorded."""
    outcome_restored: bool = False
    """True when this process found the job's outcome already recorded at start and serves it
    without having loaded the model or trained (a restarted trainer pod)."""
    step: Annotated[int, gauge("step")] = 0
    """Optimizer steps done."""
    policy_version: Annotated[int, gauge("policy_version")] = 0
    """Version of the latest published weights."""
    timeline: Annotated[int, gauge("timeline")] = 0
    """The trainer timeline this life publishes in (0 for a job's first trainer life, one more for each
    later one): the engines' weight labels say `policy_version@timeline` after the first."""
    max_steps: Annotated[int, gauge("max_steps")] = 0
    """Steps the job will run (0: unbounded)."""
    groups_trained: Annotated[int, counter("groups_trained")] = 0
    """Trajectory groups trained."""
    tokens_trained: Annotated[int, counter("tokens_trained")] = 0
    """Response tokens trained."""
    groups_by_source: Annotated[dict[str, int], per_key(
        "groups_trained_by_source", "source", "Trajectory groups trained from each mixture source.", "counter")] = \
        Field(default_factory=dict)
    """Mixture source (spec.datasets) -> groups trained from it; empty for a job with one dataset."""
    reward_history: list[float] = Field(default_factory=list)
    """Per-step mean reward, oldest first."""
    staleness: StalenessReport = Field(default_factory=StalenessReport)
    skipped_updates: Annotated[int, counter("skipped_updates")] = 0
    """Optimizer updates skipped since the job started because the gradient norm was not finite."""
    dead_lettered: Annotated[int, counter("dead_lettered_groups")] = 0
    """Trajectory groups moved to the dead-letter stream (undecodable or untrainable) by this trainer."""
    zero_signal_groups: Annotated[int, counter("zero_signal_groups_skipped")] = 0
    """Groups skipped since the job started because their rewards were all equal (no signal;
    spec.algorithm.dynamicSampling): acknowledged untrained, their admission capacity returned."""
    dynamic_sampling_starved_steps: Annotated[int, counter("dynamic_sampling_starved_steps")] = 0
    """Steps that drew dynamicSampling.maxDraws groups without batchSize with signal and trained on fewer."""
    admission: AdmissionReport = Field(default_factory=AdmissionReport)
    recovery: RecoveryReport = Field(default_factory=RecoveryReport)
    weight_transport: Literal["disk", "collective"] = "disk"
    """How published weights reach the engines (trainer.weightTransport)."""
    weight_sync_disk_fallbacks: Annotated[int, counter("weight_sync_disk_fallbacks")] = 0
    """Collective sync: engine updates that fell back to disk (the group could not be formed, or a
    broadcast failed) in this trainer's life."""
    last_checkpoint: str | None = None
    """The newest checkpoint's directory."""
    rollout: list[EngineReport] = Field(default_factory=list)
    history: list[StepRecord] = Field(default_factory=list)
    """Recent steps (bounded), for the dashboard's charts."""
    started_at: float = 0.0
    """When this trainer process started (Unix time)."""
    updated_at: Annotated[float, gauge("report_updated_timestamp_seconds")] = 0.0
    """When the trainer last updated its report (Unix time)."""
    evaluations: list[EvalRecord] = Field(default_factory=list)
    """Held-out evaluations so far (spec.evaluation), oldest first, bounded."""
    degraded: DegradedReport | None = None
    """Set while the trainer waits out an outage of a dependency; None (absent from /status) when
    nothing is down. Typed here, not bolted onto the JSON, so the operator's mirror, which reads
    /status into this model, carries it to the job's status."""
    stalled: StallReport | None = None
    """Set while no group has been accepted for training for `spec.trainer.stallAfterSeconds` and
    the pipeline says why (groups dropped, or none generated); None (absent) otherwise."""
    last_step: StepMetrics | None = None
    """Every figure of the last step (None before the first): the newest line of metrics.jsonl.
    Last, so that a figure the report exports itself (the counters) is not exported twice."""
