"""`spec.algorithm` (the RL algorithm: advantages, objective, loss, sampling, the optimizer and the
settings of each family) and `spec.staleness` (how far rollout may run ahead of training)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from asyncrl.api.spec.base import CelRule, SpecModel
from asyncrl.api.spec.families import (
    BapoSpec,
    BehaviourCapSpec,
    DynamicSamplingSpec,
    M2Spec,
    SapoSpec,
    TbSpec,
    VcpoSpec,
)
from asyncrl.api.staleness import StalenessPolicy

OPOB_AGGREGATIONS = ("seq-mean-token-mean", "seq-mean-token-sum-norm")
"""The aggregations VCPO's baseline composes with (per-sequence, as the authors' code asserts)."""
TB_UNUSED: tuple[tuple[str, str, Any], ...] = (
    ("loss", "loss", "decoupled"), ("proximal", "proximal", "loglinear"),
    ("loglinearOnPolicy", "loglinear_on_policy", "behave"), ("clipEps", "clip_eps", 0.2),
    ("clipEpsHigh", "clip_eps_high", None), ("dualClip", "dual_clip", None),
    ("behaviourCap", "behaviour_cap", BehaviourCapSpec()), ("m2", "m2", None),
    ("aggregation", "aggregation", "token-mean"), ("advantageEstimator", "advantage_estimator", "grpo"),
    ("batchNormalizeAdvantages", "batch_normalize_advantages", False), ("bapo", "bapo", None),
    ("vcpo", "vcpo", VcpoSpec()), ("dynamicSampling", "dynamic_sampling", None))
"""(camelCase, field, default) of the algorithm settings objective 'tb' does not use: it has no
importance ratio, clip, behaviour weight, advantage or token aggregation, and every group carries
signal (equal rewards still pull towards the reference). Set to anything else, they are errors."""
TB_ONLY: tuple[tuple[str, str, Any], ...] = (("tb", "tb", TbSpec()), ("replay", "replay", None))
"""(camelCase, field, default) of the settings only objective 'tb' uses."""
MOVED_FIELDS: dict[str, str] = {
    "behaviourCapMode": "behaviourCap.mode", "behaviourCapLevel": "behaviourCap.level",
    "m2Threshold": "m2.threshold", "m2Scope": "m2.scope",
    "sapoTauPos": "sapo.tauPos", "sapoTauNeg": "sapo.tauNeg",
    "clipBounds": "bapo ('bapo: {}' selects BAPO's bounds; unset = the fixed band)",
    "bapoPositiveShare": "bapo.positiveShare", "bapoClipLowStart": "bapo.clipLowStart",
    "bapoClipLowMax": "bapo.clipLowMax", "bapoClipHighStart": "bapo.clipHighStart",
    "bapoClipHighMax": "bapo.clipHighMax", "bapoStep": "bapo.step",
    "vcpoBaseEssRatio": "vcpo.baseEssRatio", "vcpoScaling": "vcpo.scaling", "vcpoBaseline": "vcpo.baseline",
    "tbBeta": "tb.beta", "tbBetaFinal": "tb.betaFinal", "tbBetaAnnealSteps": "tb.betaAnnealSteps",
    "dynamicSamplingMaxDraws": "dynamicSampling.maxDraws",
}
"""The algorithm's former flat fields (camelCase) and where each lives now: a job that still uses
one fails validation with a message naming the new place."""
RETYPED_FIELDS: dict[str, str] = {
    "behaviourCap": "behaviourCap.limit (a number, or null for no behaviour weight)",
    "vcpo": "vcpo.essScaling (true or false)",
    "dynamicSampling": "dynamicSampling ('dynamicSampling: {}' turns it on, dynamicSampling.maxDraws bounds it)",
}
"""Former flat fields whose name is now a family object: a value that is not an object names the new place."""
VCPO_BASELINE_OFF_CEL = "(!has(self.vcpo) || !has(self.vcpo.baseline) || !self.vcpo.baseline)"
"""CEL on `spec.algorithm`: VCPO's baseline is off."""


class OptimizerSpec(SpecModel):
    """AdamW settings."""

    lr: float = Field(default=1e-6, gt=0)
    """Learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """Decoupled weight decay."""
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.999, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    grad_clip: float = Field(default=1.0, gt=0)
    """Max global gradient norm."""


class ReplaySpec(SpecModel):
    """TBA's replay buffer (bbartoldson/TBA src/buffer_utils.py), kept by the trainer process.

    Each of a step's batchSize group slots is filled, with probability onPolicyProb, by a fresh
    group from the stream, else by a group replayed from the buffer: a prompt already trained on
    (in turn, each before any again) and groupSize of its kept trajectories, drawn by
    softmax(rewardPriority x reward). Every trained fresh trajectory is kept, the newest
    capacityPerPrompt per prompt (a response seen again replaces its older copy) and the newest
    capacity overall. The buffer lives in the trainer's memory (status: replay) and starts empty
    after a restart."""

    on_policy_prob: float = Field(default=0.95, ge=0, le=1)
    """Chance that a batch slot takes a fresh group (TBA's GSM8K on_policy_prob 0.95; TL;DR 0.5); a
    step always trains at least one fresh group."""
    capacity_per_prompt: int = Field(default=100, ge=1)
    """Trajectories kept per prompt, the newest (TBA's max_capacity_per_query)."""
    capacity: int = Field(default=16384, ge=1)
    """Trajectories kept in all, the newest: bounds the trainer's memory (TBA has no overall bound)."""
    reward_priority: float = Field(default=1.0, ge=0)
    """Inverse temperature of the softmax over rewards that picks a replayed prompt's trajectories
    (TBA's inv_temp: 1 in its buffer and TL;DR runs; 0 = uniform, as its GSM8K run)."""


def _cel_at_default(path: str, default: Any) -> str:
    """A CEL condition: field `path` of `self` is absent or equal to `default` (None: absent; a family:
    each of its fields absent or at its default)."""
    if default is None:
        return f"!has(self.{path})"
    if isinstance(default, SpecModel):
        inner = " && ".join(_cel_at_default(f"{path}.{to_camel(name)}", getattr(default, name))
                            for name in type(default).model_fields)
        return f"(!has(self.{path}) || ({inner}))"
    literal = ("true" if default else "false") if isinstance(default, bool) else (
        f"'{default}'" if isinstance(default, str) else repr(default))
    return f"(!has(self.{path}) || self.{path} == {literal})"


class AlgorithmSpec(SpecModel):
    """The RL algorithm: advantage estimator, loss and sampling settings. Settings that belong to one
    family (behaviourCap, m2, sapo, bapo, vcpo, tb, dynamicSampling) are grouped under its name."""

    advantage_estimator: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """grpo: (R-mean)/(std+eps); dr_grpo: R-mean; rloo: R - mean of the others."""
    batch_normalize_advantages: bool = False
    """Token-weighted batch-level normalisation after the group estimator."""
    loss: Literal["ppo", "decoupled"] = "decoupled"
    """ppo: coupled clip against the behaviour policy; decoupled: AReaL's decoupled objective."""
    proximal: Literal["recompute", "loglinear"] = "loglinear"
    """Proximal policy: recomputed by a forward pass, or A-3PO's log-linear interpolation."""
    loglinear_on_policy: Literal["current", "behave"] = "behave"
    """Log-linear proximal at staleness 0: behave (= the policy at the step's start) or current (minibatches 1 only)."""
    clip_eps: float = Field(default=0.2, gt=0, lt=1)
    """Lower clip epsilon (and upper when clipEpsHigh is unset)."""
    clip_eps_high: float | None = Field(default=None, gt=0)
    """Upper clip epsilon (clip-higher); unset = symmetric."""
    dual_clip: float | None = Field(default=None, gt=1)
    """Dual clip constant c > 1 for negative advantages; unset = off."""
    behaviour_cap: BehaviourCapSpec = Field(default_factory=BehaviourCapSpec)
    """The cap on the behaviour importance weight w (decoupled loss): limit, mode, level."""
    m2: M2Spec | None = None
    """M2PO masking instead of clipping (objective ppo-clip); unset = off."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses are reduced; seq-mean-token-sum-norm (Dr. GRPO): token sum / (rows x maxNewTokens)."""
    objective: Literal["ppo-clip", "gspo", "cispo", "sapo", "tb"] = "ppo-clip"
    """Objective on u: ppo-clip, gspo (sequence-level u), cispo (clipped weight), sapo (soft gate); or tb:
    TBA's trajectory balance against the frozen initial model, no ratio (docs/algorithms.md)."""
    sapo: SapoSpec = Field(default_factory=SapoSpec)
    """SAPO's gate temperatures (objective sapo only)."""
    bapo: BapoSpec | None = None
    """BAPO's adaptive ratio bounds instead of 1-clipEps .. 1+clipEpsHigh (objective ppo-clip, no m2);
    unset = the fixed band."""
    vcpo: VcpoSpec = Field(default_factory=VcpoSpec)
    """VCPO's stabilisers: the ESS-scaled learning rate and the off-policy optimal baseline."""
    tb: TbSpec = Field(default_factory=TbSpec)
    """Trajectory balance's reward temperature beta and its schedule (objective tb only)."""
    replay: ReplaySpec | None = None
    """TBA's replay buffer (objective tb only; unset = train on fresh groups only): part of each step's
    batch is drawn from the trajectories already trained on, by reward and recency (docs/algorithms.md)."""
    group_size: int = Field(default=8, ge=1)
    """Samples per prompt (n); the unit of advantage normalisation."""
    batch_size: int = Field(default=8, ge=1)
    """Prompt groups per training step (B)."""
    minibatches: int = Field(default=1, ge=1)
    """Optimizer updates per step; batchSize must be divisible by it."""
    micro_batch_tokens: int = Field(default=8192, ge=1)
    """Token budget per forward/backward micro-batch: positions fed to the model (padded: rows x
    longest sequence; packed: the sequences' tokens, plus any padding at the ends of packed rows)."""
    pack_sequences: bool = True
    """Feed each micro-batch's sequences packed (attention kept within each sequence, position ids
    restarting per sequence) instead of one padded row each, where the model's attention supports
    it (transformers' sdpa, eager, flex, flash attention); other models fall back to padding."""
    max_new_tokens: int = Field(default=256, ge=1)
    """Response length limit (and Dr. GRPO's fixed length for seq-mean-token-sum-norm)."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature; the trainer scores logprobs at the same temperature."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Must be 1.0 (off): training needs the engine's log-probs of the full distribution."""
    top_k: int = Field(default=-1, ge=-1)
    """Must be -1 (off): training needs the engine's log-probs of the full distribution."""
    dynamic_sampling: DynamicSamplingSpec | None = None
    """DAPO's dynamic sampling; unset = off, `{}` = on with its defaults."""
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)

    __cel_rules__ = (
        # _consistent
        CelRule("self.proximal != 'loglinear' || self.loss == 'decoupled'",
                "proximal 'loglinear' requires loss 'decoupled'"),
        CelRule("self.batchSize % self.minibatches == 0", "batchSize must be divisible by minibatches"),
        CelRule("self.advantageEstimator == 'dr_grpo' || self.groupSize >= 2",
                "advantageEstimator grpo and rloo need groupSize >= 2"),
        CelRule("!has(self.clipEpsHigh) || self.clipEpsHigh >= self.clipEps"
                " || (has(self.objective) && self.objective == 'cispo')",
                "clipEpsHigh must be >= clipEps (unless objective is cispo)"),
        # _objective_consistent
        CelRule("!has(self.m2) || !has(self.objective) || self.objective == 'ppo-clip'",
                "m2 requires objective 'ppo-clip'"),
        CelRule("!has(self.dualClip) || !has(self.objective) || self.objective == 'ppo-clip'",
                "dualClip requires objective 'ppo-clip'"),
        CelRule("!has(self.objective) || self.objective != 'sapo'"
                " || (!has(self.clipEpsHigh) && (!has(self.clipEps) || self.clipEps == 0.2))",
                "objective 'sapo' has no clip: leave clipEps and clipEpsHigh at their defaults"),
        CelRule("(has(self.objective) && self.objective == 'sapo') || " + _cel_at_default("sapo", SapoSpec()),
                "sapo only applies to objective 'sapo'"),
        # _bapo_consistent
        CelRule("!has(self.bapo) || ((!has(self.objective) || self.objective == 'ppo-clip') && !has(self.m2)"
                " && !has(self.clipEpsHigh) && (!has(self.clipEps) || self.clipEps == 0.2))",
                "bapo requires objective 'ppo-clip', no m2, and clipEps/clipEpsHigh at their defaults"),
        # _vcpo_consistent
        CelRule("!has(self.vcpo) || !has(self.vcpo.essScaling) || !self.vcpo.essScaling || !has(self.loss)"
                " || self.loss == 'decoupled'",
                "vcpo.essScaling requires loss 'decoupled'"),
        CelRule(VCPO_BASELINE_OFF_CEL + " || (has(self.aggregation)"
                " && self.aggregation in ['seq-mean-token-mean', 'seq-mean-token-sum-norm'])",
                "vcpo.baseline needs aggregation 'seq-mean-token-mean' or 'seq-mean-token-sum-norm'"),
        CelRule(VCPO_BASELINE_OFF_CEL + " || !has(self.advantageEstimator) || self.advantageEstimator == 'grpo'",
                "vcpo.baseline needs advantageEstimator 'grpo'"),
        CelRule(VCPO_BASELINE_OFF_CEL + " || !has(self.batchNormalizeAdvantages) || !self.batchNormalizeAdvantages",
                "vcpo.baseline needs batchNormalizeAdvantages false"),
        # _consistent
        CelRule("!has(self.loglinearOnPolicy) || self.loglinearOnPolicy != 'current' || !has(self.minibatches)"
                " || self.minibatches == 1",
                "loglinearOnPolicy 'current' requires minibatches 1 (use 'behave')"),
        # _top_p_off, _top_k_off
        CelRule("!has(self.topP) || self.topP == 1.0", "topP must be 1.0: the trainer scores the full distribution"),
        CelRule("!has(self.topK) || self.topK == -1", "topK must be -1: the trainer scores the full distribution"),
        # _tb_consistent
        CelRule("!has(self.objective) || self.objective != 'tb' || ("
                + " && ".join(_cel_at_default(camel, default) for camel, _, default in TB_UNUSED) + ")",
                "objective 'tb' has no ratio, clip, behaviour weight, advantage or aggregation: leave "
                + ", ".join(camel for camel, _, _ in TB_UNUSED) + " at their defaults"),
        CelRule("(has(self.objective) && self.objective == 'tb') || ("
                + " && ".join(_cel_at_default(camel, default) for camel, _, default in TB_ONLY) + ")",
                "tb and replay only apply to objective 'tb'"),
        CelRule("!has(self.replay) || self.batchSize >= 2",
                "replay needs batchSize >= 2 (every step keeps one slot for a fresh group)"),
        # _dynamic_sampling_consistent
        CelRule("!has(self.dynamicSampling) || self.groupSize >= 2", "dynamicSampling needs groupSize >= 2"),
        CelRule("!has(self.dynamicSampling) || !has(self.dynamicSampling.maxDraws)"
                " || self.dynamicSampling.maxDraws >= self.batchSize",
                "dynamicSampling.maxDraws must be >= batchSize"),
    )
    """The validators below as CEL, in the CRD's order (the comments name the validator)."""

    @model_validator(mode="before")
    @classmethod
    def _no_flat_names(cls, data: Any) -> Any:
        # The family settings were flat fields before they were grouped: name the new place.
        if isinstance(data, dict):
            for key, value in data.items():
                camel = to_camel(key)
                why = ""
                if camel in MOVED_FIELDS:
                    why = f"algorithm.{camel} moved to algorithm.{MOVED_FIELDS[camel]}"
                elif (camel in RETYPED_FIELDS and not isinstance(value, (dict, BaseModel, type(None)))) or (
                        camel == "behaviourCap" and value is None):
                    why = f"algorithm.{camel} is now an object: use algorithm.{RETYPED_FIELDS[camel]}"
                if why:
                    raise ValueError(f"{why} (the settings of one family are grouped under its name; "
                                     "docs/spec-reference.md)")
        return data

    @staticmethod
    def _untruncated(name: str, value: float, off: float) -> None:
        # Every engine (sglang, vllm, hf) samples from the top-p/top-k truncated distribution, and
        # the trainer scores the full softmax at the temperature: the ratios would compare the two.
        if value == off:
            return
        why = ("is not 'off' on every engine (sglang rejects it)" if name == "topK" and value == 0 else
               "truncates the sampling distribution: the engine would sample from the truncated "
               "distribution while the trainer scores the full one (softmax at the temperature), so "
               "the importance ratios would be wrong")
        raise ValueError(f"{name} {value!r} {why}; training allows {name} {off!r} only (off)")

    @field_validator("top_p")
    @classmethod
    def _top_p_off(cls, v: float) -> float:
        cls._untruncated("topP", v, 1.0)
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, v: int) -> int:
        cls._untruncated("topK", v, -1)
        return v

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmSpec:
        if self.proximal == "loglinear" and self.loss != "decoupled":
            raise ValueError("proximal 'loglinear' requires loss 'decoupled' (ppo has no proximal policy)")
        if self.batch_size % self.minibatches != 0:
            raise ValueError(
                f"batchSize ({self.batch_size}) must be divisible by minibatches ({self.minibatches})"
            )
        if self.advantage_estimator in ("grpo", "rloo") and self.group_size < 2:
            raise ValueError(f"advantageEstimator '{self.advantage_estimator}' needs groupSize >= 2")
        if self.clip_eps_high is not None and self.clip_eps_high < self.clip_eps and self.objective != "cispo":
            raise ValueError("clipEpsHigh must be >= clipEps (clip-higher widens the upper bound), unless objective "
                             "is 'cispo' (its paper drops the lower bound: clipEps near 1, a small clipEpsHigh)")
        if self.loglinear_on_policy == "current" and self.minibatches > 1:
            raise ValueError(
                f"loglinearOnPolicy 'current' requires minibatches 1, got minibatches {self.minibatches}: "
                "from the second minibatch on the current policy is no longer the proximal (the policy at "
                "the start of the step), so fresh tokens would go unclipped; allowed: loglinearOnPolicy "
                "'behave' (any minibatches) or 'current' with minibatches 1")
        return self

    @model_validator(mode="after")
    def _objective_consistent(self) -> AlgorithmSpec:
        # Settings the chosen objective would silently ignore are errors (docs/algorithms.md, objectives).
        obj = self.objective
        for name, value, why in (
                ("m2", self.m2, "M2PO's mask replaces the clip of ppo-clip; the other objectives keep their own "
                 "clip or gate, so the two trust regions would stack"),
                ("dualClip", self.dual_clip, "the dual clip bounds ppo-clip's loss for A < 0; gspo, "
                 "cispo and sapo do not have that branch")):
            if value is not None and obj != "ppo-clip":
                raise ValueError(f"{name} requires objective 'ppo-clip', got objective {obj!r}: "
                                 f"{why}; allowed: objective 'ppo-clip' with {name}, or {name} unset")
        if obj == "sapo":
            for name, value, off in (("clipEpsHigh", self.clip_eps_high, None), ("clipEps", self.clip_eps, 0.2)):
                if value != off:
                    raise ValueError(
                        f"{name} {value!r} has no effect with objective 'sapo' (its soft gate sigmoid(tau (u-1)) "
                        f"has no clip; set sapo.tauPos/sapo.tauNeg instead); allowed: {name} {off!r} with "
                        "objective 'sapo', or objective 'ppo-clip', 'gspo' or 'cispo'")
        if self.sapo != SapoSpec() and obj != "sapo":
            raise ValueError(f"sapo {self.sapo.to_wire()} only applies to objective 'sapo', got objective {obj!r}; "
                             f"allowed: objective 'sapo' with sapo, or sapo at its defaults {_shown(SapoSpec())}")
        return self

    @model_validator(mode="after")
    def _bapo_consistent(self) -> AlgorithmSpec:
        # (the same rule as __cel_rules__' bapo entry; docs/algorithms.md, BAPO)
        if self.bapo is None:
            return self
        if self.objective != "ppo-clip":
            raise ValueError(f"bapo requires objective 'ppo-clip', got objective {self.objective!r}: BAPO adapts "
                             "ppo-clip's token ratio band; allowed: bapo with objective 'ppo-clip', or bapo unset")
        if self.m2 is not None:
            raise ValueError(f"bapo cannot be combined with m2 (threshold {self.m2.threshold!r}): M2PO replaces the "
                             "clip that BAPO adapts; allowed: bapo with m2 unset, or bapo unset")
        if self.clip_eps != 0.2 or self.clip_eps_high is not None:
            raise ValueError("bapo sets the ratio bounds itself (bapo.clipLow*, bapo.clipHigh*), so "
                             f"clipEps {self.clip_eps!r} and clipEpsHigh {self.clip_eps_high!r} would be ignored; "
                             "allowed: clipEps 0.2 and clipEpsHigh unset with bapo")
        return self

    @model_validator(mode="after")
    def _vcpo_consistent(self) -> AlgorithmSpec:
        # (the same rules as __cel_rules__' vcpo entries; docs/algorithms.md, VCPO)
        if self.vcpo.ess_scaling and self.loss != "decoupled":
            raise ValueError(f"vcpo.essScaling requires loss 'decoupled', got loss {self.loss!r}: with 'ppo' the "
                             "proximal is the behaviour policy, every weight is 1 and the scale always 1; allowed: "
                             "vcpo.essScaling true with loss 'decoupled', or essScaling false")
        if self.vcpo.baseline:
            if self.aggregation not in OPOB_AGGREGATIONS:
                raise ValueError(f"vcpo.baseline needs a per-sequence aggregation, got aggregation "
                                 f"{self.aggregation!r}: the baseline weighs whole trajectories (the authors' code "
                                 "asserts the same); allowed: " + ", ".join(f"'{a}'" for a in OPOB_AGGREGATIONS))
            if self.advantage_estimator != "grpo":
                raise ValueError(f"vcpo.baseline replaces the group baseline and std of advantageEstimator 'grpo', "
                                 f"got {self.advantage_estimator!r}; allowed: advantageEstimator 'grpo'")
            if self.batch_normalize_advantages:
                raise ValueError("vcpo.baseline sets the advantages itself: batchNormalizeAdvantages must be false")
        return self

    @model_validator(mode="after")
    def _tb_consistent(self) -> AlgorithmSpec:
        # (the same rules as __cel_rules__' entries built from TB_UNUSED and TB_ONLY, and replay's)
        tb = self.objective == "tb"
        for camel, name, default in TB_UNUSED if tb else ():
            if getattr(self, name) != default:
                raise ValueError(f"{camel} {_shown(getattr(self, name))} does not apply to objective 'tb': "
                                 "trajectory balance has no importance ratio, clip, behaviour weight, advantage or "
                                 "token aggregation, and every group carries signal; allowed with objective 'tb': "
                                 f"{camel} {_shown(default)} (its default)")
        for camel, name, default in () if tb else TB_ONLY:
            if getattr(self, name) != default:
                raise ValueError(f"{camel} only applies to objective 'tb', got objective {self.objective!r}; "
                                 f"allowed: objective 'tb' with {camel}, or {camel} {_shown(default)} (its default)")
        if self.replay is not None and self.batch_size < 2:
            raise ValueError(f"replay needs batchSize >= 2, got batchSize {self.batch_size}: every step keeps one "
                             "slot for a fresh group, so with one slot nothing would ever be replayed")
        return self

    @model_validator(mode="after")
    def _dynamic_sampling_consistent(self) -> AlgorithmSpec:
        # (the same rules as __cel_rules__' dynamicSampling entries)
        if self.dynamic_sampling is None:
            return self
        if self.group_size < 2:
            raise ValueError(f"dynamicSampling needs groupSize >= 2, got groupSize {self.group_size}: a group of "
                             "one sample has equal rewards by definition, so every group would be skipped")
        draws = self.dynamic_sampling.max_draws
        if draws is not None and draws < self.batch_size:
            raise ValueError(f"dynamicSampling.maxDraws ({draws}) must be >= batchSize ({self.batch_size}): "
                             "a full batch needs batchSize draws")
        return self

    @property
    def dynamic_sampling_draws(self) -> int:
        """Groups drawn for one step with dynamicSampling before it trains on what it has.

        Default 4 x batchSize: a step then fills up as long as a quarter of the groups carry signal
        (draws needed ~ batchSize / informative fraction), and a starving step costs at most four
        batches of generation. DAPO's recipe (verl `max_num_gen_batches`) fails the run instead."""
        chosen = self.dynamic_sampling.max_draws if self.dynamic_sampling is not None else None
        return chosen or 4 * self.batch_size


def _shown(value: Any) -> str:
    """A setting as an error message shows it: a family by its wire form."""
    return repr(value.to_wire()) if isinstance(value, SpecModel) else repr(value)


# ----------------------------------------------------------------------------------- staleness


class StalenessSpec(SpecModel):
    """How far rollout may run ahead of training: one of two policies (docs/trainer.md, "Staleness
    policies"), both enforced by the same global admission and the same trainer-side drop."""

    policy: Literal["global-budget", "per-sample"] = "global-budget"
    """global-budget (AReaL): maxHeadOffpolicyness x batchSize groups may be produced ahead of the
    trainer and a group more than maxHeadOffpolicyness versions old is dropped. per-sample (ROLL
    Flash's asynchronous ratio alpha = asyncRatio): ceil(alpha x batchSize) groups ahead; a group more
    than ceil(alpha) versions old is dropped and, for a fractional alpha, a step trains at most
    floor(frac(alpha) x batchSize) groups exactly ceil(alpha) versions old (the rest are dropped).
    Dropped groups give their admission capacity back and are counted in status.staleness.dropped."""
    max_head_offpolicyness: int = Field(default=4, ge=0)
    """eta: how many versions older than the trainer a group may be; 0 = synchronous RL
    (policy global-budget only)."""
    async_ratio: float | None = Field(default=None, ge=0)
    """alpha, ROLL Flash's asynchronous ratio: batches of generation allowed ahead of the trainer,
    fractional allowed (0.5: half a batch; 0: synchronous). Required by policy per-sample, rejected
    by global-budget."""
    max_concurrent_groups: int | None = Field(default=None, ge=1)
    """Groups in flight across all rollout pods; unset = batchSize + the groups the policy admits
    ahead (batchSize x (eta + 1), or batchSize + ceil(alpha x batchSize))."""

    __cel_rules__ = (
        CelRule("!has(self.policy) || self.policy != 'per-sample' || has(self.asyncRatio)",
                "policy 'per-sample' requires asyncRatio"),
        CelRule("!has(self.asyncRatio) || (has(self.policy) && self.policy == 'per-sample')",
                "asyncRatio requires policy 'per-sample'"),
        CelRule("!has(self.policy) || self.policy != 'per-sample' || !has(self.maxHeadOffpolicyness)"
                " || self.maxHeadOffpolicyness == 4",
                "maxHeadOffpolicyness applies to policy 'global-budget' only (per-sample: asyncRatio)"),
    )

    @model_validator(mode="after")
    def _policy_consistent(self) -> StalenessSpec:
        # (the same rules as __cel_rules__)
        if self.policy == "per-sample" and self.async_ratio is None:
            raise ValueError("policy 'per-sample' requires asyncRatio (a number >= 0, fractional allowed); "
                             "allowed: policy 'per-sample' with asyncRatio, or policy 'global-budget' "
                             "with maxHeadOffpolicyness")
        if self.policy != "per-sample" and self.async_ratio is not None:
            raise ValueError(f"asyncRatio {self.async_ratio!r} requires policy 'per-sample', got policy "
                             f"{self.policy!r}; allowed: policy 'per-sample' with asyncRatio, or policy "
                             "'global-budget' without it")
        if self.policy == "per-sample" and self.max_head_offpolicyness != 4:
            raise ValueError(f"maxHeadOffpolicyness {self.max_head_offpolicyness!r} applies to policy "
                             "'global-budget' only; with policy 'per-sample' asyncRatio bounds staleness: "
                             "leave maxHeadOffpolicyness unset")
        return self

    def as_policy(self) -> StalenessPolicy:
        """The policy these settings choose: the one object admission, the trainer's inbox, the
        engines' view and the operator read the bound and the groups ahead from."""
        if self.policy == "per-sample":
            assert self.async_ratio is not None  # (_policy_consistent)
            return StalenessPolicy.per_sample(self.async_ratio)
        return StalenessPolicy.global_budget(self.max_head_offpolicyness)
