"""The fake SGLang's LoRA serving (tests/support/sglang_fake.py): adapters loaded and unloaded at run
time and named per request, as SGLang 0.5.10.post1 does it, written from reading the pin's
  - entrypoints/http_server.py: POST /load_lora_adapter, /unload_lora_adapter (LoRAUpdateOutput
    {success, error_message, loaded_adapters}, HTTP 400 when success is false), GET /v1/models (the
    base model's card, then one per adapter: id = name, root = path, parent = the served model);
  - managers/tokenizer_communicator_mixin.py: a load needs --enable-lora, registers the name only once
    the load succeeded, and remembers it (lora_ref_cache); an unload unregisters the name at once (new
    requests can no longer acquire it) and unloads only after the running requests that use it end;
  - managers/tokenizer_manager.py (_validate_and_resolve_lora, after the pause): a request naming an
    adapter without --enable-lora, or one never loaded, is refused (HTTP 400); one loaded before and
    unloaded since is loaded again from its remembered path ("Reloading evicted adapter");
  - lora/lora_manager.py (validate_new_adapter) and lora/lora_registry.py: a name already loaded is
    refused; an adapter of a higher rank than --max-lora-rank, or with modules outside
    --lora-target-modules (both normalised: q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj), is
    refused; a PEFT config whose target_modules is the string "all-linear" is taken as it is when the
    server was started with --lora-target-modules.

The fake's "model" under an adapter: the logprobs of the version in the adapter's directory name
(`.../v3` -> version 3, `fake_logprob`), so a test sees which directory produced an answer's tokens,
whatever the name it was loaded under.
"""

import asyncio
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.infra.peft_adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
_NORMALISED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
               "up_proj": "gate_up_proj"}


@dataclass(frozen=True)
class LoraLaunch:
    """The pin's launch flags: --enable-lora --max-lora-rank R --lora-target-modules M..."""

    max_lora_rank: int
    target_modules: tuple[str, ...]


@dataclass
class LoraState:
    launch: LoraLaunch | None = None
    """None: started without --enable-lora."""
    loaded: dict[str, str] = field(default_factory=dict)
    """Registered adapters, name -> path, in load order (the pin's LoRARegistry)."""
    remembered: dict[str, str] = field(default_factory=dict)
    """Every adapter ever loaded, name -> path (the pin's lora_ref_cache)."""
    users: dict[str, int] = field(default_factory=dict)
    """Running requests per adapter name."""
    calls: list[str] = field(default_factory=list)
    """"load:NAME", "unload:NAME", "reload:NAME", in order."""


def normalised(modules: list[str] | tuple[str, ...]) -> set[str]:
    return {_NORMALISED.get(m.rsplit(".", 1)[-1], m.rsplit(".", 1)[-1]) for m in modules}


def adapter_version(path: str) -> str:
    """The fake model's version for an adapter directory: N of a `vN` directory, else 0."""
    match = re.fullmatch(r"v(\d+)", Path(path).name)
    return match.group(1) if match else "0"


class LoraServing:
    """The adapter registry and checks of one fake server (its routes are added by `add_routes`)."""

    def __init__(self, state: LoraState) -> None:
        self.state = state
        self._released = asyncio.Event()

    def load(self, name: str, path: str) -> str | None:
        """Load `path` as adapter `name`; the pin's error message, or None."""
        s = self.state
        if s.launch is None:
            return NOT_ENABLED
        config_file = Path(path) / ADAPTER_CONFIG
        if not config_file.is_file() or not (Path(path) / ADAPTER_WEIGHTS).is_file():
            return f"Can't find '{ADAPTER_CONFIG}' at '{path}'"
        config = json.loads(config_file.read_text())
        if name in s.loaded:
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        targets = config.get("target_modules")
        if isinstance(targets, str):
            if targets not in ("all", "all-linear"):
                return "Only 'all' or 'all-linear' can be used as the string for target module"
        else:
            outside = normalised(list(targets or [])) - normalised(s.launch.target_modules)
            if outside:
                return (f"LoRA adapter '{name}' contains target modules {sorted(outside)} that are not included in "
                        f"the specified --lora-target-modules {sorted(normalised(s.launch.target_modules))}.")
        if int(config.get("r", 0)) > s.launch.max_lora_rank:
            return (f"LoRA adapter {name} with rank {config.get('r')} is incompatible with the current LoRA memory "
                    "pool configuration. Please ensure that the LoRA adapter's rank is within the configured "
                    "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
        s.loaded[name] = s.remembered[name] = path
        return None

    async def unload(self, name: str) -> str | None:
        s = self.state
        if s.launch is None:
            return NOT_ENABLED
        if name not in s.loaded:
            return f"LoRA with name {name} does not exist. Loaded LoRAs: {list(s.loaded)}"
        del s.loaded[name]
        while s.users.get(name):  # (the pin's wait_for_unload)
            self._released.clear()
            await self._released.wait()
        return None

    def acquire(self, name: str) -> tuple[str | None, str]:
        """(error message or None, the fake model's version) for a request naming adapter `name`."""
        s = self.state
        if s.launch is None:
            return (f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server with "
                    "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."), ""
        if name not in s.loaded:
            if name not in s.remembered:
                return (f"Got LoRA adapter that has never been loaded: {name}\n"
                        f"All loaded adapters: {list(s.remembered)}."), ""
            s.calls.append(f"reload:{name}")
            error = self.load(name, s.remembered[name])
            if error is not None:
                return f"Failed to implicitly load LoRA adapter {name}: {error}", ""
        s.users[name] = s.users.get(name, 0) + 1
        return None, adapter_version(s.loaded[name])

    def release(self, name: str) -> None:
        self.state.users[name] -= 1
        self._released.set()


def add_routes(app: Any, lora: LoraServing, served_model: Any, base_req: type) -> None:
    """POST /load_lora_adapter, /unload_lora_adapter and GET /v1/models on the fake's app;
    `served_model()`: the base model's name (the pin's served_model_name). (No `from __future__ import
    annotations` in this module: FastAPI reads the request models from the handlers' annotations.)"""
    from fastapi.responses import JSONResponse

    class LoadLoRAAdapterReqInput(base_req):  # type: ignore[misc, valid-type]
        lora_name: str
        lora_path: str
        pinned: bool = False
        lora_id: str | None = None

    class UnloadLoRAAdapterReqInput(base_req):  # type: ignore[misc, valid-type]
        lora_name: str
        lora_id: str | None = None

    def outcome(error: str | None) -> JSONResponse:
        body = {"success": error is None, "error_message": error, "loaded_adapters": dict(lora.state.loaded)}
        return JSONResponse(body, status_code=200 if error is None else 400)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(obj: LoadLoRAAdapterReqInput) -> Any:
        lora.state.calls.append(f"load:{obj.lora_name}")
        return outcome(lora.load(obj.lora_name, obj.lora_path))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(obj: UnloadLoRAAdapterReqInput) -> Any:
        lora.state.calls.append(f"unload:{obj.lora_name}")
        return outcome(await lora.unload(obj.lora_name))

    @app.get("/v1/models")
    async def show_models() -> Any:
        base = served_model()
        cards = [{"id": base, "object": "model", "owned_by": "sglang", "root": base, "parent": None}]
        cards += [{"id": name, "object": "model", "owned_by": "sglang", "root": path, "parent": base,
                   "max_model_len": None} for name, path in lora.state.loaded.items()]
        return {"object": "list", "data": cards}

    app.state.request_models.update({"/load_lora_adapter": LoadLoRAAdapterReqInput,
                                     "/unload_lora_adapter": UnloadLoRAAdapterReqInput})
