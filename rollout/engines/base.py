"""The one small async interface every inference engine adapter implements.

The rollout worker and the trainer's weight sync only ever see `Engine`: generate with per-token
logprobs, pause, update weights from a directory with a version label, resume, readiness and
model info. Adapters translate it to one server's HTTP surface (SGLang native, vLLM OpenAI).
Only the trainer (trainer/weights/engine_update.py) calls pause / update_weights / resume; a rollout worker
generates and reads the labels.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import httpx

from asyncrl.api.weight_labels import WeightLabel
from asyncrl.infra.errors import RolloutError
from asyncrl.rollout.engines.auth import auth_header

if TYPE_CHECKING:
    from asyncrl.rollout.engines.weight_group import TensorSpec

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "retract"]


@dataclass
class SamplingParams:
    """What to sample for one request; temperature is also the temperature of the reported logprobs.

    Per request, not the spec's algorithm section: the worker shrinks `max_new_tokens` when it
    resumes an aborted sample, and `stop_token_ids` come from the tokenizer, not the job file.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class GenerateResult:
    """One generation (or the partial output of an aborted one)."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int | None
    """The version of the server's weight label when it answered (None if it reports none)."""
    meta: dict[str, Any] = field(default_factory=dict)
    weight_timeline: int = 0
    """The trainer timeline of that label (asyncrl.api.weight_labels)."""


class EngineError(RolloutError, RuntimeError):
    """A call to an engine server failed; the message names the URL.

    `retryable` is False for errors the same request would hit again (a 400: bad request).
    """

    def __init__(self, message: str, *, url: str, status: int | None = None, retryable: bool = True):
        super().__init__(f"{message} (engine {url})")
        self.url = url
        self.status = status
        self.retryable = retryable


class Engine(abc.ABC):
    """An inference server seen from a rollout worker or a trainer."""

    url: str
    reports_weight_version: ClassVar[bool] = True
    """True when the server labels every answer with its weight version (SGLang, our hf server).
    False (vLLM): `GenerateResult.weight_version` is always None, and the version of the weights is
    what the trainer recorded for this engine in the EngineRegistry (asyncrl.transport.versions)."""

    @abc.abstractmethod
    async def generate(self, input_ids: list[int], params: SamplingParams) -> GenerateResult:
        """Sample one completion of `input_ids` with per-token logprobs at `params.temperature`."""

    @abc.abstractmethod
    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating; with "abort" running requests return their partial output."""

    @abc.abstractmethod
    async def update_weights(self, path: str, version: WeightLabel | int) -> None:
        """Load weights from a directory and label them `version` (call while paused; an int is a
        timeline-0 version)."""

    async def init_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                group_name: str, backend: str) -> None:
        """Join the trainer's weight group (answers once every member joined)."""
        raise EngineError(f"{type(self).__name__} does not speak collective weight sync (disk only)", url=self.url,
                          retryable=False)

    async def update_weights_from_group(self, specs: Sequence[TensorSpec], group_name: str,
                                        version: WeightLabel | int | None) -> None:
        """Receive and load one bucket the trainer broadcasts; `version` on the last bucket labels it."""
        raise EngineError(f"{type(self).__name__} does not speak collective weight sync (disk only)", url=self.url,
                          retryable=False)

    async def destroy_weight_group(self, group_name: str) -> None:
        """Leave the weight group."""
        raise EngineError(f"{type(self).__name__} does not speak collective weight sync (disk only)", url=self.url,
                          retryable=False)

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue generating after a pause."""

    @abc.abstractmethod
    async def ready(self) -> bool:
        """True when the server accepts requests (without generating a token)."""

    @abc.abstractmethod
    async def model_info(self) -> dict[str, Any]:
        """What the server says it serves (model path, weight version, ...)."""

    async def close(self) -> None:  # noqa: B027 - optional: most adapters have nothing to release
        """Release client resources."""


class HTTPEngine(Engine):
    """Shared plumbing for HTTP adapters: one pooled client, errors that name the URL."""

    def __init__(self, url: str, *, timeout: float = 600.0, client: httpx.AsyncClient | None = None,
                 api_key: str | None = None):
        self.url = url.rstrip("/")
        self._headers = auth_header(api_key)  # on every request: the server's --api-key (engines/auth.py)
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )
        self._owns_client = client is None

    async def _request(self, method: str, path: str, *, json: Any = None,
                       ok_404: bool = False) -> httpx.Response | None:
        try:
            resp = await self._client.request(method, self.url + path, json=json, headers=self._headers)
        except httpx.HTTPError as exc:
            raise EngineError(f"{method} {path} failed: {type(exc).__name__}: {exc}", url=self.url) from exc
        if resp.status_code == 404 and ok_404:
            return None
        if resp.status_code >= 400:
            raise EngineError(
                f"{method} {path} returned HTTP {resp.status_code}: {_error_text(resp)}",
                url=self.url,
                status=resp.status_code,
                retryable=resp.status_code >= 500 or resp.status_code in (408, 429, 503),
            )
        return resp

    async def _json(self, method: str, path: str, *, json: Any = None) -> Any:
        resp = await self._request(method, path, json=json)
        assert resp is not None
        try:
            return resp.json()
        except ValueError as exc:
            raise EngineError(f"{method} {path} answered non-JSON: {resp.text[:200]!r}", url=self.url) from exc

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def _error_text(resp: httpx.Response) -> str:
    """The server's own error message (SGLang: {"error": {"message"}}; OpenAI: {"message"})."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if key in body:
                return str(body[key])
    return str(body)[:500]

