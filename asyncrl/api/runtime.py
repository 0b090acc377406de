"""Where a running component finds its peers and its storage.

The job spec says *what* to train; this says *where things are* in one deployment. The operator
sets these variables on the pods it creates and `asyncrl run` sets them on its child processes;
command-line flags override them. One definition, so every component reads the same names.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.api.stream_names import StreamNames

ENV_REDIS_URL = "ASYNCRL_REDIS_URL"
ENV_WEIGHTS_DIR = "ASYNCRL_WEIGHTS_DIR"
ENV_CHECKPOINT_DIR = "ASYNCRL_CHECKPOINT_DIR"
ENV_RUN_DIR = "ASYNCRL_RUN_DIR"
ENV_ENGINE_URL = "ASYNCRL_ENGINE_URL"
ENV_ENGINE_ADVERTISE_URL = "ASYNCRL_ENGINE_ADVERTISE_URL"
ENV_POD_NAME = "ASYNCRL_POD_NAME"
ENV_ROLLOUT_INDEX = "ASYNCRL_ROLLOUT_INDEX"
ENV_ROLLOUT_REPLICAS = "ASYNCRL_ROLLOUT_REPLICAS"
ENV_STATUS_TOKEN = "ASYNCRL_STATUS_TOKEN"
ENV_JOB_UID = "ASYNCRL_JOB_UID"
ENV_ENGINE_API_KEY = "ASYNCRL_ENGINE_API_KEY"
ENV_WEIGHT_GROUP_ADDRESS = "ASYNCRL_WEIGHT_GROUP_ADDRESS"
ENV_WEIGHT_GROUP_PORT = "ASYNCRL_WEIGHT_GROUP_PORT"
ENV_REWARD_URL = "ASYNCRL_REWARD_URL"
"""The in-cluster URL of the job's operator-run reward service (spec.reward.service.deployment)."""
ENV_REWARD_API_KEY = "ASYNCRL_REWARD_API_KEY"
"""The reward service's key, for the server (`asyncrl reward-server`) and its clients alike."""
FILE_SUFFIX = "_FILE"
"""`<VAR>_FILE` names a file holding a secret variable's value (secret_env): how the operator passes
the Redis URL, the status token and the API keys, mounted from their Secrets."""
SECRETS_DIR = "/var/run/secrets/asyncrl/job"
"""Where the operator mounts the job's Secrets in the trainer and rollout worker containers."""
DEFAULT_WEIGHT_GROUP_PORT = 29600
"""With trainer.weightTransport collective: the address engines dial to join the trainer's weight
group (the trainer rank 0 pod's stable DNS name) and the port of the group's store on it."""
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
"""Set to "false" (the rollout pods do), the pinned SGLang's GET /health answers 200 once the server is
up without generating a token, so it does not wait behind a pause: the readiness probe, and a route
the engine's --api-key leaves open. Our hf server (rollout/engines/hf_server.py) honours it too."""


def secret_env(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """A secret's value from the variable `name`, else from the file that `name`_FILE names.

    Why files: a Secret mounted as a file is in no process environment (`/proc/*/environ`, crash
    reports, a child process that dumps its env) and not in `kubectl describe` of a pod's env source.
    """
    env = os.environ if env is None else env
    if env.get(name):
        return env[name]
    path = env.get(name + FILE_SUFFIX)
    if not path:
        return None
    return read_secret_file(Path(path), f"{name}{FILE_SUFFIX}={path}") or None


def read_secret_file(path: Path, what: str) -> str:
    """A mounted Secret file's value, trimmed (a Secret made `--from-file` keeps a trailing newline);
    ValueError naming `what` when it cannot be read."""
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read the file ({exc.strerror})") from None


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


@dataclass
class Runtime:
    """Locations and identity of this process within a job deployment."""

    redis_url: str = "redis://localhost:6379/0"
    """Redis (redis:// or rediss://, may carry user:password)."""
    weights_dir: Path = Path("weights")
    """Shared volume folder where weight versions v{N} are published."""
    checkpoint_dir: Path = Path("checkpoints")
    """Trainer checkpoints."""
    run_dir: Path = Path(".")
    """Logs and metrics of this run."""
    engine_url: str = "http://127.0.0.1:30000"
    """The inference server this rollout worker drives (SGLang-native HTTP surface)."""
    engine_advertise_url: str | None = None
    """The engine URL other pods (the trainer) use, when it differs from `engine_url`."""
    pod_name: str = field(default_factory=socket.gethostname)
    """Stable identity: Redis consumer name, engine id."""
    rollout_index: int = 0
    """This rollout worker's shard index."""
    rollout_replicas: int = 0
    """Number of fixed rollout shards; 0 (default) = all workers share one job-wide cursor."""
    status_token: str | None = None
    """Optional bearer token for the status endpoint."""
    job_uid: str = ""
    """The AsyncRLJob's metadata.uid (the operator sets it; "" for local runs): in every Redis key
    and in the trainer's outcome record, so a re-created job never reads an old run."""
    weight_group_address: str = "127.0.0.1"
    """Where engines reach the trainer's rank 0 for collective weight sync (trainer.weightTransport)."""
    weight_group_port: int = DEFAULT_WEIGHT_GROUP_PORT
    """The weight group's store port on the trainer's rank 0."""
    reward_url: str | None = None
    """Where the job's operator-run reward service answers (spec.reward.service.deployment)."""
    engine_api_key: str | None = field(default=None, repr=False)
    """The engines' API key (SGLang/vLLM `--api-key`): the worker and the trainer send it as a bearer
    token on every engine request. None: the engines are open (the NetworkPolicy is the only fence)."""

    @classmethod
    def from_env(cls) -> Runtime:
        env = os.environ
        base = cls()
        return cls(
            redis_url=secret_env(ENV_REDIS_URL, env) or base.redis_url,
            weights_dir=Path(env.get(ENV_WEIGHTS_DIR, base.weights_dir)),
            checkpoint_dir=Path(env.get(ENV_CHECKPOINT_DIR, base.checkpoint_dir)),
            run_dir=Path(env.get(ENV_RUN_DIR, base.run_dir)),
            engine_url=env.get(ENV_ENGINE_URL, base.engine_url),
            engine_advertise_url=env.get(ENV_ENGINE_ADVERTISE_URL) or None,
            pod_name=env.get(ENV_POD_NAME) or base.pod_name,
            rollout_index=_env_int(ENV_ROLLOUT_INDEX, 0),
            rollout_replicas=_env_int(ENV_ROLLOUT_REPLICAS, 0),
            status_token=secret_env(ENV_STATUS_TOKEN, env),
            job_uid=env.get(ENV_JOB_UID, ""),
            engine_api_key=secret_env(ENV_ENGINE_API_KEY, env),
            reward_url=env.get(ENV_REWARD_URL) or None,
            weight_group_address=env.get(ENV_WEIGHT_GROUP_ADDRESS) or base.weight_group_address,
            weight_group_port=_env_int(ENV_WEIGHT_GROUP_PORT, DEFAULT_WEIGHT_GROUP_PORT),
        )

    def to_env(self) -> dict[str, str]:
        """The variables that reproduce this runtime in a child process or pod."""
        out = {
            ENV_REDIS_URL: self.redis_url,
            ENV_WEIGHTS_DIR: str(self.weights_dir),
            ENV_CHECKPOINT_DIR: str(self.checkpoint_dir),
            ENV_RUN_DIR: str(self.run_dir),
            ENV_ENGINE_URL: self.engine_url,
            ENV_POD_NAME: self.pod_name,
            ENV_ROLLOUT_INDEX: str(self.rollout_index),
            ENV_ROLLOUT_REPLICAS: str(self.rollout_replicas),
        }
        if self.engine_advertise_url:
            out[ENV_ENGINE_ADVERTISE_URL] = self.engine_advertise_url
        if self.status_token:
            out[ENV_STATUS_TOKEN] = self.status_token
        if self.job_uid:
            out[ENV_JOB_UID] = self.job_uid
        if self.engine_api_key:
            out[ENV_ENGINE_API_KEY] = self.engine_api_key
        if self.reward_url:
            out[ENV_REWARD_URL] = self.reward_url
        if self.weight_group_address != Runtime.weight_group_address:
            out[ENV_WEIGHT_GROUP_ADDRESS] = self.weight_group_address
        if self.weight_group_port != DEFAULT_WEIGHT_GROUP_PORT:
            out[ENV_WEIGHT_GROUP_PORT] = str(self.weight_group_port)
        return out

    def stream_names(self, job: str) -> StreamNames:
        """The Redis key names of `job` in this deployment (carrying the job uid when there is one)."""
        return StreamNames.for_job(job, self.job_uid)
