"""The scale simulator: step model, bubble drafting, calibration against a measured bench, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from megatron_bubblespec.sim.calibrate import (calibrate, calibration_check, expected_accepted,
                                               fit_accept_prob, fit_lengths)
from megatron_bubblespec.sim.drafting import draft_in_bubble
from megatron_bubblespec.sim.model import EngineCosts, LengthModel, Setting, StepCosts, simulate

DATA = Path(__file__).parent / "data" / "sim"
BENCH = DATA / "tiny" / "bench.json"
ENGINES = [DATA / "engine_tiny_p16.json", DATA / "engine_tiny_p400.json"]
ENGINE = EngineCosts(step_s=2e-3, seq_s=5e-5, kv_token_s=1e-8, prefill_s=1e-3,
                     prefill_token_s=1e-6)
COSTS = StepCosts(ENGINE, verify_s=5e-3, verify_token_s=1e-6, train_token_s=1e-5, reshard_s=1e-3)
LONG_TAIL = LengthModel("lognormal", mu=math.log(0.2), sigma=1.0)


def setting(**changes) -> Setting:
    base = dict(ranks=8, samples_per_rank=8, prompt_len=32, max_new_tokens=1024,
                max_draft_tokens=1024, accept_prob=1.0)
    return Setting(**{**base, **changes})


def test_no_length_variance_means_no_bubble():
    same = LengthModel("lognormal", mu=math.log(0.5), sigma=0.0)
    result = simulate(setting(ranks=16), COSTS, same, steps=5, seed=0)
    assert result["bubble_ratio_off"] == 0.0
    assert result["bubble_ratio_on"] == 0.0
    assert result["drafted_tokens"] == 0
    assert result["decode_steps_ratio"] == 1.0


def test_bubble_grows_with_ranks_for_long_tailed_lengths():
    bubbles = [simulate(setting(ranks=r, spec=False), COSTS, LONG_TAIL, steps=40,
                        seed=1)["bubble_ratio_off"] for r in (2, 8, 32, 128)]
    assert all(b > 0 for b in bubbles)
    assert bubbles == sorted(bubbles), bubbles


def test_zero_acceptance_saves_only_the_correction_token():
    # every response has >= 2 tokens, so a rejected draft still saves exactly its correction token
    lengths = LengthModel("lognormal", mu=math.log(0.3), sigma=0.8)
    result = simulate(setting(accept_prob=0.0, max_new_tokens=4096, max_draft_tokens=4096),
                      COSTS, lengths, steps=8, seed=2)
    trace = result["trace"]
    assert result["accept_rate"] == 0.0
    assert sum(trace["drafted_samples"]) > 0
    saved = np.subtract(trace["decode_off"], trace["decode_on"])
    assert saved.tolist() == trace["drafted_samples"]
    assert result["decode_steps_ratio"] > 0.99


def test_full_acceptance_with_a_bubble_saves_decode_steps():
    result = simulate(setting(ranks=16), COSTS, LONG_TAIL, steps=8, seed=3)
    assert result["bubble_ratio_off"] > 0.1
    assert result["accept_rate"] == 1.0
    assert result["decode_steps_ratio"] < 0.9
    assert result["throughput_ratio"] > 1.0


def test_drafting_hands_out_samples_from_index_zero_once_each():
    arrive = np.array([1.0, 2.0, 5.0])          # ranks 0 and 1 wait for rank 2
    lens = np.full(64, 10_000)                 # longer than the bubble
    outcome = draft_in_bubble(arrive, lens, ENGINE, 32, concurrency=4, chunk=2)
    drafted = np.flatnonzero(outcome.tokens)
    assert drafted.tolist() == list(range(len(drafted)))   # claimed from the cursor's start
    assert len(drafted) == 8                                  # 4 in flight on each waiting rank
    assert (outcome.tokens <= lens).all()
    assert outcome.drafting_s[2] == 0.0                       # the last to arrive never drafts
    assert outcome.drafting_s[0] > outcome.drafting_s[1] > 0


def test_fitted_length_model_recovers_a_censored_lognormal():
    truth = LengthModel("lognormal", mu=math.log(0.4), sigma=0.7)
    lengths = truth.sample(np.random.default_rng(0), (4000,), 2000)
    fitted = fit_lengths(lengths, 2000)
    assert fitted.mu == pytest.approx(truth.mu, abs=0.05)
    assert fitted.sigma == pytest.approx(truth.sigma, abs=0.05)


def test_fitted_acceptance_explains_the_accepted_tokens():
    records = [{"spec/drafted_samples": 10, "spec/drafted_tokens": 400,
                "spec/accepted_tokens": 150}]
    p = fit_accept_prob(records)
    assert 0 < p < 1
    assert 10 * expected_accepted(p, 40) == pytest.approx(150)
    assert fit_accept_prob([{**records[0], "spec/accepted_tokens": 400}]) == 1.0


def test_calibration_reproduces_the_measured_two_rank_bench():
    """Replaying the fixture's measured lengths on its 2 ranks gives its bubble within 30 % and its
    decode-steps ratio within 5 % (the fixture's measured errors are recorded in simulate.md)."""
    cal = calibrate(BENCH, ENGINES)
    assert cal.setting.ranks == 2 and cal.measured_lengths.shape[1:] == (2, 8)
    check = calibration_check(cal, replicates=16)["replay"]
    bubble = check["bubble_ratio_off"]
    assert bubble["measured"] > 0
    assert abs(bubble["rel_error"]) < 0.3, bubble
    assert abs(check["decode_steps_ratio"]["rel_error"]) < 0.05, check["decode_steps_ratio"]


def test_simulate_cli_writes_json_markdown_and_plot(tmp_path):
    from megatron_bubblespec.cli import main

    argv = ["simulate", "--bench", str(BENCH), "--ranks", "8,16", "--contexts", "4096,8192",
            "--steps", "4", "--seeds", "1", "--check-replicates", "2", "--out", str(tmp_path)]
    for engine in ENGINES:
        argv += ["--engine", str(engine)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "simulate.json").read_text())
    assert [(p["ranks"], p["context"]) for p in result["predictions"]] == [
        (8, 4096), (16, 4096), (8, 8192), (16, 8192)]
    assert set(result["check"]) == {"replay", "replay_no_jitter", "sampled"}
    assert "## Calibration check" in (tmp_path / "simulate.md").read_text()
    assert (tmp_path / "simulate.png").read_bytes()[:4] == b"\x89PNG"


def test_simulate_cli_names_a_missing_bench(tmp_path, capsys):
    from megatron_bubblespec.cli import main

    assert main(["simulate", "--bench", str(tmp_path / "nope.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_continuation_saves_decode_steps_past_the_verified_prefix():
    """Same lengths and acceptance: continuation over the covered rest of each response
    decodes fewer steps than the prefix alone."""
    from megatron_bubblespec.sim.model import tokens_per_continuation_step

    assert tokens_per_continuation_step(1.0, 4) == 5.0
    assert tokens_per_continuation_step(0.0, 4) == 1.0
    assert tokens_per_continuation_step(0.5, 2) == pytest.approx(1.75)
    runs = [simulate(setting(ranks=16, accept_prob=0.9, continuation_k=k), COSTS, LONG_TAIL,
                     steps=8, seed=3) for k in (0, 4)]
    prefix, continued = (r["decode_steps_ratio"] for r in runs)
    assert continued < prefix < 1.0
