"""Config: YAML + dotted overrides onto the typed schema; every error names the key."""

from pathlib import Path

import re

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
    (["spec.verifier=engine", "rollout.engine=reference", "parallel.world_size=2",
      "parallel.tensor=2", "parallel.data=1"], "spec.verifier=engine with rollout.engine=reference"),
    (["spec.proposal_token_cost=-0.1"], "spec.proposal_token_cost"),
    (["ablation.measure_proposal_cost=true", "rollout.engine=reference"],
     "ablation.measure_proposal_cost measures a vLLM engine"),
    (["ablation.measure_proposal_cost=true", "ablation.speculative_continuation=false"],
     "needs ablation.speculative_continuation=true"),
    (["rollout.kv_block_size=20"], "rollout.kv_block_size=20 must be a multiple of 16"),
    (["ablation.draft_order=longest"], "ablation.draft_order"),
    (["rollout.temperature=0"], "rollout.temperature=0 samples greedily"),
    (["train.tis_cap=0.5"], r"train.tis_cap=0.5 must be 0 \(off\) or >= 1"),
    (["train.tis_cap=2", "rollout.temperature=0.7"],
     "train.tis_cap=2 weighs tokens by Megatron's over the engine's probability"),
    (["noequals"], "key=value"),
    (["bogus.key=1"], "bogus"),
])
def test_errors_name_the_key(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides,fragment", [
    (["ablation.rule=lenient", "spec.verifier=megatron"],
     "ablation.rule='lenient' (an ablation rule) needs the drafts' distributions"),
    (["spec.verifier=engine", "ablation.rule=residual"], "spec.verifier=engine on vLLM"),
    (["ablation.rule=strict"], "ablation.rule='strict' is not a verification rule; choose one of "
                               "['keyed', 'residual', 'lenient']"),
    (["data.task=cobol"], "data.task='cobol' is not a task; choose one of"),
])
def test_names_are_checked_against_the_registries(overrides, fragment):
    """Tasks and rules are registered where their code is (data.registry, speculative.rules), above
    the config package, so preflight checks the names and their placement."""
    from megatron_bubblespec.preflight import check_registered

    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        check_registered(cfg)


def test_moved_keys_load_under_their_new_names(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("spec:\n  speculative_continuation: false\nablation:\n"
                   "  proposal_sources: [bubble]\n")
    with pytest.warns(FutureWarning, match="spec.speculative_continuation is now "
                                           "ablation.speculative_continuation"):
        cfg = load_config(old, ["spec.reuse_draft_kv=false"])
    assert not cfg.ablation.speculative_continuation and not cfg.ablation.reuse_draft_kv
    assert cfg.spec.proposal_sources == ["bubble"]


def test_expert_parallelism_divides_data_parallelism():
    layout = ["parallel.world_size=4", "parallel.data=4", "rollout.prompts_per_step=4"]
    assert load_config(None, [*layout, "parallel.expert=2"]).parallel.expert == 2
    with pytest.raises(ConfigError, match=r"parallel\.expert=3 must divide parallel\.data=4"):
        load_config(None, [*layout, "parallel.expert=3"])


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
    import torch

    with pytest.raises(ConfigError, match="rollout.batch_invariant is a vLLM mode"):
        load_config(None, ["rollout.batch_invariant=true", "rollout.engine=reference"])
    if torch.cuda.is_available():
        assert load_config(None, ["rollout.batch_invariant=true"]).rollout.batch_invariant
        return
    with pytest.raises(ConfigError, match="batch-invariant kernels, which are CUDA kernels"):
        load_config(None, ["rollout.batch_invariant=true"])


@pytest.mark.slow   # constructs a VLLMEngine (refused before it starts), which quick tests may not
def test_engines_refuse_batch_invariant_kernels_without_a_gpu():
    import os

    import torch

    from megatron_bubblespec.rollout.factory import build_engine

    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without a GPU")
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
    with pytest.raises(ConfigError, match=r"spec\.spec_k=129, spec\.suffix_k=32: .* at most 128"):
        load_config(None, ["rollout.engine=vllm", "spec.spec_k=129"])
    with pytest.raises(ConfigError, match=r"spec\.suffix_k=129: .* at most 128"):
        load_config(None, ["rollout.engine=vllm", "spec.suffix_k=129"])
    load_config(None, ["rollout.engine=reference", "spec.spec_k=129", "spec.suffix_k=129"])


CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _leaves(node, prefix=""):
    """(dotted key, value) of every leaf of a nested mapping (lists are values)."""
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_default_yaml_restates_only_schema_defaults():
    """The schema's defaults are the main job: configs/default.yaml states no other value."""
    import dataclasses

    import yaml

    from megatron_bubblespec.config.rules import _get
    from megatron_bubblespec.config.schema import Config

    stated = dict(_leaves(yaml.safe_load((CONFIGS / "default.yaml").read_text())))
    assert stated, "configs/default.yaml restates no key"
    defaults = Config()
    differ = {key: (value, _get(defaults, key)) for key, value in stated.items()
              if value != _get(defaults, key)}
    assert not differ, f"configs/default.yaml differs from the schema (stated, default): {differ}"
    from_file = load_config(CONFIGS / "default.yaml")
    assert dataclasses.replace(from_file, config_path=None) == load_config(None)


def test_train_without_a_config_runs_the_main_job():
    from megatron_bubblespec.cli import build_parser

    args = build_parser().parse_args(["train", "run.steps=2"])
    assert args.config is None and args.overrides == ["run.steps=2"]
    cfg = load_config(args.config, args.overrides)
    assert (cfg.model.path, cfg.data.task, cfg.run.name) == ("smollm2", "gsm8k", "smollm2-gsm8k")
    assert (cfg.parallel.data, cfg.rollout.engine, cfg.spec.enabled) == (2, "vllm", True)
    assert cfg.spec.proposal_sources == ["bubble", "realign", "prompt", "self", "siblings"]


def _train(monkeypatch, capsys, path) -> tuple[int, str]:
    """``bubblespec train --config path`` in this process, as the command line runs it."""
    import os

    from megatron_bubblespec import cli

    for name in ("TORCH_CPP_LOG_LEVEL", "HF_HUB_DISABLE_PROGRESS_BARS"):   # set by the command
        monkeypatch.setenv(name, os.environ.get(name, "unset"))
    code = cli.main(["train", "--config", str(path)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("text, where", [
    ("run:\n  name: [smollm2\nspec:\n  enabled: true\n", "line 3, column 5"),   # unclosed [
    ("run:\n  steps: 6\n\tseed: 1\n", "line 3, column 1"),                        # a tab indents
    ("run:\n  steps: 6\nrun:\n  seed: 1\n", "line 3, column 1"),                  # run: twice
])
def test_yaml_syntax_error_names_file_line_and_column(tmp_path, monkeypatch, capsys, text, where):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"broken\.yaml, {where}: not valid YAML"):
        load_config(path)
    code, err = _train(monkeypatch, capsys, path)
    assert code == 2
    assert err.startswith(f"bubblespec train: config error: {path}, {where}: not valid YAML")


@pytest.mark.parametrize("text, shape", [("- run\n- spec\n", "a list"), ("42\n", "a single value")])
def test_top_level_must_be_a_mapping(tmp_path, monkeypatch, capsys, text, shape):
    path = tmp_path / "flat.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"flat\.yaml: the top level is {shape}; a config file "
                                          "is a mapping of sections"):
        load_config(path)
    code, err = _train(monkeypatch, capsys, path)
    assert code == 2 and f"the top level is {shape}" in err


def test_an_empty_config_file_is_the_main_job(tmp_path):
    import dataclasses

    path = tmp_path / "empty.yaml"
    path.write_text("# nothing but a comment\n")
    assert dataclasses.replace(load_config(path), config_path=None) == load_config(None)


# ---------------------------------------------------------------------------- run identity

def test_run_identity_leaves_out_the_observer_keys():
    """Checkpointing, watchdogs and logging change no run; the run's own settings do."""
    from megatron_bubblespec.config import run_identity
    from megatron_bubblespec.config.identity import neutral_keys

    assert neutral_keys(True) == {
        "run": ("resume", "checkpoint_every", "checkpoint_dir", "keep_checkpoints",
                "stall_timeout_s", "signal_grace_s", "checkpoint_grace_s"),
        "spec": ("barrier_timeout_s",),
        "logging": ("tensorboard", "progress", "plot")}
    base = run_identity(load_config(None))
    observers = ["run.checkpoint_every=3", "run.checkpoint_dir=elsewhere", "run.keep_checkpoints=5",
                 "run.stall_timeout_s=60", "run.signal_grace_s=5", "run.checkpoint_grace_s=9",
                 "spec.barrier_timeout_s=60",
                 "logging.tensorboard=false", "logging.progress=false", "logging.plot=false"]
    assert run_identity(load_config(None, observers)) == base
    for setting in ("run.seed=7", "rollout.kv_block_size=64", "spec.draft_horizon=2",
                    "ablation.draft_order=stragglers", "train.lr=1e-5", "run.steps=4"):
        assert run_identity(load_config(None, [setting])) != base, setting


def test_run_identity_of_an_off_run_reads_only_spec_enabled():
    """With BubbleSpec off no spec key but enabled, no ablation key and no OFF_RUN key (the
    KV block) changes the run; with it on, the KV block does."""
    from megatron_bubblespec.config import run_identity
    from megatron_bubblespec.config.identity import neutral_keys

    assert neutral_keys(False) == {**neutral_keys(True), "rollout": ("kv_block_size",)}
    off = run_identity(load_config(None, ["spec.enabled=false"]))
    drafting = ["spec.verifier=megatron", "spec.min_match=5", "spec.draft_horizon=1",
                "spec.proposal_sources=[bubble]", "ablation.draft_order=stragglers",
                "rollout.kv_block_size=null", "run.keep_checkpoints=4"]
    assert run_identity(load_config(None, ["spec.enabled=false", *drafting])) == off
    assert run_identity(load_config(None, ["spec.enabled=false", "run.seed=7"])) != off
    assert "enabled: false" in off
    on = run_identity(load_config(None))
    assert on != off
    assert run_identity(load_config(None, ["rollout.kv_block_size=null"])) != on
