"""Operator settings: built once by `asyncrl operator` from its flags and handed to kopf as the memo.

Handlers read them as `memo.config` (asyncrl.operator.handlers.OperatorMemo); nothing is passed
through the environment or re-read at import. The defaults live here because they are the
operator's: the images a job gets when its spec names none, and how to reach a trainer's /status.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from asyncrl import __version__
from asyncrl.api.spec.base import check_image

DEFAULT_TRAINER_IMAGE = f"ghcr.io/asyncrl/trainer:{__version__}"
DEFAULT_ROLLOUT_IMAGE = f"ghcr.io/asyncrl/rollout:{__version__}"
DEFAULT_STATUS_URL_TEMPLATE = "http://{service}.{namespace}.svc:{port}"
DEFAULT_OPERATOR_NAMESPACE = "asyncrl-system"
"""Where the README installs the chart; `asyncrl render`'s default for the operator's namespace."""
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def own_namespace() -> str:
    """The namespace this operator runs in: POD_NAMESPACE (downward API, set by the chart), the
    service account's namespace (in any pod), or "default" (outside a cluster)."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def image_arg(value: str) -> str:
    """argparse type of the default-image flags: a bad reference (or digest) stops the operator at start,
    not each job's pods at ErrImagePull; a digest is kept exactly as given."""
    try:
        return check_image(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True)
class OperatorConfig:
    """What one operator process was told on its command line (not per job: jobs say that in their spec)."""

    interval: float = 10.0
    """Seconds between status passes (children readiness, trainer /status mirror, deadlines, TTL)."""
    trainer_image: str = DEFAULT_TRAINER_IMAGE
    """Trainer image of jobs whose spec.trainer.image is unset."""
    rollout_image: str = DEFAULT_ROLLOUT_IMAGE
    """Rollout worker image of jobs whose spec.rollout.workerImage is unset."""
    status_url_template: str = DEFAULT_STATUS_URL_TEMPLATE
    """How to reach a job's status endpoint: {name}, {namespace}, {service}, {port}."""
    status_timeout: float = 3.0
    """Seconds to wait for a trainer's GET /status."""
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE
    """The namespace the operator runs in: the jobs' NetworkPolicies admit the operator's pod from
    there only (asyncrl.operator.builders.BuildContext)."""
