"""A LoRA job's versions as adapters a server holds by name (SGLang, vLLM): what both adapters share.

Each version is loaded under its weight label as its name ("3", "5@1"), beside the base model, which
never changes. A request names the newest adapter the server lists on `GET /v1/models` (the cards
with a parent; both servers list them so), read at most ADAPTER_REFRESH_S ago, and again after an
aborted answer (a pause for an update) or a refused name; its answer carries that name's version: the
adapter it named produced every token, whatever else the server loads meanwhile. The server's own
weight label stays its launch label (the base model, version 0), which is what a new or restarted
server serves until the trainer's catch-up loads the current adapter.

An update loads the new adapter (unless the server holds that name: a label names one set of weights
forever) and unloads each of ours but it and the newest other one. A request naming an adapter
unloaded since it was listed is refused (the client lists them again and the request is sent again)
or, by SGLang, reloaded from its path: its tokens carry that adapter's version either way.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import math
import time
from collections.abc import Iterable
from typing import Any

from asyncrl.api.weight_labels import WeightLabel, parse_label
from asyncrl.rollout.engines.base import EngineError, GenerateResult, HTTPEngine

ADAPTER_REFRESH_S = 1.0
"""How old the list of served adapters may be when a request names the newest."""
MODELS_PATH = "/v1/models"
log = logging.getLogger("asyncrl.rollout.engines")


def newest_adapter(names: Iterable[str]) -> str | None:
    """The name of the newest weight label (a later trainer timeline first, then the higher version);
    names that are no weight label of ours are not ours to use."""
    labelled = [(label.timeline, label.version, name) for name in names
                if (label := parse_label(name)) is not None and label.version > 0]
    return max(labelled)[2] if labelled else None


class NamedAdapterEngine(HTTPEngine):
    """An HTTP engine that, with `adapters=True`, serves a LoRA job's versions as named adapters."""

    def __init__(self, url: str, *, adapters: bool = False, **kw: Any):
        super().__init__(url, **kw)
        self.adapters = adapters
        self._adapter: str | None = None
        self._adapters_read = -math.inf

    @abc.abstractmethod
    async def _load_named(self, name: str, path: str) -> None:
        """Load the adapter directory `path` under `name` (EngineError when the server refuses)."""

    @abc.abstractmethod
    async def _unload_named(self, name: str) -> None:
        """Unload adapter `name`."""

    def listed_adapters(self, body: Any) -> dict[str, str]:
        """The adapters in a GET /v1/models answer: name -> path (the cards with a parent)."""
        try:
            return {str(c["id"]): str(c.get("root")) for c in body["data"] if c.get("parent")}
        except (KeyError, TypeError) as exc:
            raise EngineError(f"GET {MODELS_PATH} answered an unexpected layout: {str(body)[:300]}",
                              url=self.url) from exc

    async def served_adapters(self) -> dict[str, str]:
        """The adapters the server holds: name -> path."""
        return self.listed_adapters(await self._json("GET", MODELS_PATH))

    def _remember(self, served: Iterable[str]) -> str | None:
        """The newest of `served`, now the adapter requests name until the list is read again."""
        self._adapter, self._adapters_read = newest_adapter(served), time.monotonic()
        return self._adapter

    async def current_adapter(self) -> str | None:
        """The adapter a request names now: the newest listed (None: none loaded, the base model)."""
        if time.monotonic() - self._adapters_read > ADAPTER_REFRESH_S:
            return self._remember(await self.served_adapters())
        return self._adapter

    def look_again(self) -> None:
        """The adapters may have changed (an abort, a refused name): list them before the next request."""
        self._adapters_read = -math.inf

    def refused(self, exc: EngineError) -> EngineError:
        """A request naming an adapter the server no longer holds: retried after listing them again."""
        self.look_again()
        exc.retryable = True
        return exc

    def answered_by(self, result: GenerateResult, adapter: str) -> GenerateResult:
        """`result` labelled with the version of the adapter its request named."""
        if result.finish_reason == "abort":  # a pause for an update: the next request looks again
            self.look_again()
        label = parse_label(adapter)
        assert label is not None  # (newest_adapter returns labels only)
        return dataclasses.replace(result, weight_version=label.version, weight_timeline=label.timeline,
                                   meta={**result.meta, "weight_label": adapter})

    async def load_version(self, path: str, version: WeightLabel | int) -> None:
        """Load the version's adapter under its label, then unload ours but it and the newest other
        one. An unload that fails is logged: the next update tries it again."""
        name = str(WeightLabel.of(version))
        served = await self.served_adapters()
        if name not in served:
            await self._load_named(name, str(path))
        others = [n for n in served if n != name]
        keep = {name, newest_adapter(others)}
        for old in others:
            if parse_label(old) is not None and old not in keep:
                try:
                    await self._unload_named(old)
                except EngineError as exc:
                    log.warning("could not unload adapter %s: %s", old, exc)
        self.look_again()

    async def with_adapter(self, info: dict[str, Any], served: dict[str, str] | None = None) -> dict[str, Any]:
        """Model info as a LoRA job reads it: the newest adapter's label is what requests are answered
        by (`base_weight_version`: the server's own label); without an adapter, the base model's.
        `served`: the adapters, when the caller already listed them."""
        adapter = self._remember(served if served is not None else await self.served_adapters())
        if adapter is None:
            return info
        return {**info, "base_weight_version": info.get("weight_version"), "weight_version": adapter}
