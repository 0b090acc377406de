"""The spec models: defaults make a minimal job valid, rules hold, round trips keep meaning."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.api.loader import load_jobs_text
from asyncrl.api.spec import AlgorithmSpec, AsyncRLJob, AsyncRLJobSpec, parse_quantity

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
    from asyncrl.api.crd import build_crd
    from asyncrl.api.spec import EvaluationSpec

    assert EvaluationSpec.model_validate({"dataset": {"source": "builtin:arithmetic"}}).dataset.split == "test"
    assert EvaluationSpec().dataset.split == "test"
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    dataset = schema["properties"]["spec"]["properties"]["evaluation"]["properties"]["dataset"]
    assert dataset["properties"]["split"]["default"] == "test"
    training = schema["properties"]["spec"]["properties"]["dataset"]
    assert training["properties"]["split"]["default"] == "train"


def test_the_eval_prompt_format_falls_back_to_the_training_one():
    from asyncrl.api.spec import DatasetSpec, EvalDatasetSpec
    from asyncrl.rollout.evaluation.run_pass import eval_prompt_format

    train = DatasetSpec(prompt_template="Q: {prompt}", system_prompt="Be terse.")
    assert eval_prompt_format(EvalDatasetSpec(), train) == ("Q: {prompt}", "Be terse.")
    own = EvalDatasetSpec.model_validate({"promptTemplate": "Solve {prompt}"})
    assert eval_prompt_format(own, train) == ("Solve {prompt}", "Be terse.")


def test_dynamic_sampling_is_off_by_default_and_draws_four_batches():
    algo = AlgorithmSpec()
    assert algo.dynamic_sampling is None
    on = AlgorithmSpec.model_validate({"dynamicSampling": {}, "batchSize": 6})
    assert on.dynamic_sampling is not None and on.dynamic_sampling_draws == 24
    set_ = AlgorithmSpec.model_validate({"dynamicSampling": {"maxDraws": 6}, "batchSize": 6})
    assert set_.dynamic_sampling_draws == 6


def algorithm_error(algorithm: dict) -> str:
    """The validation error of a job whose spec.algorithm is `algorithm` (it must be rejected)."""
    with pytest.raises(ValidationError) as err:
        AsyncRLJobSpec(model={"path": "m"}, algorithm=algorithm)
    return str(err.value)


@pytest.mark.parametrize("algorithm, says", [
    ({"dynamicSampling": {"maxDraws": 7}, "batchSize": 8}, "dynamicSampling.maxDraws (7) must be >= batchSize (8)"),
    ({"dynamicSampling": {"maxDraws": 0}}, "maxDraws"),
    ({"dynamicSamplingMaxDraws": 64}, "algorithm.dynamicSamplingMaxDraws moved to algorithm.dynamicSampling.maxDraws"),
    ({"dynamicSampling": True}, "algorithm.dynamicSampling is now an object: use algorithm.dynamicSampling"),
    ({"dynamicSampling": {}, "advantageEstimator": "dr_grpo", "groupSize": 1},
     "dynamicSampling needs groupSize >= 2"),
])
def test_dynamic_sampling_rules_name_the_field(algorithm, says):
    assert says in algorithm_error(algorithm)


# ---- policy objectives (issue 20): combinations the chosen objective cannot honour are rejected


def test_objective_defaults_to_ppo_clip_with_verls_sapo_temperatures():
    algo = AlgorithmSpec()
    assert (algo.objective, algo.sapo.tau_pos, algo.sapo.tau_neg) == ("ppo-clip", 1.0, 1.05)
    for objective in ("gspo", "cispo", "sapo"):
        assert AlgorithmSpec.model_validate({"objective": objective}).objective == objective
    sapo = AlgorithmSpec.model_validate({"objective": "sapo", "sapo": {"tauPos": 0.5, "tauNeg": 2.0}})
    assert (sapo.sapo.tau_pos, sapo.sapo.tau_neg) == (0.5, 2.0)
    # CISPO's paper drops the lower bound (clipEps near 1) and keeps a small upper one
    cispo = AlgorithmSpec.model_validate({"objective": "cispo", "clipEps": 0.99, "clipEpsHigh": 0.28})
    assert cispo.clip_eps_high == 0.28


@pytest.mark.parametrize("algorithm, says", [
    ({"objective": "dapo"}, "'ppo-clip', 'gspo', 'cispo', 'sapo' or 'tb'"),
    ({"objective": "gspo", "m2": {"threshold": 0.04}}, "m2 requires objective 'ppo-clip', got objective 'gspo'"),
    ({"objective": "sapo", "m2": {"threshold": 0.04}}, "allowed: objective 'ppo-clip' with m2, or m2 unset"),
    ({"m2Threshold": 0.04}, "algorithm.m2Threshold moved to algorithm.m2.threshold"),
    ({"m2": {}}, "threshold"),
    ({"objective": "cispo", "dualClip": 3.0}, "dualClip requires objective 'ppo-clip', got objective 'cispo'"),
    ({"objective": "sapo", "clipEpsHigh": 0.28},
     "clipEpsHigh 0.28 has no effect with objective 'sapo'"),
    ({"objective": "sapo", "clipEps": 0.1}, "allowed: clipEps 0.2 with objective 'sapo', or objective 'ppo-clip'"),
    ({"objective": "gspo", "sapo": {"tauNeg": 2.0}},
     "sapo {'tauPos': 1.0, 'tauNeg': 2.0} only applies to objective 'sapo', got objective 'gspo'; allowed"),
    ({"sapo": {"tauPos": 0.5}}, "only applies to objective 'sapo'"),
    ({"objective": "sapo", "sapo": {"tauPos": 0.0}}, "tauPos"),
    ({"sapoTauPos": 0.5}, "algorithm.sapoTauPos moved to algorithm.sapo.tauPos"),
    ({"objective": "gspo", "clipEps": 0.3, "clipEpsHigh": 0.2}, "unless objective is 'cispo'"),
])
def test_objective_rules_name_the_field_and_the_allowed_values(algorithm, says):
    assert says in algorithm_error(algorithm)


# ---- BAPO's adaptive clip bounds: algorithm.bapo (present = on)


def test_bapo_is_off_by_default_with_the_bapo_codes_defaults():
    assert AlgorithmSpec().bapo is None
    on = AlgorithmSpec.model_validate({"bapo": {}}).bapo
    assert on is not None
    assert (on.positive_share, on.clip_low_start, on.clip_low_max, on.clip_high_start, on.clip_high_max,
            on.step) == (0.5, 0.6, 0.8, 1.2, 2.0, 0.05)
    algo = AlgorithmSpec.model_validate({"bapo": {"clipHighMax": 3.0, "clipLowMax": 0.9}, "loss": "ppo",
                                         "proximal": "recompute", "dualClip": 3.0})
    assert algo.bapo is not None and (algo.bapo.clip_high_max, algo.dual_clip) == (3.0, 3.0)


@pytest.mark.parametrize("algorithm, says", [
    ({"clipBounds": "bapo"}, "algorithm.clipBounds moved to algorithm.bapo ('bapo: {}' selects BAPO's bounds"),
    ({"bapoStep": 0.1}, "algorithm.bapoStep moved to algorithm.bapo.step"),
    ({"bapo": {}, "objective": "gspo"}, "bapo requires objective 'ppo-clip', got objective 'gspo'"),
    ({"bapo": {}, "objective": "sapo"}, "allowed: bapo with objective 'ppo-clip', or bapo unset"),
    ({"bapo": {}, "m2": {"threshold": 0.04}}, "bapo cannot be combined with m2 (threshold 0.04)"),
    ({"bapo": {}, "clipEpsHigh": 0.28}, "allowed: clipEps 0.2 and clipEpsHigh unset with bapo"),
    ({"bapo": {}, "clipEps": 0.1}, "clipEps 0.1 and clipEpsHigh None would be ignored"),
    ({"bapo": {"clipLowStart": 0.85}}, "bapo.clipLowStart (0.85) must be <= bapo.clipLowMax (0.8)"),
    ({"bapo": {"clipHighStart": 2.5}}, "bapo.clipHighStart (2.5) must be <= bapo.clipHighMax (2.0)"),
    ({"bapo": {"positiveShare": 1.0}}, "positiveShare"),
    ({"bapo": {"clipHighMax": 1.0}}, "clipHighMax"),
    ({"bapo": {"step": 0.1, "stride": 2}}, "stride"),
])
def test_bapo_rules_name_the_field_and_the_allowed_values(algorithm, says):
    assert says in algorithm_error(algorithm)


def test_staleness_policy_defaults_to_the_global_budget():
    s = AsyncRLJobSpec(model={"path": "m"})
    assert (s.staleness.policy, s.staleness.async_ratio, s.staleness.as_policy().version_bound) == (
        "global-budget", None, 4)
    per_sample = AsyncRLJobSpec.model_validate({"model": {"path": "m"}, "algorithm": {"batchSize": 32},
                                                "staleness": {"policy": "per-sample", "asyncRatio": 0.5}})
    assert (per_sample.staleness.async_ratio, per_sample.staleness.as_policy().version_bound) == (0.5, 1)
    assert per_sample.staleness.as_policy().groups_ahead(32) == 16
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


# ---- VCPO: algorithm.vcpo (essScaling and baseline)


def test_vcpo_defaults_are_the_vcpo_codes():
    vcpo = AsyncRLJobSpec(model={"path": "m"}).algorithm.vcpo
    assert (vcpo.ess_scaling, vcpo.base_ess_ratio, vcpo.scaling, vcpo.baseline) == (False, 1.0, "sqrt", False)
    on = AsyncRLJobSpec.model_validate({"model": {"path": "m"},
                                        "algorithm": {"vcpo": {"essScaling": True, "baseEssRatio": 0.5}}})
    assert on.algorithm.vcpo.ess_scaling and on.model_dump(by_alias=True)["algorithm"]["vcpo"]["baseEssRatio"] == 0.5


@pytest.mark.parametrize("algorithm, says", [
    ({"vcpo": {"essScaling": True}, "loss": "ppo", "proximal": "recompute"},
     "vcpo.essScaling requires loss 'decoupled', got loss 'ppo'"),
    ({"vcpo": {"scaling": "linear"}}, "only apply with vcpo.essScaling true; allowed: essScaling true"),
    ({"vcpo": {"essScaling": True, "baseEssRatio": 1.5}}, "baseEssRatio"),
    ({"vcpo": {"essScaling": True, "scaling": "cube"}}, "'sqrt' or 'linear'"),
    ({"vcpo": True}, "algorithm.vcpo is now an object: use algorithm.vcpo.essScaling"),
    ({"behaviourCap": 3.0}, "algorithm.behaviourCap is now an object: use algorithm.behaviourCap.limit"),
    ({"behaviourCap": None}, "algorithm.behaviourCap is now an object: use algorithm.behaviourCap.limit"),
    ({"behaviourCapMode": "clamp"}, "algorithm.behaviourCapMode moved to algorithm.behaviourCap.mode"),
    ({"vcpoBaseline": True}, "algorithm.vcpoBaseline moved to algorithm.vcpo.baseline"),
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
