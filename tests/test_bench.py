"""The paired BubbleSpec on/off benchmark on configs/tiny.yaml (3 steps, 2 gloo ranks, drafting
horizon 1 so that step 2 is a steady-state step): same tokens, fewer decode steps from the second
step on, the plain vLLM replay of the off run with the off run's exact token counts, finite ratios
over the whole run and the steady state, and bench.json / bench.md / bench.png."""

import argparse
import json
import math

import pytest

from megatron_bubblespec.config import load_config
from megatron_bubblespec.speculative.sources import SOURCES
from megatron_bubblespec.data.lookahead import LookaheadSampler
from megatron_bubblespec.loop.layout import RolloutLayout
from megatron_bubblespec.loop.run_dir import RunDir
from megatron_bubblespec.measure.bench import (add_bench_parser, before_step, bench, compare,
                                               compare_steps, finished_run,
                                               learner_parted_at_step, parted_at_step,
                                               steady_state_first_step, token_mismatch)
from megatron_bubblespec.measure.bench_report import markdown, markdown_steps, markdown_summary
from megatron_bubblespec.measure.plain_replay import check_replayable, load_run, step_requests

from conftest import TINY

RATIOS = ("decode_steps_ratio", "rollout_time_ratio", "throughput_ratio",
          "throughput_ratio_with_verify", "verify_overhead_frac", "bubble_ratio_off",
          "bubble_utilization", "accepted_prefix_mean", "accept_rate", "draft_len_mean",
          "draft_coverage", "accepted_coverage", "throughput_vs_plain", "throughput_off_vs_plain")
KEYS = RATIOS + ("token_mismatch", "token_mismatch_samples", "lr", "policy_drift_kl_mean",
                 "machine", "config", "overrides", "series", "rollout_time_plain_s", "steady_state")
# Ratios of the steady state (step 2 only): its one step has drafts and a plain replay.
STEADY_RATIOS = ("decode_steps_ratio", "engine_steps_ratio", "throughput_ratio",
                 "throughput_ratio_with_verify", "verify_overhead_frac", "throughput_vs_plain",
                 "throughput_off_vs_plain", "accept_rate", "draft_coverage")


# The fixture trains twice and replays the off run with plain vLLM (minutes): whichever of its
# tests runs first pays for it.
def SLOW(test):
    return pytest.mark.slow(pytest.mark.timeout(1200)(test))


OVERRIDES = ["run.steps=3", "spec.draft_horizon=1", "logging.progress=false", "logging.plot=false",
             "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    bench(TINY, out, OVERRIDES)
    return out, json.loads((out / "bench.json").read_text())


@SLOW
def test_bench_json_has_the_paired_numbers(result):
    out, r = result
    assert set(KEYS) <= set(r)
    assert r["token_mismatch"] == 0 and r["token_mismatch_samples"] == 0
    assert r["parted_at_step"] is None and r["learner_parted_at_step"] is None
    assert all(s["exact/state_hash"] for s in r["series"]["on"])
    for key in RATIOS:
        assert r[key] is not None and math.isfinite(r[key]) and r[key] > 0, key
    assert r["decode_steps_ratio"] < 1  # drafts save decode steps from the second step on
    assert r["throughput_ratio"] == pytest.approx(1 / r["rollout_time_ratio"])
    assert r["throughput_ratio_with_verify"] <= r["throughput_ratio"]
    assert r["lr"] > 0 and math.isfinite(r["policy_drift_kl_mean"])
    assert r["machine"]["cpu_count"] >= 1 and r["machine"]["torch"] and r["machine"]["date"]
    assert r["config"] == str(TINY) and "run.steps=3" in r["overrides"]
    for mode in ("on", "off", "plain"):
        assert [s["step"] for s in r["series"][mode]] == [0, 1, 2]
        assert [x["step"] for x in RunDir(out / f"tiny-{mode}").read_metrics()] == [0, 1, 2]
    assert r["runs"]["plain"] == str(out / "tiny-plain")
    assert r["throughput_vs_plain"] == pytest.approx(
        r["rollout_time_plain_s"] / (r["rollout_time_on_s"] + r["verify_time_on_s"]
                                     + r["overshoot_time_on_s"]))


@SLOW
def test_bench_steady_state_block(result):
    _, r = result
    steady = r["steady_state"]
    assert steady["first_step"] == 2 and steady["steps_compared"] == 1  # lookahead 1 + horizon 1
    assert set(steady) == set(compare_steps((), (), (), 1))
    for key in STEADY_RATIOS:
        assert steady[key] is not None and math.isfinite(steady[key]) and steady[key] > 0, key
    step2 = {mode: r["series"][mode][2] for mode in ("on", "off", "plain")}
    assert steady["decode_steps_ratio"] == pytest.approx(
        step2["on"]["rollout/decode_steps"] / step2["off"]["rollout/decode_steps"])
    assert steady["throughput_vs_plain"] == pytest.approx(
        step2["plain"]["rollout/time_s"]
        / (step2["on"]["rollout/time_s"] + step2["on"]["spec/verify_s"]
           + step2["on"].get("bubble/overshoot_wall_s", 0.0)))


@SLOW
def test_plain_replay_generates_the_off_runs_token_counts(result):
    out, r = result
    off, plain = RunDir(out / "tiny-off").read_rollouts(), RunDir(out / "tiny-plain").read_rollouts()
    assert len(plain) == len(off) == 3
    for step, (a, b) in enumerate(zip(off, plain)):
        assert {g: len(t) for g, t in b.items()} == {g: len(t) for g, t in a.items()}, step
        assert r["series"]["plain"][step]["rollout/tokens"] == sum(map(len, a.values()))
    # vLLM's own sampler drew them, not the keyed one: the tokens are others
    assert token_mismatch(plain, off)[1] > 0
    for rec in r["series"]["plain"]:
        ranks = [rec[f"rank{k}/rollout/time_s"] for k in range(2)]
        assert rec["rollout/time_s"] == max(ranks) and min(ranks) > 0


@SLOW
def test_bench_writes_markdown_and_plot(result):
    out, r = result
    md = (out / "bench.md").read_text()
    assert "decode steps on / off" in md and "token mismatch" in md and "## Per step" in md
    assert "| whole run (steps >= 1) | steady state (steps >= 2) |" in md
    assert "throughput vs plain vLLM" in md and "rollout plain" in md
    assert md.count("\n| 2 |") == 1  # one per-step row per step
    assert "bench_decode.png" in md
    for name in ("bench.png", "bench_decode.png"):
        png = out / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@SLOW
def test_resume_keeps_the_finished_runs_and_only_those(result):
    out, r = result
    again = bench(TINY, out, OVERRIDES, resume=True)  # nothing is missing: no process starts
    assert again["machine"]["reused"] == ["on", "off", "plain"]
    md = (out / "bench.md").read_text()
    assert "runs kept from an earlier bench (--resume): on, off, plain" in md
    # each kept run still says when it ran and beside what load, from its own directory
    assert again["machine"]["runs"] == r["machine"]["runs"]
    for mode, record in r["machine"]["runs"].items():
        assert record["started"] <= record["ended"] and record["wall_s"] > 0, mode
        assert f"{mode} {record['started']} to {record['ended']}" in md
    for key in ("decode_steps_ratio", "throughput_vs_plain", "token_mismatch"):
        assert again[key] == pytest.approx(r[key]), key
    assert again["steady_state"]["throughput_vs_plain"] == pytest.approx(
        r["steady_state"]["throughput_vs_plain"])

    def run(mode, *extra):
        return load_config(TINY, [*OVERRIDES, f"run.output_dir={out}", f"run.name=tiny-{mode}",
                                  f"spec.enabled={str(mode == 'on').lower()}", *extra])
    for mode in ("on", "off"):
        assert finished_run(run(mode)) is not None
        assert finished_run(run(mode, "run.seed=7")) is None   # another config: rerun it
        assert finished_run(run(mode), steps=4) is None        # fewer steps than asked for
    assert finished_run(run("on", "run.name=tiny-missing")) is None
    # BubbleSpec off reads no spec key but spec.enabled: its run serves other spec settings
    assert finished_run(run("on", "spec.draft_horizon=2")) is None
    assert finished_run(run("off", "spec.draft_horizon=2")) is not None
    # nor the KV block, which only the reuse of drafts' KV depends on
    assert finished_run(run("on", "rollout.kv_block_size=32")) is None
    assert finished_run(run("off", "rollout.kv_block_size=32")) is not None
    # no run depends on how often it checkpoints or what it logs
    for mode in ("on", "off"):
        assert finished_run(run(mode, "run.checkpoint_every=1", "logging.plot=false")) is not None


def test_token_mismatch_counts_positions_lengths_and_missing_samples():
    same = [{0: [1, 2, 3], 1: [4]}]
    assert token_mismatch(same, same) == (0, 0)
    assert token_mismatch([{0: [1, 2, 3], 1: [4]}], [{0: [1, 9, 3, 5], 1: [4]}]) == (2, 1)
    assert token_mismatch([{0: [1], 1: [2, 3]}], [{0: [1]}]) == (2, 1)
    assert token_mismatch([{0: [1]}, {0: [2]}], [{0: [1]}]) == (1, 1)


def test_parting_is_the_first_step_whose_tokens_or_fingerprints_differ():
    on = [{0: [1, 2]}, {0: [3]}, {0: [4, 5]}, {0: [6]}]
    assert parted_at_step(on, on) is None
    assert parted_at_step(on, [*on[:2], {0: [4, 9]}, {0: [7]}]) == 2
    assert parted_at_step(on, [*on[:3], {0: [6], 1: []}]) == 3   # a sample only one run has
    assert parted_at_step(on, on[:3]) == 3                       # a step only one run has
    records = [{"step": s, "exact/batch_hash": 7.0, "exact/state_hash": float(s)}
               for s in range(4)]
    assert learner_parted_at_step(records, records) is None
    changed = [*records[:1], {**records[1], "exact/state_hash": 9.0}, *records[2:]]
    assert learner_parted_at_step(records, changed) == 1
    assert learner_parted_at_step(records, [{"step": s} for s in range(4)]) is None
    assert [r["step"] for r in before_step(records, 2)] == [0, 1]
    assert before_step(records, None) == records


def test_a_parted_bench_compares_the_steps_before_the_parting_only():
    def run(decode):
        return [{"step": s, "rollout/decode_steps": d, "rollout/time_s": 1.0}
                for s, d in enumerate(decode)]
    on, off = run([100, 50, 50, 900]), run([100, 100, 100, 100])
    r = compare(*(before_step(x, 3) for x in (on, off)), steady_from=2)
    assert r["decode_steps_ratio"] == pytest.approx(0.5) and r["steps_compared"] == 2
    assert r["steady_state"]["steps_compared"] == 1
    result = {**r, "name": "x", "config": "c.yaml", "overrides": [], "steps": 4,
              "parted_at_step": 3, "learner_parted_at_step": 1,
              "series": {"on": on, "off": off},
              "machine": {"cpus_usable": 2, "cpu_count": 2, "torch": "t", "cuda": None,
                          "started": "s", "date": "d", "wall_s": 1.0, "loadavg_1_5_15": None}}
    md = markdown(result)
    assert "parted at step 3" in md and "steps < 3 only" in md
    assert "learners parted at step 1" in md
    same = markdown({**result, "parted_at_step": None, "learner_parted_at_step": None})
    assert "rolled out the same tokens at every step" in same and "parted" not in same
    assert "runs:" not in md   # a bench from before the runs kept their own times
    timed = markdown({**result, "machine": {**result["machine"], "runs": {
        "on": {"started": "a", "ended": "b", "wall_s": 1.0, "loadavg_1_5_15": [1.0, 2.0, 3.0]},
        "off": None}}})
    assert "runs: on a to b, load average at its end 1.00 2.00 3.00." in timed


def test_ratios_start_at_step_one_and_are_nan_without_data():
    on = [{"step": 0, "rollout/decode_steps": 100, "rollout/time_s": 9.0},
          {"step": 1, "rollout/decode_steps": 60, "rollout/time_s": 2.0, "spec/verify_s": 0.5,
           "bubble/overshoot_wall_s": 0.25}]
    off = [{"step": 0, "rollout/decode_steps": 100, "rollout/time_s": 1.0},
           {"step": 1, "rollout/decode_steps": 80, "rollout/time_s": 3.0}]
    r = compare(on, off)
    assert r["decode_steps_ratio"] == pytest.approx(0.75)
    assert r["throughput_ratio"] == pytest.approx(1.5)
    # verifying and the drafting engine's step past the barrier are paid by the on run
    assert r["throughput_ratio_with_verify"] == pytest.approx(3.0 / 2.75)
    assert r["verify_overhead_frac"] == pytest.approx(0.25)
    assert r["overshoot_frac"] == pytest.approx(0.125)
    assert math.isnan(compare(on[:1], off[:1])["decode_steps_ratio"])


def same(a: dict, b: dict) -> bool:
    """Equal dicts up to the first_step key, NaN equal to NaN."""
    keys = (set(a) | set(b)) - {"first_step"}
    return all(k in a and k in b and (a[k] == b[k] or math.isnan(a[k]) and math.isnan(b[k]))
               for k in keys)


def test_steady_state_is_the_same_numbers_over_the_later_steps():
    on = [{"step": 0, "rollout/decode_steps": 100, "rollout/time_s": 9.0},
          {"step": 1, "rollout/decode_steps": 30, "rollout/time_s": 1.0, "spec/verify_s": 0.5,
           "spec/drafted_tokens": 80, "spec/accepted_tokens": 70},
          {"step": 2, "rollout/decode_steps": 60, "rollout/time_s": 2.0, "spec/verify_s": 0.5,
           "spec/drafted_tokens": 40, "spec/accepted_tokens": 10}]
    off = [{"step": s, "rollout/decode_steps": 100, "rollout/time_s": 3.0} for s in range(3)]
    plain = [{"step": s, "rollout/time_s": 2.5} for s in range(3)]
    r = compare(on, off, plain, steady_from=2)
    steady = r["steady_state"]
    assert same(steady, compare_steps(on, off, plain, 2)) and steady["first_step"] == 2
    assert steady["decode_steps_ratio"] == pytest.approx(0.6)
    assert r["decode_steps_ratio"] == pytest.approx(0.45)
    assert steady["throughput_vs_plain"] == pytest.approx(2.5 / 2.5)
    assert r["throughput_vs_plain"] == pytest.approx(5.0 / 4.0)
    assert steady["throughput_off_vs_plain"] == pytest.approx(2.5 / 3.0)
    assert steady["accept_rate"] == pytest.approx(0.25)
    assert r["accept_rate"] == pytest.approx(80 / 120)
    whole = compare_steps(on, off, plain, 1)
    assert same({k: r[k] for k in set(whole) - {"first_step"}}, whole) and whole["first_step"] == 1
    assert math.isnan(compare(on, off)["throughput_vs_plain"])  # no replay: no plain numbers
    md = markdown_summary(r)
    assert "| decode steps on / off | 0.450 | 0.600 |" in md
    assert "| learning rate | - |  |" in md  # a whole-run-only number has no steady value
    assert math.isnan(compare(on, off, plain, steady_from=3)["steady_state"]["decode_steps_ratio"])


def test_bench_tables_show_every_proposal_source_and_the_registrys_columns():
    on = [{"step": 0, "rollout/decode_steps": 100, "rollout/time_s": 9.0},
          {"step": 1, "rollout/decode_steps": 60, "rollout/time_s": 2.0,
           "spec/continuation_proposed_tokens/realign": 5,
           "spec/continuation_accepted_tokens/siblings": 2, "spec/accept_rate": 0.5}]
    off = [{"step": s, "rollout/decode_steps": 100, "rollout/time_s": 3.0} for s in range(2)]
    r = compare(on, off)
    assert r["continuation_proposed_tokens_realign"] == 5
    assert r["continuation_accepted_tokens_siblings"] == 2
    md = markdown_summary(r)
    for source in SOURCES:
        for kind in ("proposed", "accepted"):
            assert f"| continuation {kind} tokens from {source} |" in md, (kind, source)
    assert "| continuation proposed tokens from realign | 5 |" in md
    assert "| continuation accepted tokens from siblings | 2 |" in md
    steps = markdown_steps(on, off).splitlines()
    assert steps[0].startswith("| step | decode steps on | decode steps off | engine steps on |")
    assert "| accept rate on |" in steps[0] and "rollout plain" not in steps[0]
    assert steps[3].startswith("| 1 | 60 | 100 |") and "| 50.0% |" in steps[3]


def test_steady_state_starts_after_the_steps_step_0s_bubble_drafts():
    assert steady_state_first_step(load_config(TINY)) == 3   # tiny.yaml: lookahead 1, horizon 2
    cfg = load_config(TINY, ["ablation.draft_lookahead=2", "spec.draft_horizon=3"])
    assert steady_state_first_step(cfg) == 5                 # step 0 drafts steps 2, 3, 4


def test_plain_replay_refuses_a_directory_that_is_not_a_finished_run(tmp_path):
    with pytest.raises(ValueError, match="no config.yaml"):
        load_run(tmp_path)
    (tmp_path / "config.yaml").write_text("run:\n  name: x\n")
    with pytest.raises(ValueError, match="no rollouts.*--no-plain"):
        load_run(tmp_path)


@pytest.mark.parametrize("layout", [["parallel.pipeline=2"], ["parallel.tensor=2"],
                                    ["parallel.tensor=2", "rollout.tensor_parallel=2"]])
def test_the_plain_replay_times_each_rollout_engines_share(layout):
    """PP 2 x DP 2 and TP 2 x DP 2 at rollout TP 1 have 4 engines, TP 2 at rollout TP 2 has 2:
    the replay times each engine's batch, dealt from its replica's samples as the run deals them."""
    cfg = load_config(TINY, ["parallel.world_size=4", "parallel.data=2", "run.steps=1", *layout])
    batch = LookaheadSampler(cfg.run.seed, 10**6, cfg.rollout.prompts_per_step, 2,
                             cfg.rollout.samples_per_prompt).batch(0)
    lengths = {g: 1 + g % 5 for g in range(batch.num_samples)}
    model = argparse.Namespace(vocab_size=cfg.model.tiny_vocab_size)
    if cfg.rollout.tensor_parallel > 1:
        with pytest.raises(ValueError, match="rollout.tensor_parallel=1"):
            check_replayable(cfg)
    engines = step_requests(cfg, model, [{g: [7] * n for g, n in lengths.items()}])[0]
    per_replica = 4 // cfg.rollout.tensor_parallel // 2
    assert len(engines) == 2 * per_replica
    for dp in range(2):
        deal = RolloutLayout(0, (0, 1), cfg.rollout.tensor_parallel, dp, 2)
        for e in range(per_replica):
            requests = engines[dp * per_replica + e]
            samples = [int(r.request_id.rsplit("-", 1)[1]) for r in requests]
            assert samples == deal.share(list(batch.rank_sample_range(dp)), e) and samples
            assert [r.max_new_tokens for r in requests] == [lengths[g] for g in samples]


def test_bench_parser_wiring():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--config", "c.yaml", "--out", "o", "run.steps=2"])
    assert (args.config, args.out, args.overrides) == ("c.yaml", "o", ["run.steps=2"])
    assert args.func.__name__ == "cmd_bench" and not args.no_plain
    assert parser.parse_args(["bench", "--config", "c", "--out", "o", "--no-plain"]).no_plain
    assert not args.resume
    assert parser.parse_args(["bench", "--config", "c", "--out", "o", "--resume"]).resume


def test_draft_length_coverage_and_utilization_of_drafting_bubbles():
    on = [{"step": 0, "rollout/tokens": 50, "bubble/idle_s": 4.0, "bubble/drafting_s": 3.0,
           "rollout/time_s": 5.0},
          {"step": 1, "rollout/tokens": 100, "spec/drafted_tokens": 60, "spec/drafted_samples": 3,
           "spec/accepted_tokens": 30, "spec/continuation_accepted_tokens": 20,
           "bubble/idle_s": 6.0, "bubble/drafting_s": 0.0, "rollout/time_s": 5.0}]
    r = compare(on, on)
    assert r["draft_len_mean"] == pytest.approx(20.0)
    assert r["draft_coverage"] == pytest.approx(0.6)
    assert r["accepted_coverage"] == pytest.approx(0.5)
    assert r["bubble_utilization"] == pytest.approx(0.75)  # the last step's bubble cannot draft
    assert r["accept_per_token"] == pytest.approx(30 / 33)
    assert r["decode_steps_ratio_ceiling"] == pytest.approx(1 - 30 / 33 * 0.6)
    assert r["decode_steps_ratio_ceiling_full_coverage"] == pytest.approx(1 - 30 / 33)
    # drafts that run on past their responses' ends cover them only up to there
    on[1]["spec/drafted_tokens_in_response"] = 45
    r = compare(on, on)
    assert r["draft_coverage"] == pytest.approx(0.45) and r["drafted_tokens"] == 60
    assert r["decode_steps_ratio_ceiling"] == pytest.approx(1 - 30 / 33 * 0.45)
