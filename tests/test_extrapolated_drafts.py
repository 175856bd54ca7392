"""Drafting with weights extrapolated from the engine's last two versions
(``spec.draft_weights=extrapolated``): the arithmetic on the resharded stream, the version that keeps
them out of every rollout, and whole runs (DP 2 on and off; TP 2 x DP 2 with drafts verified
inside the engines) that give the plain run's tokens, losses and weights bit for bit while the
bubbles draft with them."""

import pytest
import torch

from megatron_bubblespec.config import load_config
from megatron_bubblespec.loop.step import _check_engine_version
from megatron_bubblespec.loop.train import train
from megatron_bubblespec.rollout.reference import ReferenceEngine
from megatron_bubblespec.speculative.extrapolated import DRAFTING_VERSION, ExtrapolatedWeights

from conftest import QUIET, TINY, assert_on_off_identical

ON = "spec.draft_weights=extrapolated"


def _stream(scale: float):
    return [("a", torch.full((2, 3), scale)), ("b", torch.arange(4, dtype=torch.float64) * scale)]


def _read(weights: ExtrapolatedWeights, stream) -> list:
    return list(weights.watch(iter(stream)))


def test_drafting_weights_step_once_more_along_the_last_update():
    weights = ExtrapolatedWeights()
    first = _stream(1.0)
    assert _read(weights, first) == first          # the stream passes through unchanged
    assert not weights.ready                       # one version: nothing to extrapolate from
    _read(weights, _stream(1.5))
    assert weights.ready
    drafting = dict(weights.drafting())
    assert torch.equal(drafting["a"], torch.full((2, 3), 2.0))
    assert drafting["b"].dtype == torch.float64
    assert torch.equal(drafting["b"], torch.arange(4, dtype=torch.float64) * 2.0)


def test_a_stream_cut_short_or_reshaped_gives_no_drafting_weights():
    weights = ExtrapolatedWeights()
    _read(weights, _stream(1.0))
    cut = weights.watch(iter(_stream(2.0)))
    next(cut)                                      # a reshard that failed half-way
    assert not weights.ready
    _read(weights, [("a", torch.zeros(3, 2)), ("b", torch.zeros(4))])
    assert not weights.ready                       # "a" changed shape


def test_an_engine_holding_drafting_weights_refuses_to_roll_out(tiny_checkpoint):
    """The reference engine loads W_t + (W_t - W_{t-1}) under the drafting version, which the
    rollout's version check refuses; the next reshard's version is accepted again."""
    path = tiny_checkpoint("llama", vocab_size=64, hidden_size=32, num_layers=2)
    engine = ReferenceEngine(path)
    original = {name: t.clone() for name, t in engine.model.weights.items()}
    weights = ExtrapolatedWeights()
    engine.update_weights(weights.watch(iter(original.items())), 1)
    moved = {name: t + 0.01 for name, t in original.items()}
    engine.update_weights(weights.watch(iter(moved.items())), 2)
    assert weights.load(engine) and weights.load_s > 0
    assert engine.weight_version == DRAFTING_VERSION
    for name, tensor in engine.model.weights.items():
        torch.testing.assert_close(tensor, original[name] + 0.02)
    with pytest.raises(RuntimeError, match="off-policy"):
        _check_engine_version(engine, 2)
    engine.update_weights(iter(moved.items()), 3)
    _check_engine_version(engine, 3)


@pytest.fixture(scope="module")
def extrapolated_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("extrapolated")

    def run(name, *overrides):
        cfg = load_config(TINY, [f"run.output_dir={root}", f"run.name={name}", *QUIET, ON,
                                 *overrides])
        return train(cfg, return_weights=True)

    return {"dp2": run("dp2"),
            "tp2": run("tp2", "parallel.world_size=4", "parallel.tensor=2", "parallel.data=2",
                       "spec.verifier=engine")}


def _loads(records) -> list[int]:
    return [r["bubble/draft_weights_loads"] for r in records]


@pytest.mark.slow
def test_drafting_with_extrapolated_weights_keeps_the_off_runs_tokens_and_weights(
        extrapolated_runs, tiny_runs):
    """DP 2: the first engine to reach step 2's barrier drafts step 3 with extrapolated weights
    (steps 0 and 1 have no two versions yet; the last step has nothing to draft), step 3 verifies
    those drafts, accepting and rejecting some, and the run is the off run's."""
    on = extrapolated_runs["dp2"]
    assert _loads(on["records"]) == [0, 0, 1, 0]
    assert on["records"][2]["bubble/draft_weights_load_s"] > 0
    assert on["records"][3]["spec/drafted_tokens"] > 0
    assert_on_off_identical(on, tiny_runs.off, "extrapolated drafts, DP 2", len(on["records"]))


@pytest.mark.slow
def test_extrapolated_drafts_verified_inside_the_engines_at_tensor_parallelism(
        extrapolated_runs, tiny_runs):
    """TP 2 x DP 2, drafts verified inside each engine's rollout: the DP 2 off run's tokens."""
    on = extrapolated_runs["tp2"]
    assert sum(_loads(on["records"])) > 0
    drafted = sum(r["spec/drafted_tokens"] for r in on["records"])
    accepted = sum(r["spec/accepted_tokens"] for r in on["records"])
    assert 0 < accepted < drafted, (accepted, drafted)
    assert on["rollouts"] == tiny_runs.off["rollouts"]
