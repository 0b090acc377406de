"""Training objectives as plug-ins of the step: one module per family, chosen by the job spec.

Adding an objective: a class with the `Objective` methods (base.py) in a module of its own, its
settings in `asyncrl.api.spec.AlgorithmSpec`, and one line in `build_objective`; the loop and the step
stay as they are.
"""

from __future__ import annotations

from typing import Any

from asyncrl.api.spec import AlgorithmSpec
from asyncrl.trainer.step.objectives.base import Objective, StepData
from asyncrl.trainer.step.objectives.policy_gradient import PolicyGradient
from asyncrl.trainer.step.objectives.tb import TrajectoryBalance
from asyncrl.trainer.step.objectives.vcpo_baseline import VcpoBaseline

__all__ = ["Objective", "StepData", "build_objective"]


def build_objective(algo: AlgorithmSpec, *, reference_model: Any = None) -> Objective:
    """The job's objective: trajectory balance, or the policy gradient (with VCPO's baseline)."""
    if algo.objective == "tb":
        return TrajectoryBalance(algo, reference_model)
    policy_gradient = PolicyGradient(algo)
    return VcpoBaseline(policy_gradient) if algo.vcpo.baseline else policy_gradient
