"""The algorithm's settings that belong to one family (one paper or method), each a small model.

`spec.algorithm` nests them (`algorithm.bapo.*`, `algorithm.vcpo.*`, ...), and the loss reads the
same objects (`asyncrl.trainer.step.losses.LossConfig`), so a family's fields, defaults and bounds are
declared once. Families that are switched on by being present (`m2`, `bapo`, `dynamicSampling`)
are optional fields of the algorithm; the others always exist with their defaults.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.api.spec.base import CelRule, SpecModel

TB_BETA = 0.012
TB_BETA_ANNEAL_STEPS = 500


class BehaviourCapSpec(SpecModel):
    """The cap on the behaviour importance weight w = pi_prox / pi_behav (decoupled loss only)."""

    limit: float | None = Field(default=5.0, gt=1)
    """Cap on w; null disables the weight (w = 1)."""
    mode: Literal["mask", "clamp"] = "mask"
    """mask: drop tokens with w > limit; clamp: truncate w at the limit (TIS)."""
    level: Literal["token", "sequence"] = "token"
    """token: per-token w; sequence: the geometric mean of w over the response."""


class M2Spec(SpecModel):
    """M2PO's second-moment masking, which replaces ppo-clip's clip (present = on)."""

    threshold: float = Field(gt=0)
    """Second-moment threshold tau (the paper's 0.04)."""
    scope: Literal["all", "harmful"] = "all"
    """Tokens M2 is computed over: all (paper) or harmful ones (released code)."""


class SapoSpec(SpecModel):
    """SAPO's soft gate temperatures (objective sapo only); verl 0.9.1's defaults, tau_neg > tau_pos
    damps negative updates faster."""

    tau_pos: float = Field(default=1.0, gt=0)
    """Gate temperature for positive advantages."""
    tau_neg: float = Field(default=1.05, gt=0)
    """Gate temperature for advantages <= 0."""


class BapoSpec(SpecModel):
    """BAPO's adaptive ratio bounds instead of ppo-clip's fixed band (present = on; objective ppo-clip,
    no m2): per micro-batch, c_low and then c_high rise from their start towards their max until the
    positive-advantage tokens keep their share of the objective (WooooDyy/BAPO bapo_trainer.yaml)."""

    positive_share: float = Field(default=0.5, gt=0, lt=1)
    """Target positive share rho0 (paper and README: 0.5; the code's adv_ratio_target 1 = rho0/(1-rho0))."""
    clip_low_start: float = Field(default=0.6, gt=0, lt=1)
    """First lower ratio bound c_low tried (a-; ratio_lower_start)."""
    clip_low_max: float = Field(default=0.8, gt=0, lt=1)
    """Largest c_low the search may raise to (b-; ratio_lower_max; the README says 0.9)."""
    clip_high_start: float = Field(default=1.2, gt=1)
    """First upper ratio bound c_high tried (a+; ratio_upper_start)."""
    clip_high_max: float = Field(default=2.0, gt=1)
    """Largest c_high the search may raise to (b+; ratio_upper_max; the README says 3.0)."""
    step: float = Field(default=0.05, gt=0)
    """Step of both bounds in the search (ratio_lower_step and ratio_upper_step)."""

    __cel_rules__ = (CelRule("(has(self.clipLowStart) ? self.clipLowStart : 0.6)"
                             " <= (has(self.clipLowMax) ? self.clipLowMax : 0.8)"
                             " && (has(self.clipHighStart) ? self.clipHighStart : 1.2)"
                             " <= (has(self.clipHighMax) ? self.clipHighMax : 2.0)",
                             "each bapo.clip*Start must be <= its bapo.clip*Max"),)

    @model_validator(mode="after")
    def _ordered(self) -> BapoSpec:
        # (the same rule as __cel_rules__)
        for side, start, top in (("Low", self.clip_low_start, self.clip_low_max),
                                 ("High", self.clip_high_start, self.clip_high_max)):
            if start > top:
                raise ValueError(f"bapo.clip{side}Start ({start}) must be <= bapo.clip{side}Max ({top}): the "
                                 "search only raises a bound from its start up to its max")
        return self


class VcpoSpec(SpecModel):
    """VCPO's two stabilisers for stale data (docs/algorithms.md, VCPO), each switched on by itself."""

    ess_scaling: bool = False
    """Each update's learning rate x sqrt(min(1, ESS ratio / baseEssRatio)), the ESS of the minibatch's
    sequence weights pi_prox / pi_behav (loss 'decoupled' only)."""
    base_ess_ratio: float = Field(default=1.0, gt=0, le=1)
    """ESS ratio at and above which the learning rate is not reduced (mit-han-lab/vcpo
    ess_scaling.base_ess_ratio); essScaling only."""
    scaling: Literal["sqrt", "linear"] = "sqrt"
    """sqrt (the paper's rule for AdamW) or linear in the ESS ratio (ess_scaling.scaling_rule);
    essScaling only."""
    baseline: bool = False
    """The off-policy optimal baseline: per group, the mean of the rewards weighted by
    ||grad log pi(tau_i)||^2 w_i^2 instead of the plain mean (advantages (R_i - b) / std). Costs one
    extra backward per trajectory per update; needs aggregation seq-mean-token-mean or
    seq-mean-token-sum-norm, advantageEstimator grpo and one trainer process."""

    __cel_rules__ = (CelRule("(has(self.essScaling) && self.essScaling) || ((!has(self.baseEssRatio)"
                             " || self.baseEssRatio == 1.0) && (!has(self.scaling) || self.scaling == 'sqrt'))",
                             "vcpo.baseEssRatio and vcpo.scaling only apply with vcpo.essScaling true"),)

    @model_validator(mode="after")
    def _scaling_needs_ess(self) -> VcpoSpec:
        # (the same rule as __cel_rules__)
        if not self.ess_scaling and (self.base_ess_ratio != 1.0 or self.scaling != "sqrt"):
            raise ValueError(f"vcpo.baseEssRatio {self.base_ess_ratio!r} and vcpo.scaling {self.scaling!r} only "
                             "apply with vcpo.essScaling true; allowed: essScaling true, or baseEssRatio 1.0 and "
                             "scaling 'sqrt' (their defaults)")
        return self


class TbSpec(SpecModel):
    """Trajectory balance's reward temperature (objective tb only; bbartoldson/TBA)."""

    beta: float = Field(default=TB_BETA, gt=0)
    """beta: the policy is pulled towards pi_ref x exp(R / beta) (TBA's GSM8K kl_coef, 0.012)."""
    beta_final: float | None = Field(default=None, gt=0)
    """Anneal beta linearly from beta to this over betaAnnealSteps steps (TBA's GSM8K: 0.004 over
    500); unset = constant beta."""
    beta_anneal_steps: int = Field(default=TB_BETA_ANNEAL_STEPS, ge=1)
    """Steps over which beta goes from beta to betaFinal (TBA's kl_coef_decay_target_iter)."""


class DynamicSamplingSpec(SpecModel):
    """DAPO's dynamic sampling (present = on): a group whose rewards are all equal (advantage exactly
    0, no signal) is skipped (acknowledged, its admission capacity returned, counted) and the trainer
    draws more groups until the batch has batchSize with signal (docs/trainer.md)."""

    max_draws: int | None = Field(default=None, ge=1)
    """Groups drawn for one step before a step that is still short trains on what it has (a warning,
    counted); at least batchSize. Unset = 4 x batchSize."""
