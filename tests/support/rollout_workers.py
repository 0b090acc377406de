"""Rollout workers against the fake SGLang server and a real Redis: the `env` fixture, a worker built
the way the rollout tests need it, and the worker-side engine adapter that records weight control."""

from __future__ import annotations

from asyncrl.api.staleness import StalenessPolicy
from asyncrl.rollout.data.datasets import ArithmeticSource, PromptItem
from asyncrl.rollout.data.mixture import Mixture
from asyncrl.rollout.engines import GenerateResult, SamplingParams
from asyncrl.rollout.engines.sglang import SGLangEngine
from asyncrl.rollout.generation.config import WorkerConfig
from asyncrl.rollout.rewards.functions import RewardScorer, exact_number_reward
from asyncrl.rollout.worker.worker import RolloutWorker
from asyncrl.transport.admission import Admission
from asyncrl.transport.wire import decode_group

JOB = "wtest"


def render(item: PromptItem) -> list[int]:
    return [ord(c) % 200 + 3 for c in item.question][:12]


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def make_worker(redis, fake, names, *, n=2, max_new=6, max_groups=None, batch=4, eta=1, max_concurrent=8,
                index=0, replicas=1, max_retries=2, engine_id="pod-0", engine=None, scorer=None, source=None,
                prompts=None, producer=None, decode=decode, max_response_tokens=None):
    engine = engine or SGLangEngine(fake.url)
    cfg = WorkerConfig(job=JOB, engine_id=engine_id, group_size=n, engine_url=fake.url,
                       sampling=SamplingParams(max_new_tokens=max_new), max_concurrent_requests=8,
                       max_retries=max_retries, backoff_s=0.01, heartbeat_s=0.2, log_every_s=5,
                       max_groups=max_groups, rollout_index=index, rollout_replicas=replicas,
                       max_response_tokens=max_response_tokens)
    admission = Admission(redis, names, batch_size=batch, staleness=StalenessPolicy.global_budget(eta),
                          max_concurrent=max_concurrent, lease_seconds=30)
    prompts = prompts or Mixture.single(source or ArithmeticSource(seed=0, difficulty=1), render,
                                        scorer or RewardScorer(exact_number_reward, 5.0))
    return RolloutWorker(cfg, engine=engine, redis=redis, prompts=prompts, decode=decode, admission=admission,
                         names=names, producer=producer)


async def published(redis, names):
    return [decode_group(fields[b"data"]) for _, fields in await redis.xrange(names.trajectories)]


class WorkerEngine(SGLangEngine):
    """The worker's adapter: records any weight control it issues (there must be none). With
    `labelled=False` it drops the server's label, like vLLM, so tokens must be tagged from the
    trainer's record in the registry."""

    def __init__(self, url: str, *, labelled: bool):
        super().__init__(url)
        self.reports_weight_version = labelled  # type: ignore[misc]
        self.control: list[str] = []

    async def generate(self, input_ids: list[int], params: SamplingParams) -> GenerateResult:
        result = await super().generate(input_ids, params)
        if not self.reports_weight_version:
            result.weight_version = None
        return result

    async def pause(self, mode: str = "abort") -> None:  # type: ignore[override]
        self.control.append("pause")
        await super().pause(mode)  # type: ignore[arg-type]

    async def update_weights(self, path: str, version: int) -> None:
        self.control.append("update")
        await super().update_weights(path, version)

    async def resume(self) -> None:
        self.control.append("resume")
        await super().resume()
