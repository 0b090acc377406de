"""The spec models: defaults make a minimal job valid, rules hold, round trips keep meaning."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.loader import load_jobs_text
from asyncrl.spec import AlgorithmSpec, AsyncRLJob, AsyncRLJobSpec, parse_quantity

MINIMAL = """
apiVersion: asyncrl.dev/v1alpha1
kind: AsyncRLJob
metadata: {name: tiny}
spec:
  model: {path: Qwen/Qwen2.5-0.5B-Instruct}
"""


def test_minimal_job_is_valid_with_sane_defaults():
    (job,) = load_jobs_text(MINIMAL)
    s = job.spec
    assert s.algorithm.loss == "decoupled" and s.algorithm.proximal == "loglinear"
    assert s.algorithm.loglinear_on_policy == "behave"  # the proximal at d = 0 is the behaviour policy
    assert s.staleness.max_head_offpolicyness == 4
    assert s.rollout.engine == "sglang" and s.redis.mode == "managed" and s.redis.managed.append_only
    assert s.max_concurrent_groups() == s.algorithm.batch_size * 5


def test_wire_form_round_trips_with_camel_case():
    (job,) = load_jobs_text(MINIMAL)
    wire = job.to_wire()
    assert "maxHeadOffpolicyness" in wire["spec"]["staleness"]
    assert wire["spec"]["algorithm"]["optimizer"]["gradClip"] == 1.0
    assert AsyncRLJob.model_validate(wire) == job


def test_snake_case_is_accepted_in_python():
    spec = AsyncRLJobSpec(model={"path": "m"}, staleness={"max_head_offpolicyness": 0})
    assert spec.staleness.max_head_offpolicyness == 0


def test_assignment_is_revalidated():
    spec = AsyncRLJobSpec(model={"path": "m"})
    with pytest.raises(ValidationError):
        spec.rollout.replicas = -3


@pytest.mark.parametrize("q,ok", [("500m", True), ("2", True), ("16Gi", True), ("1.5G", True),
                                  ("16GB", False), ("lots", False), ("", False)])
def test_quantities_follow_kubernetes_syntax(q, ok):
    if ok:
        assert parse_quantity(q) > 0
    else:
        with pytest.raises(ValueError):
            parse_quantity(q)


def test_eta_zero_is_synchronous_and_allowed():
    spec = AsyncRLJobSpec(model={"path": "m"}, staleness={"maxHeadOffpolicyness": 0})
    assert spec.max_concurrent_groups() == spec.algorithm.batch_size


def test_dr_grpo_allows_a_group_of_one():
    spec = AsyncRLJobSpec(model={"path": "m"}, algorithm={"advantageEstimator": "dr_grpo", "groupSize": 1})
    assert spec.algorithm.group_size == 1


def test_status_accepts_fields_from_newer_operators():
    (job,) = load_jobs_text(MINIMAL)
    data = job.to_wire() | {"status": {"phase": "Running", "futureField": 1, "statusURL": "http://x"}}
    parsed = AsyncRLJob.model_validate(data)
    assert parsed.status.phase == "Running" and parsed.status.status_url == "http://x"


def test_loglinear_current_needs_a_single_minibatch():
    # "current" puts the d = 0 proximal at the policy being trained: the policy at the start of the
    # step only until the step's first update, so it is exact with one minibatch and wrong after.
    assert AlgorithmSpec(loglinear_on_policy="current", minibatches=1).minibatches == 1
    assert AlgorithmSpec(loglinear_on_policy="behave", minibatches=4).minibatches == 4
    with pytest.raises(ValidationError) as err:
        AsyncRLJobSpec(model={"path": "m"}, algorithm={"loglinearOnPolicy": "current", "minibatches": 4})
    message = str(err.value)
    assert "loglinearOnPolicy 'current' requires minibatches 1" in message and "got minibatches 4" in message
    assert "'behave'" in message  # the allowed values


@pytest.mark.parametrize(("field", "value", "off"), [
    ("topP", 0.9, "topP 1.0"), ("topK", 50, "topK -1"), ("topK", 1, "topK -1"), ("topK", 0, "topK -1"),
])
def test_truncated_sampling_is_rejected(field, value, off):
    # the engine would sample from a truncated distribution that the trainer never scores
    with pytest.raises(ValidationError) as err:
        AsyncRLJobSpec(model={"path": "m"}, algorithm={field: value})
    message = str(err.value)
    assert f"{field} {value!r}" in message and f"training allows {off} only (off)" in message
    if value != 0:
        assert "truncates the sampling distribution" in message and "importance ratios" in message


def test_untruncated_sampling_is_accepted():
    spec = AsyncRLJobSpec(model={"path": "m"}, algorithm={"topP": 1.0, "topK": -1})
    assert (spec.algorithm.top_p, spec.algorithm.top_k) == (1.0, -1) == (AlgorithmSpec().top_p, AlgorithmSpec().top_k)


def test_an_evaluation_dataset_without_a_split_is_the_held_out_one():
    """`evaluation.dataset` written without `split` must not evaluate on training data, neither when
    pydantic fills the default nor when the API server does (the CRD's structural default)."""
    from asyncrl.crd import build_crd
    from asyncrl.spec import EvaluationSpec

    assert EvaluationSpec.model_validate({"dataset": {"source": "builtin:arithmetic"}}).dataset.split == "test"
    assert EvaluationSpec().dataset.split == "test"
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    dataset = schema["properties"]["spec"]["properties"]["evaluation"]["properties"]["dataset"]
    assert dataset["properties"]["split"]["default"] == "test"
    training = schema["properties"]["spec"]["properties"]["dataset"]
    assert training["properties"]["split"]["default"] == "train"


def test_the_eval_prompt_format_falls_back_to_the_training_one():
    from asyncrl.rollout.evaluation import eval_prompt_format
    from asyncrl.spec import DatasetSpec, EvaluationSpec

    train = DatasetSpec(prompt_template="Q: {prompt}", system_prompt="Be terse.")
    assert eval_prompt_format(EvaluationSpec(), train) == ("Q: {prompt}", "Be terse.")
    own = EvaluationSpec.model_validate({"dataset": {"promptTemplate": "Solve {prompt}"}})
    assert eval_prompt_format(own, train) == ("Solve {prompt}", "Be terse.")


def test_dynamic_sampling_is_off_by_default_and_draws_four_batches():
    algo = AlgorithmSpec()
    assert algo.dynamic_sampling is False and algo.dynamic_sampling_max_draws is None
    on = AlgorithmSpec.model_validate({"dynamicSampling": True, "batchSize": 6})
    assert on.dynamic_sampling_draws == 24
    set_ = AlgorithmSpec.model_validate({"dynamicSampling": True, "batchSize": 6, "dynamicSamplingMaxDraws": 6})
    assert set_.dynamic_sampling_draws == 6


def algorithm_error(algorithm: dict) -> str:
    """The validation error of a job whose spec.algorithm is `algorithm` (it must be rejected)."""
    with pytest.raises(ValidationError) as err:
        AsyncRLJobSpec(model={"path": "m"}, algorithm=algorithm)
    return str(err.value)


@pytest.mark.parametrize("algorithm, says", [
    ({"dynamicSampling": True, "batchSize": 8, "dynamicSamplingMaxDraws": 7},
     "dynamicSamplingMaxDraws (7) must be >= batchSize (8)"),
    ({"dynamicSampling": True, "dynamicSamplingMaxDraws": 0}, "dynamicSamplingMaxDraws"),
    ({"dynamicSamplingMaxDraws": 64}, "dynamicSamplingMaxDraws is set but dynamicSampling is false"),
    ({"dynamicSampling": True, "advantageEstimator": "dr_grpo", "groupSize": 1},
     "dynamicSampling needs groupSize >= 2"),
])
def test_dynamic_sampling_rules_name_the_field(algorithm, says):
    assert says in algorithm_error(algorithm)


# ---- policy objectives (issue 20): combinations the chosen objective cannot honour are rejected


def test_objective_defaults_to_ppo_clip_with_verls_sapo_temperatures():
    algo = AlgorithmSpec()
    assert (algo.objective, algo.sapo_tau_pos, algo.sapo_tau_neg) == ("ppo-clip", 1.0, 1.05)
    for objective in ("gspo", "cispo", "sapo"):
        assert AlgorithmSpec.model_validate({"objective": objective}).objective == objective
    sapo = AlgorithmSpec.model_validate({"objective": "sapo", "sapoTauPos": 0.5, "sapoTauNeg": 2.0})
    assert (sapo.sapo_tau_pos, sapo.sapo_tau_neg) == (0.5, 2.0)
    # CISPO's paper drops the lower bound (clipEps near 1) and keeps a small upper one
    cispo = AlgorithmSpec.model_validate({"objective": "cispo", "clipEps": 0.99, "clipEpsHigh": 0.28})
    assert cispo.clip_eps_high == 0.28


@pytest.mark.parametrize("algorithm, says", [
    ({"objective": "dapo"}, "'ppo-clip', 'gspo', 'cispo', 'sapo' or 'tb'"),
    ({"objective": "gspo", "m2Threshold": 0.04},
     "m2Threshold 0.04 requires objective 'ppo-clip', got objective 'gspo'"),
    ({"objective": "sapo", "m2Threshold": 0.04},
     "allowed: objective 'ppo-clip' with m2Threshold, or m2Threshold unset"),
    ({"objective": "cispo", "dualClip": 3.0}, "dualClip 3.0 requires objective 'ppo-clip', got objective 'cispo'"),
    ({"objective": "sapo", "clipEpsHigh": 0.28},
     "clipEpsHigh 0.28 has no effect with objective 'sapo'"),
    ({"objective": "sapo", "clipEps": 0.1}, "allowed: clipEps 0.2 with objective 'sapo', or objective 'ppo-clip'"),
    ({"objective": "gspo", "sapoTauNeg": 2.0},
     "sapoTauNeg 2.0 only applies to objective 'sapo', got objective 'gspo'; allowed: objective 'sapo'"),
    ({"sapoTauPos": 0.5}, "sapoTauPos 0.5 only applies to objective 'sapo'"),
    ({"objective": "sapo", "sapoTauPos": 0.0}, "sapoTauPos"),
    ({"objective": "gspo", "clipEps": 0.3, "clipEpsHigh": 0.2}, "unless objective is 'cispo'"),
])
def test_objective_rules_name_the_field_and_the_allowed_values(algorithm, says):
    assert says in algorithm_error(algorithm)


# ---- BAPO's adaptive clip bounds (issue 20): clipBounds bapo and its bapo* fields


def test_clip_bounds_default_fixed_with_the_bapo_codes_defaults():
    algo = AlgorithmSpec()
    assert algo.clip_bounds == "fixed"
    assert (algo.bapo_positive_share, algo.bapo_clip_low_start, algo.bapo_clip_low_max, algo.bapo_clip_high_start,
            algo.bapo_clip_high_max, algo.bapo_step) == (0.5, 0.6, 0.8, 1.2, 2.0, 0.05)
    bapo = AlgorithmSpec.model_validate({"clipBounds": "bapo", "loss": "ppo", "proximal": "recompute",
                                         "dualClip": 3.0, "bapoClipHighMax": 3.0, "bapoClipLowMax": 0.9})
    assert (bapo.clip_bounds, bapo.bapo_clip_high_max, bapo.dual_clip) == ("bapo", 3.0, 3.0)


@pytest.mark.parametrize("algorithm, says", [
    ({"clipBounds": "adaptive"}, "'fixed' or 'bapo'"),
    ({"clipBounds": "bapo", "objective": "gspo"},
     "clipBounds 'bapo' requires objective 'ppo-clip', got objective 'gspo'"),
    ({"clipBounds": "bapo", "objective": "sapo"}, "allowed: clipBounds 'bapo' with objective 'ppo-clip'"),
    ({"clipBounds": "bapo", "m2Threshold": 0.04}, "clipBounds 'bapo' cannot be combined with m2Threshold 0.04"),
    ({"clipBounds": "bapo", "clipEpsHigh": 0.28}, "allowed: clipEps 0.2 and clipEpsHigh unset with clipBounds 'bapo'"),
    ({"clipBounds": "bapo", "clipEps": 0.1}, "clipEps 0.1 and clipEpsHigh None would be ignored"),
    ({"bapoStep": 0.1}, "bapoStep 0.1 only applies to clipBounds 'bapo', got clipBounds 'fixed'; allowed"),
    ({"bapoPositiveShare": 0.6}, "bapoPositiveShare 0.6 only applies to clipBounds 'bapo'"),
    ({"clipBounds": "bapo", "bapoClipLowStart": 0.85}, "bapoClipLowStart (0.85) must be <= bapoClipLowMax (0.8)"),
    ({"clipBounds": "bapo", "bapoClipHighStart": 2.5}, "bapoClipHighStart (2.5) must be <= bapoClipHighMax (2.0)"),
    ({"clipBounds": "bapo", "bapoPositiveShare": 1.0}, "bapoPositiveShare"),
    ({"clipBounds": "bapo", "bapoClipHighMax": 1.0}, "bapoClipHighMax"),
])
def test_clip_bounds_rules_name_the_field_and_the_allowed_values(algorithm, says):
    assert says in algorithm_error(algorithm)


def test_staleness_policy_defaults_to_the_global_budget():
    s = AsyncRLJobSpec(model={"path": "m"})
    assert (s.staleness.policy, s.staleness.async_ratio, s.staleness.version_bound) == ("global-budget", None, 4)
    per_sample = AsyncRLJobSpec.model_validate({"model": {"path": "m"}, "algorithm": {"batchSize": 32},
                                                "staleness": {"policy": "per-sample", "asyncRatio": 0.5}})
    assert (per_sample.staleness.async_ratio, per_sample.staleness.version_bound) == (0.5, 1)
    assert per_sample.staleness.groups_ahead(32) == 16
    assert per_sample.max_concurrent_groups() == 32 + 16  # B + ceil(alpha B), not B (eta + 1)
    assert "asyncRatio" in per_sample.model_dump(by_alias=True)["staleness"]


@pytest.mark.parametrize("staleness, says", [
    ({"policy": "per-sample"}, "policy 'per-sample' requires asyncRatio"),
    ({"asyncRatio": 1.0}, "asyncRatio 1.0 requires policy 'per-sample', got policy 'global-budget'; allowed"),
    ({"policy": "per-sample", "asyncRatio": 1, "maxHeadOffpolicyness": 2},
     "maxHeadOffpolicyness 2 applies to policy 'global-budget' only"),
    ({"policy": "per-sample", "asyncRatio": -0.5}, "asyncRatio"),
    ({"policy": "roll"}, "'global-budget' or 'per-sample'"),
])
def test_staleness_policy_rules_name_the_field_and_the_allowed_values(staleness, says):
    with pytest.raises(ValidationError) as err:
        AsyncRLJobSpec(model={"path": "m"}, staleness=staleness)
    assert says in str(err.value)


# ---- VCPO's ESS-scaled learning rate (issue 20): vcpo and its vcpo* fields


def test_vcpo_defaults_are_the_vcpo_codes():
    algo = AsyncRLJobSpec(model={"path": "m"}).algorithm
    assert (algo.vcpo, algo.vcpo_base_ess_ratio, algo.vcpo_scaling) == (False, 1.0, "sqrt")
    on = AsyncRLJobSpec.model_validate({"model": {"path": "m"}, "algorithm": {"vcpo": True, "vcpoBaseEssRatio": 0.5}})
    assert on.algorithm.vcpo and on.model_dump(by_alias=True)["algorithm"]["vcpoBaseEssRatio"] == 0.5


@pytest.mark.parametrize("algorithm, says", [
    ({"vcpo": True, "loss": "ppo", "proximal": "recompute"},
     "vcpo requires loss 'decoupled', got loss 'ppo'"),
    ({"vcpoScaling": "linear"}, "only apply with vcpo true; allowed: vcpo true"),
    ({"vcpo": True, "vcpoBaseEssRatio": 1.5}, "vcpoBaseEssRatio"),
    ({"vcpo": True, "vcpoScaling": "cube"}, "'sqrt' or 'linear'"),
])
def test_vcpo_rules_name_the_field_and_the_allowed_values(algorithm, says):
    assert says in algorithm_error(algorithm)


# ---- collective weight sync: trainer.weightTransport


def test_weight_transport_defaults_to_disk_and_collective_works_with_sglang_and_hf():
    assert AsyncRLJobSpec(model={"path": "m"}).trainer.weight_transport == "disk"
    for engine in ("sglang", "hf"):
        spec = AsyncRLJobSpec.model_validate({"model": {"path": "m"}, "rollout": {"engine": engine},
                                              "trainer": {"weightTransport": "collective"}})
        assert spec.trainer.weight_transport == "collective"
        assert spec.model_dump(by_alias=True)["trainer"]["weightTransport"] == "collective"
    vllm_disk = AsyncRLJobSpec.model_validate({"model": {"path": "m"}, "rollout": {"engine": "vllm"},
                                               "trainer": {"weightTransport": "disk"}})
    assert vllm_disk.trainer.weight_transport == "disk"


@pytest.mark.parametrize("spec, says", [
    ({"rollout": {"engine": "vllm"}, "trainer": {"weightTransport": "collective"}},
     "trainer.weightTransport 'collective' needs rollout.engine sglang or hf, got rollout.engine 'vllm'"),
    ({"rollout": {"engine": "vllm"}, "trainer": {"weightTransport": "collective"}},
     "(vLLM 0.32's own weight transfer is another protocol, not spoken yet); allowed with vllm: disk"),
    ({"trainer": {"weightTransport": "nccl"}}, "'disk' or 'collective'"),
])
def test_weight_transport_rules_name_the_field_and_the_allowed_values(spec, says):
    with pytest.raises(ValidationError) as err:
        AsyncRLJobSpec.model_validate({"model": {"path": "m"}, **spec})
    assert says in str(err.value)
