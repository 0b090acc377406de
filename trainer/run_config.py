"""What the training loop needs that the job spec does not say: paths from the deployment, the
waits of this process, and the weight-update protocol to speak to the engines."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.api.runtime import Runtime
from asyncrl.api.spec import AsyncRLJob
from asyncrl.api.spec.lora import named_adapters


@dataclass(frozen=True)
class RunConfig:
    """What the loop needs that the job spec does not say; everything about training is `job.spec`.

    Paths come from the deployment (`asyncrl.api.runtime.Runtime`), the waits are process settings,
    and `engine_kind` is the weight-update protocol to speak to the engines: in a deployment it is
    `spec.rollout.engine` as the runner or operator finally chose it (`from_runtime`).
    """

    engine_kind: str
    engine_adapters: bool = False
    """A LoRA job's versions are named adapters on the engines (asyncrl.api.spec.lora.named_adapters)."""
    weights_dir: Path = Path("weights")
    checkpoint_dir: Path = Path("checkpoints")
    metrics_path: Path | None = None
    """metrics.jsonl (rank 0 appends one line per step); None = not written."""
    weight_sync_timeout_s: float = 120.0
    read_block_ms: int = 1000
    engine_max_age_s: float = 30.0
    """Engines whose registry heartbeat is older than this are ignored."""
    engine_prune_s: float = 3600.0
    """Registry entries (and trainer records) of engines silent this long are removed (registry.prune)."""
    pending_check_s: float = 30.0
    """How often rank 0 re-reads its own pending list and reclaims idle entries (inbox.py)."""
    reclaim_idle_ms: int = 600_000
    """Another consumer's entry idle this long is taken over (far above the longest step)."""
    engine_api_key: str | None = field(default=None, repr=False)
    """Bearer token for the engines' admin calls (their `--api-key`; Runtime.engine_api_key)."""
    weight_group_address: str = "127.0.0.1"
    """With trainer.weightTransport collective: where the engines reach rank 0 (Runtime)."""
    weight_group_port: int = 29600

    @classmethod
    def from_runtime(cls, runtime: Runtime, job: AsyncRLJob) -> RunConfig:
        return cls(engine_kind=job.spec.rollout.engine,
                   engine_adapters=named_adapters(job.spec.rollout.engine, job.spec.trainer.lora),
                   weights_dir=Path(runtime.weights_dir),
                   checkpoint_dir=Path(runtime.checkpoint_dir),
                   metrics_path=Path(runtime.run_dir) / "metrics.jsonl", engine_api_key=runtime.engine_api_key,
                   weight_group_address=runtime.weight_group_address, weight_group_port=runtime.weight_group_port)
