"""Config: YAML + dotted overrides onto the typed schema; every error names the key."""

import pytest

from megatron_bubblespec.config import ConfigError, load_config


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  temperature: 0.7\nspec:\n  max_draft_tokens: 32\n")
    cfg = load_config(path, ["spec.enabled=false", "rollout.top_p=0.9"])
    assert (cfg.rollout.temperature, cfg.spec.max_draft_tokens) == (0.7, 32)
    assert cfg.spec.enabled is False and cfg.rollout.top_p == 0.9
    assert cfg.config_path == str(path)


def test_text_overrides_keep_their_text():
    """YAML reads off as false and 1e3 as a float; a text field takes the text as typed."""
    cfg = load_config(None, ["run.name=off", "model.path=1e3", "run.steps=3", "spec.enabled=off"])
    assert (cfg.run.name, cfg.model.path) == ("off", "1e3")
    assert cfg.run.steps == 3 and cfg.spec.enabled is False   # typed fields still parse


@pytest.mark.parametrize("overrides,fragment", [
    (["spec.enable=false"], "spec.enable"),
    (["rollout.temperature=hot"], "rollout.temperature"),
    (["rollout.engine=sglang"], "rollout.engine"),
    (["rollout.top_p=1.5"], "rollout.top_p"),
    (["rollout.samples_per_prompt=1"], "rollout.samples_per_prompt"),
    (["parallel.tensor=2"], "parallel.tensor x parallel.pipeline x parallel.context x parallel.data"),
    (["rollout.prompts_per_step=3"], "rollout.prompts_per_step"),
    (["ablation.rule=lenient"], "ablation.rule"),
    (["spec.verifier=engine", "rollout.engine=reference", "parallel.world_size=2",
      "parallel.tensor=2", "parallel.data=1"], "spec.verifier=engine with rollout.engine=reference"),
    (["spec.verifier=engine", "ablation.rule=residual"], "spec.verifier=engine on vLLM"),
    (["spec.proposal_token_cost=-0.1"], "spec.proposal_token_cost"),
    (["ablation.measure_proposal_cost=true", "rollout.engine=reference"],
     "ablation.measure_proposal_cost measures a vLLM engine"),
    (["ablation.measure_proposal_cost=true", "spec.speculative_continuation=false"],
     "needs spec.speculative_continuation=true"),
    (["rollout.kv_block_size=20"], "rollout.kv_block_size=20 must be a multiple of 16"),
    (["ablation.draft_order=longest"], "ablation.draft_order"),
    (["noequals"], "key=value"),
    (["bogus.key=1"], "bogus"),
])
def test_errors_name_the_key(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_config(None, overrides)


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  learning_rate: 1.0\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*train\.learning_rate"):
        load_config(path)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("no/such/config.yaml")


@pytest.mark.parametrize("name", ["tiny.yaml", "default.yaml"])
def test_shipped_configs_load(name):
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "configs" / name
    if not path.exists():
        pytest.fail(f"configs/{name} is missing")
    load_config(path)


@pytest.mark.parametrize("overrides, fragment", [
    (["rollout.tensor_parallel=2"], r"rollout.tensor_parallel=2 is not allowed; choose one of \[1\]"),
    (["parallel.world_size=4", "parallel.tensor=2", "rollout.tensor_parallel=3"],
     r"rollout.tensor_parallel=3 is not allowed; choose one of \[1, 2\]"),
    (["parallel.world_size=4", "parallel.tensor=2", "rollout.tensor_parallel=2",
      "rollout.engine=reference"], "rollout.tensor_parallel=2 needs rollout.engine=vllm"),
    # PP 2 x DP 2 in Megatron's default order: a replica's two stages are not consecutive ranks
    (["parallel.world_size=4", "parallel.pipeline=2", "rollout.tensor_parallel=2"],
     r"choose one of \[1\].*span the pipeline stages with parallel.order=tp-cp-ep-pp-dp"),
    (["parallel.order=pp-dp"], "parallel.order"),
])
def test_rollout_tensor_parallel_is_one_or_the_training_tp(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, overrides)


def test_rollout_tensor_parallel_may_span_the_training_tp():
    cfg = load_config(None, ["parallel.world_size=4", "parallel.tensor=2",
                             "rollout.tensor_parallel=2"])
    assert cfg.rollout.tensor_parallel == cfg.parallel.tensor == 2


@pytest.mark.parametrize("overrides", [
    ["parallel.world_size=4", "parallel.pipeline=2", "parallel.order=tp-cp-ep-pp-dp"],
    ["parallel.world_size=2", "parallel.pipeline=2", "parallel.data=1"],   # one replica
])
def test_rollout_engine_may_span_the_pipeline_stages_of_consecutive_ranks(overrides):
    cfg = load_config(None, [*overrides, "rollout.tensor_parallel=2"])
    assert cfg.rollout.tensor_parallel == cfg.parallel.pipeline == 2


def test_context_parallelism_needs_a_gpu():
    import torch

    overrides = ["parallel.world_size=4", "parallel.context=2"]
    if torch.cuda.is_available():
        assert load_config(None, overrides).parallel.context == 2
    else:
        with pytest.raises(ConfigError, match="parallel.context=2 needs a GPU with Transformer "
                                              "Engine"):
            load_config(None, overrides)


def test_context_parallelism_needs_the_engine_verifier(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # CP is GPU-only
    overrides = ["parallel.world_size=4", "parallel.context=2", "rollout.prompts_per_step=2"]
    with pytest.raises(ConfigError, match="spec.verifier=megatron does not run at "
                                          "parallel.context=2.*use spec.verifier=engine"):
        load_config(None, [*overrides, "spec.verifier=megatron"])
    assert load_config(None, [*overrides, "spec.verifier=engine"]).parallel.context == 2
    assert not load_config(None, [*overrides, "spec.enabled=false"]).spec.enabled


def test_batch_invariant_kernels_need_vllm_on_a_gpu():
    import os

    import torch

    from megatron_bubblespec.rollout.factory import build_engine

    with pytest.raises(ConfigError, match="rollout.batch_invariant is a vLLM mode"):
        load_config(None, ["rollout.batch_invariant=true", "rollout.engine=reference"])
    if torch.cuda.is_available():
        assert load_config(None, ["rollout.batch_invariant=true"]).rollout.batch_invariant
        return
    with pytest.raises(ConfigError, match="batch-invariant kernels, which are CUDA kernels"):
        load_config(None, ["rollout.batch_invariant=true"])
    before = os.environ.get("VLLM_BATCH_INVARIANT")
    with pytest.raises(ValueError, match="batch_invariant need a GPU"):
        build_engine("unused", kind="vllm", batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant is a vLLM mode"):
        build_engine("unused", kind="reference", batch_invariant=True)
    from megatron_bubblespec.rollout.vllm_engine import VLLMEngine

    with pytest.raises(RuntimeError, match="this process has no GPU"):
        VLLMEngine("unused", batch_invariant=True)
    assert os.environ.get("VLLM_BATCH_INVARIANT") == before   # refused before it was set


def test_kl_coef_is_a_non_negative_penalty():
    assert load_config(None, ["train.kl_coef=0.05"]).train.kl_coef == 0.05
    with pytest.raises(ConfigError, match=r"train.kl_coef=-0.1 must be >= 0"):
        load_config(None, ["train.kl_coef=-0.1"])


def test_vllm_continuation_proposes_at_most_what_its_rejection_sampler_takes():
    with pytest.raises(ConfigError, match=r"spec\.spec_k=129: .* at most 128"):
        load_config(None, ["rollout.engine=vllm", "spec.spec_k=129"])
    load_config(None, ["rollout.engine=reference", "spec.spec_k=129"])
