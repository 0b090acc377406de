"""`spec.reward`: how a completion is scored: a function in the rollout worker, a reward service
over HTTP (an existing one, or one the operator runs with the job), or a judge model."""

from __future__ import annotations

import re
import string
from typing import Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.api.spec.base import CelRule, SpecModel, builtin_or_plugin
from asyncrl.api.spec.infra import Resources

REWARDS = ("gsm8k", "exact-number")
DEFAULT_JUDGE_TEMPLATE = (
    "You grade an answer to a question. Question:\n{prompt}\n\nReference answer: {answer}\n\n"
    "Answer to grade:\n{completion}\n\nScore the answer from 0 (wrong) to {max_score} (correct and "
    "complete). Reply with the score only.")
JUDGE_FIELDS = ("prompt", "completion", "answer", "max_score")
"""The placeholders a judge's promptTemplate may use."""
_SERVICE_OR_JUDGE = "a reward is scored by one of service and judge, not both"
REWARD_SERVICE_ONE_OF = CelRule("has(self.url) != has(self.deployment)",
                                "reward.service needs exactly one of url (an existing service) and deployment "
                                "(one the operator runs with the job)")
"""RewardServiceSpec._one_of as CEL. Placed by the models that hold the job's own reward (AsyncRLJobSpec,
EvaluationSpec) at their `reward.service`; a source's reward.service has its source's rule instead
(NamedSource: no deployment)."""


class RewardDeploymentSpec(SpecModel):
    """A reward service the operator runs with the job: a Deployment, its Service, and a NetworkPolicy
    that admits only the job's rollout pods; the service is given the job's engine API key
    (ASYNCRL_REWARD_API_KEY) and the workers send it. Scaled to zero when the job ends."""

    image: str | None = None
    """Container image; default: the rollout worker's image (it has `asyncrl reward-server`)."""
    command: list[str] | None = None
    """Default: `asyncrl reward-server <reward.function> --host 0.0.0.0 --port <port>`. A server of
    your own must speak the protocol of docs/rollout.md on `port` and require the key it finds in
    $ASYNCRL_REWARD_API_KEY."""
    replicas: int = Field(default=1, ge=1, le=1000)
    port: int = Field(default=8100, ge=1024, le=65535)
    gpus: int = Field(default=0, ge=0, le=64)
    """GPUs per replica (a reward model)."""
    resources: Resources = Field(default_factory=Resources)


class RewardServiceSpec(SpecModel):
    """A reward service: the rollout worker posts each group's completions to it (the JSON protocol
    of docs/rollout.md, which `asyncrl reward-server` serves for any reward function). Either an
    existing endpoint (`url`) or one the operator runs with the job (`deployment`)."""

    url: str | None = None
    """The service's base URL (`http://` or `https://`); the worker POSTs to `<url>/score`."""
    deployment: RewardDeploymentSpec | None = None
    """Run the service with the job (Kubernetes only; `asyncrl run` needs `url`)."""
    timeout_seconds: float = Field(default=60.0, gt=0)
    """One scoring request (a group's completions) as a whole."""
    max_concurrent_requests: int = Field(default=8, ge=1, le=1024)
    """Scoring requests one rollout worker has in flight at once."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", v):
            raise ValueError(f"{v!r} is not an http:// or https:// URL (e.g. http://rewards.rl.svc:8100)")
        return None if v is None else v.rstrip("/")

    @model_validator(mode="after")
    def _one_of(self) -> RewardServiceSpec:
        if (self.url is None) == (self.deployment is None):
            raise ValueError(REWARD_SERVICE_ONE_OF.message)
        return self


class JudgeSpec(SpecModel):
    """A judge model behind an OpenAI-compatible chat completions endpoint (vLLM, SGLang, a hosted
    API): each answer is sent to it with the question and the reference answer, and the score it
    replies, out of `maxScore`, is the reward scaled to 0..1."""

    url: str
    """The API's base URL, up to and including `/v1` (e.g. http://judge.rl.svc:8000/v1); the worker
    POSTs to `<url>/chat/completions` and checks `<url>/models` before it scores."""
    model: str = Field(min_length=1)
    """The model name the endpoint serves."""
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE
    """The judge's user message: a Python format string with {completion} and optionally {prompt},
    {answer} and {max_score}."""
    system_prompt: str | None = None
    max_score: int = Field(default=10, ge=1, le=1000)
    """The judge scores 0..maxScore; the reward is score / maxScore."""
    structured_output: bool = True
    """Ask for `{"score": <integer 0..maxScore>}` (response_format json_schema: vLLM, SGLang and
    OpenAI constrain the reply to it); false: the last integer of a free-text reply."""
    temperature: float = Field(default=0.0, ge=0)
    max_tokens: int = Field(default=32, ge=1, le=4096)
    """Reply length limit (a score, or a short verdict ending in one)."""
    timeout_seconds: float = Field(default=60.0, gt=0)
    """One judge request."""
    max_concurrent_requests: int = Field(default=8, ge=1, le=1024)
    """Judge requests one rollout worker has in flight at once."""
    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The environment variable holding the API key, sent as `Authorization: Bearer`; on a cluster,
    set it on the rollout pods from a Secret (rollout.podTemplate.env)."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", v):
            raise ValueError(f"{v!r} is not an http:// or https:// URL (e.g. http://judge:8000/v1)")
        return v.rstrip("/")

    @field_validator("prompt_template")
    @classmethod
    def _template(cls, v: str) -> str:
        try:
            names = {field for _, field, _, _ in string.Formatter().parse(v) if field is not None}
        except ValueError as exc:
            raise ValueError(f"not a format string: {exc}") from None
        unknown = sorted(names - set(JUDGE_FIELDS))
        if unknown or "completion" not in names:
            raise ValueError(f"needs {{completion}} and may use {', '.join('{' + f + '}' for f in JUDGE_FIELDS)}"
                             f"{'; unknown: ' + ', '.join(unknown) if unknown else ''}")
        return v


class RewardSpec(SpecModel):
    """How a completion is scored."""

    function: str = "exact-number"
    """`gsm8k`, `exact-number`, or a plug-in `package.module:function`, run inside the rollout worker
    (unused with `service`)."""
    service: RewardServiceSpec | None = None
    """Score over HTTP instead of in-process (a verifier with its own environment, a reward model)."""
    judge: JudgeSpec | None = None
    """Score with a judge model behind an OpenAI-compatible endpoint instead (not with `service`)."""
    timeout_seconds: float = Field(default=5.0, gt=0)
    """Per-sample timeout of one call of the function."""
    retries: int = Field(default=1, ge=0, le=10)
    """Tries again after a failure: a call of the function that raised, timed out or returned a
    non-finite number; with `service`, a request that failed or an item the service answered with an
    error (the rollout worker sends it again); with `judge`, a request."""
    on_error: Literal["drop", "zero"] = "drop"
    """A sample whose reward still failed after `retries`: `drop` its group (never trained: its
    admission slot goes back, it is dead-lettered with the reason and counted as `reward_failures`),
    or score it `zero` (the old behaviour: an infrastructure failure then reads as a wrong answer
    and biases its group's baseline)."""

    __cel_rules__ = (CelRule("!has(self.service) || !has(self.judge)", _SERVICE_OR_JUDGE),)

    @model_validator(mode="after")
    def _service_or_judge(self) -> RewardSpec:
        # (the same rule as __cel_rules__)
        if self.service is not None and self.judge is not None:
            raise ValueError(_SERVICE_OR_JUDGE)
        return self

    @field_validator("function")
    @classmethod
    def _function(cls, v: str) -> str:
        return builtin_or_plugin(v, REWARDS, "reward")
