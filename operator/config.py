"""Operator settings: command-line flags of `asyncrl operator`, passed to the handlers via env.

kopf evaluates decorator arguments (the timer interval) at import time, so `asyncrl operator`
exports its flags as ASYNCRL_OPERATOR_* variables before importing the handlers module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from asyncrl.operator.builders import DEFAULT_ROLLOUT_IMAGE, DEFAULT_TRAINER_IMAGE
from asyncrl.operator.mirror import DEFAULT_URL_TEMPLATE

ENV_INTERVAL = "ASYNCRL_OPERATOR_INTERVAL"
ENV_TRAINER_IMAGE = "ASYNCRL_OPERATOR_TRAINER_IMAGE"
ENV_ROLLOUT_IMAGE = "ASYNCRL_OPERATOR_ROLLOUT_IMAGE"
ENV_STATUS_URL_TEMPLATE = "ASYNCRL_OPERATOR_STATUS_URL_TEMPLATE"
ENV_STATUS_TIMEOUT = "ASYNCRL_OPERATOR_STATUS_TIMEOUT"


@dataclass(frozen=True)
class OperatorConfig:
    interval: float = 10.0
    """Seconds between status passes (children readiness, trainer /status mirror, deadlines, TTL)."""
    trainer_image: str = DEFAULT_TRAINER_IMAGE
    rollout_image: str = DEFAULT_ROLLOUT_IMAGE
    status_url_template: str = DEFAULT_URL_TEMPLATE
    """How to reach a job's status endpoint: {name}, {namespace}, {service}, {port}."""
    status_timeout: float = 3.0

    @classmethod
    def from_env(cls) -> "OperatorConfig":
        env = os.environ
        base = cls()
        return cls(
            interval=float(env.get(ENV_INTERVAL) or base.interval),
            trainer_image=env.get(ENV_TRAINER_IMAGE) or base.trainer_image,
            rollout_image=env.get(ENV_ROLLOUT_IMAGE) or base.rollout_image,
            status_url_template=env.get(ENV_STATUS_URL_TEMPLATE) or base.status_url_template,
            status_timeout=float(env.get(ENV_STATUS_TIMEOUT) or base.status_timeout),
        )

    def to_env(self) -> dict[str, str]:
        return {ENV_INTERVAL: str(self.interval), ENV_TRAINER_IMAGE: self.trainer_image,
                ENV_ROLLOUT_IMAGE: self.rollout_image, ENV_STATUS_URL_TEMPLATE: self.status_url_template,
                ENV_STATUS_TIMEOUT: str(self.status_timeout)}
