"""The on-policy assertion on a real step: a tiny Llama (untied LM head) rolls out with the reference
engine, Megatron takes one GRPO step (the tiny config's lr), the new weights go to two engines,
one of them with the LM head from before the step (the stale-head bug). The next rollouts'
engine logprobs against Megatron's: the synced engine passes the check, the stale one fails it
with the message that says what to check."""

import pytest
import torch

from megatron_bubblespec.distributed import destroy_distributed, init_distributed, megatron_cpu_mode
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.models.architecture import load_checkpoint
from megatron_bubblespec.rollout.reference import ReferenceEngine
from megatron_bubblespec.sampling import SamplingParams, sample_key
from megatron_bubblespec.sampling.requests import RolloutRequest
from megatron_bubblespec.train.grpo import group_advantages
from megatron_bubblespec.train.model import build_gpt_model
from megatron_bubblespec.train.onpolicy import (LIMITS, OffPolicyError, check_on_policy,
                                                logprob_gap)
from megatron_bubblespec.train.sharding import load_hf_weights
from megatron_bubblespec.train.batch import GRPOBatch, gather_responses
from megatron_bubblespec.train.trainer import MegatronTrainer, TrainerConfig

VOCAB, GROUP, PROMPTS, NEW_TOKENS = 256, 4, 4, 32
LR = 1e-4                   # configs/tiny.yaml


def _requests(step: int) -> list[RolloutRequest]:
    g = torch.Generator().manual_seed(step)
    prompts = [torch.randint(3, VOCAB, (6,), generator=g).tolist() for _ in range(PROMPTS)]
    return [RolloutRequest(f"s{step}-{p}-{i}", prompts[p], sample_key(5, step, p, i), NEW_TOKENS)
            for p in range(PROMPTS) for i in range(GROUP)]


def _megatron_logprobs(trainer, requests, results) -> list[list[float]]:
    batch = GRPOBatch.from_responses([r.prompt_token_ids for r in requests],
                                     [x.token_ids for x in results],
                                     [x.logprobs for x in results], torch.zeros(len(results)))
    return gather_responses(trainer.logprobs(batch.tokens, batch.response_mask),
                            batch.response_mask)


def _stale_head_worker(path):
    init_distributed(1, 1, seed=0, backend="gloo")
    arch, tensors = load_checkpoint(path)
    with megatron_cpu_mode():
        model = build_gpt_model(arch)
        load_hf_weights(model, arch, tensors)
    trainer = MegatronTrainer(model, arch, TrainerConfig(lr=LR, micro_batch_size=4))
    params = SamplingParams(1.0)
    synced, stale = ReferenceEngine(path), ReferenceEngine(path)

    requests = _requests(0)                                              # step 0: weights v0
    results = synced.generate(requests, params)
    step0 = check_on_policy([x.logprobs for x in results],
                            _megatron_logprobs(trainer, requests, results), "float32",
                            step=0, weight_version=0)
    rewards = torch.tensor([float(sum(t % 2 for t in x.token_ids)) for x in results])
    batch = GRPOBatch.from_responses([r.prompt_token_ids for r in requests],
                                     [x.token_ids for x in results],
                                     [x.logprobs for x in results],
                                     group_advantages(rewards, GROUP))
    trainer.train_step(batch)                                            # -> weights v1

    new = {name: t.clone() for name, t in trainer.resharder().named_tensors()}
    synced.update_weights(new.items())
    stale.update_weights({**new, "lm_head.weight": tensors["lm_head.weight"]}.items())
    head_moved = float((new["lm_head.weight"] - tensors["lm_head.weight"]).abs().max())

    requests = _requests(1)                                              # step 1: weights v1
    out = {"step0": step0, "head_moved": head_moved}
    for name, engine in (("synced", synced), ("stale", stale)):
        results = engine.generate(requests, params)
        out[name] = ([x.logprobs for x in results], _megatron_logprobs(trainer, requests, results))
    destroy_distributed()
    return out


@pytest.fixture(scope="module")
def steps(tiny_checkpoint):
    path = tiny_checkpoint("llama", vocab_size=VOCAB)
    return launch_local(_stale_head_worker, 1, path)[0]


@pytest.mark.slow
def test_a_synced_engine_passes(steps):
    assert steps["step0"] < LIMITS["float32"].max_abs / 100
    gap = check_on_policy(*steps["synced"], "float32", step=1, weight_version=1)
    print(f"synced engine: max |gap| {gap:.3g} (step 0: {steps['step0']:.3g})")
    assert gap < LIMITS["float32"].max_abs / 100, gap


@pytest.mark.slow
def test_a_stale_lm_head_fails_the_step_with_what_to_check(steps):
    assert steps["head_moved"] == pytest.approx(LR, rel=0.5)       # one Adam step of the head
    gap = logprob_gap(*steps["stale"])
    print(f"stale LM head after one step at lr {LR}: max |gap| {gap.max_abs:.3g}, "
          f"mean {gap.mean_abs:.3g} over {gap.tokens} tokens")
    with pytest.raises(OffPolicyError) as caught:
        check_on_policy(*steps["stale"], "float32", step=1, weight_version=1)
    message = str(caught.value)
    for needle in ("step 1", "off-policy", "weight version 1", "reshard", "tied LM head",
                   "prefix cache", "weight_version", f"sample {gap.worst_sample}"):
        assert needle in message, (needle, message)


def test_limits_by_dtype():
    engine, megatron = [[-1.0, -2.0], [-0.5]], [[-1.0, -2.0005], [-0.5]]
    assert check_on_policy(engine, megatron, "float32", step=0, weight_version=0) \
        == pytest.approx(5e-4)
    assert check_on_policy(engine, megatron, torch.bfloat16, step=0, weight_version=0) \
        == pytest.approx(5e-4)
    with pytest.raises(OffPolicyError, match="mean"):              # bf16: a shifted mean fails
        check_on_policy([[-1.0] * 10], [[-1.05] * 10], "bfloat16", step=0, weight_version=0)
    with pytest.raises(ValueError, match="differ in shape"):
        check_on_policy([[-1.0]], [[-1.0, -2.0]], "float32", step=0, weight_version=0)
    with pytest.raises(ValueError, match="no on-policy gap limit"):
        check_on_policy([[-1.0]], [[-1.0]], "float16", step=0, weight_version=0)
