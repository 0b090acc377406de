"""The scorer a job's reward settings ask for: in-process (RewardScorer), a reward service or a judge model."""

from __future__ import annotations

from asyncrl.api.spec import RewardSpec
from asyncrl.rollout.rewards.client import HttpRewardScorer
from asyncrl.rollout.rewards.functions import OnError, RewardError, RewardScorer, Scorer
from asyncrl.rollout.rewards.judge import JudgeScorer


def scorer_for(reward: RewardSpec, *, on_error: OnError | None = None, service_url: str | None = None) -> Scorer:
    """`on_error` overrides the spec's (held-out evaluation reports a failed reward as 0, it never
    trains on it); `service_url` is where an operator-run service answers (Runtime.reward_url).
    Raises RewardError for a function that cannot be imported or a service that cannot be reached."""
    policy = on_error or reward.on_error
    if reward.judge is not None:
        return JudgeScorer(reward.judge, retries=reward.retries, on_error=policy)
    if reward.service is not None:
        svc = reward.service
        url = svc.url or service_url
        if url is None:
            raise RewardError("reward.service.deployment is run by the operator on Kubernetes; on this machine "
                              "start `asyncrl reward-server` and set reward.service.url instead")
        return HttpRewardScorer(url, timeout_s=svc.timeout_seconds, max_concurrent=svc.max_concurrent_requests,
                                retries=reward.retries, on_error=policy)
    return RewardScorer.from_name(reward.function, reward.timeout_seconds, retries=reward.retries, on_error=policy)
