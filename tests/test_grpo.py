"""GRPO objective and the Megatron learner.

* Pure torch: group advantages (GRPO and Dr. GRPO), the clipped surrogate (zero gradient on the
  clipped side only), token-level mean over the global batch (pieces normalised by the global
  count add up), KL k3 (>= 0, zero at equal policies).
* One GRPO step on a FIXED batch from a tiny HF Llama (4 layers, vocabulary 250: Megatron pads it to
  256): the single-process run's logprobs equal transformers', its loss and metrics equal the
  pure-torch ones on them, and its grad norm equals that of the token-mean loss in transformers;
  TP=2, PP=2, DP=2 (plain and distributed optimizer) and TP=2 x PP=2, with other micro-batch
  counts, give the same loss, metrics, grad norm and updated HF weights (resharded after the step)
  as the single-process run.
* Weight sync: the stepped weights pushed into a vLLM engine give the trainer's per-token logprobs
  on a probe batch (``sync/logprob_abs_diff``), and an engine left on the old weights does not.

Weight tolerance. Adam's first step is ``-lr * g / (|g| + eps)`` per element (the bias-corrected
moments are g and g^2), i.e. about ``lr * sign(g)``, whatever the scale of g. Two parallel layouts
sum the same gradient in different orders, so g differs by fp32 round-off delta, and the update by
up to ``lr * delta / eps`` where the gradient is near zero: with the default eps = 1e-8 round-off
becomes a visible part of the step (measured on this batch: 1.3e-4 = 13 % of a step at TP=2).
The test therefore uses eps = 1e-4 (sensitivity lr / eps = 10; measured max |w - w_ref| <= 1.8e-7
in every layout) and compares the updated weights with an absolute tolerance of
1e-5 = 1 % of one step (lr = 1e-3), after checking that the step itself is ~lr. The loss agrees to
1e-5 absolute (measured <= 5e-8), and the grad norm, which exposes any gradient-scaling error that
Adam's scale invariance hides from the weights, to 1e-5 relative.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from megatron_bubblespec.distributed import destroy_distributed, init_distributed, megatron_cpu_mode
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.models.architecture import load_checkpoint
from megatron_bubblespec.train.grpo import (
    GRPOConfig,
    clipped_policy_loss,
    group_advantages,
    grpo_loss,
    kl_k3,
    token_mean,
)
from megatron_bubblespec.train.onpolicy import logprob_gap
from megatron_bubblespec.train.batch import (GRPOBatch, gather_responses, pack_sequences,
                                              scatter_responses)
from megatron_bubblespec.train.trainer import MegatronTrainer, TrainerConfig

VOCAB = 250                  # not a multiple of 128: Megatron's vocabulary padding is exercised
GROUP = 4
LR = 1e-3
GRPO = GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05)
TRAIN = TrainerConfig(lr=LR, adam_eps=1e-4, weight_decay=0.1, clip_grad=1.0, micro_batch_size=2,
                      grpo=GRPO)
LOSS_ATOL = 1e-5
GRAD_NORM_RTOL = 1e-5
WEIGHT_ATOL = 1e-5
HF_LOGPROB_ATOL = 1e-5       # Megatron vs transformers forward, float32
SYNC_LOGPROB_ATOL = 1e-4     # vLLM vs Megatron forward, float32


# ------------------------------------------------------------------------- pure-torch objective

def _max_gap(a, b):
    return logprob_gap(a, b).max_abs


def test_group_advantages_grpo_and_dr_grpo():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    adv = group_advantages(rewards, 4)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()
    torch.testing.assert_close(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert torch.equal(adv[4:], torch.zeros(4))  # all-equal group: zero, not NaN
    dr = group_advantages(rewards, 4, scale_by_std=False)
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]))
    for group in (adv.view(2, 4), dr.view(2, 4)):
        torch.testing.assert_close(group.sum(1), torch.zeros(2), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, 3)


def _ratio_grad(ratio: float, advantage: float, low=0.2, high=0.28) -> float:
    logp = torch.tensor([[torch.log(torch.tensor(ratio)).item()]], requires_grad=True)
    loss, _ = clipped_policy_loss(logp, torch.zeros(1, 1), torch.tensor([advantage]), low, high)
    loss.sum().backward()
    return logp.grad.item()


@pytest.mark.parametrize("ratio,advantage,clipped", [
    (1.5, 1.0, True),     # above 1 + eps_high, pushed further up: clipped
    (0.5, -1.0, True),    # below 1 - eps_low, pushed further down: clipped
    (1.5, -1.0, False),   # outside, but the gradient moves it back: unclipped side
    (0.5, 1.0, False),
    (1.1, 1.0, False),    # inside the range
    (1.25, 1.0, False),   # inside only thanks to clip-higher (eps_high = 0.28)
])
def test_clipping_zeroes_the_gradient_on_the_clipped_side(ratio, advantage, clipped):
    grad = _ratio_grad(ratio, advantage)
    if clipped:
        assert grad == 0.0
    else:  # d(-ratio * A)/d logp = -ratio * A
        assert grad == pytest.approx(-ratio * advantage, rel=1e-6)
    _, was_clipped = clipped_policy_loss(torch.log(torch.tensor([[ratio]])), torch.zeros(1, 1),
                                         torch.tensor([advantage]), 0.2, 0.28)
    assert bool(was_clipped.item()) == clipped


def test_token_level_mean_over_the_global_batch():
    """Long responses weigh more than short ones, and pieces normalised by the global token count
    (micro-batches, data-parallel ranks) add up to the whole batch's loss and metrics."""
    g = torch.Generator().manual_seed(0)
    lengths = [1, 7, 3, 5]
    mask = torch.zeros(4, 8)
    for i, n in enumerate(lengths):
        mask[i, 1:1 + n] = 1
    logp, old, ref = (-2 + 0.3 * torch.randn(4, 8, generator=g) for _ in range(3))
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0])
    entropy = torch.rand(4, 8, generator=g)
    loss, metrics = grpo_loss(logp, old, adv, mask, GRPO, ref_logp=ref, entropy=entropy)
    per_token, _ = clipped_policy_loss(logp, old, adv, GRPO.clip_eps_low, GRPO.clip_eps_high)
    per_token = per_token + GRPO.kl_coef * kl_k3(logp, ref)
    want = sum(per_token[i, 1:1 + n].sum() for i, n in enumerate(lengths)) / sum(lengths)
    torch.testing.assert_close(loss, want)
    seq_mean = sum(per_token[i, 1:1 + n].mean() for i, n in enumerate(lengths)) / 4
    assert abs(loss - seq_mean) > 1e-3  # differs from a mean of per-sequence means
    assert metrics["train/num_tokens"] == sum(lengths)
    assert set(metrics) >= {"train/loss", "train/kl", "train/clip_frac", "train/entropy"}
    torch.testing.assert_close(metrics["train/entropy"], token_mean(entropy, mask))
    pieces = [grpo_loss(logp[s], old[s], adv[s], mask[s], GRPO, ref_logp=ref[s],
                        entropy=entropy[s], num_tokens=sum(lengths))
              for s in (slice(0, 1), slice(1, 3), slice(3, 4))]
    torch.testing.assert_close(sum(p[0] for p in pieces), loss)
    for name in ("train/kl", "train/clip_frac", "train/entropy", "train/pg_loss"):
        torch.testing.assert_close(sum(p[1][name] for p in pieces), metrics[name])


def test_kl_k3_is_nonnegative_and_zero_at_equal_policies():
    g = torch.Generator().manual_seed(1)
    logp, ref = -5 * torch.rand(1000, generator=g), -5 * torch.rand(1000, generator=g)
    assert (kl_k3(logp, ref) >= 0).all()
    assert torch.equal(kl_k3(logp, logp), torch.zeros(1000))
    mask = torch.ones(2, 3)
    _, metrics = grpo_loss(logp[:6].view(2, 3), logp[:6].view(2, 3), torch.ones(2), mask, GRPO,
                           ref_logp=logp[:6].view(2, 3))
    assert metrics["train/kl"] == 0 and metrics["train/clip_frac"] == 0
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp[:6].view(2, 3), logp[:6].view(2, 3), torch.ones(2), mask, GRPO)


def test_truncated_importance_sampling_weighs_tokens_by_trainer_over_engine():
    """Off by default (the engine's logprobs are not read); with a cap, each token's policy loss
    is weighted by min(exp(old - engine), cap), and the weight carries no gradient."""
    g = torch.Generator().manual_seed(2)
    mask = torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 0]])
    old = -2 + 0.1 * torch.randn(2, 4, generator=g)
    engine = old - torch.tensor([[0.0, 0.5, -0.5, 3.0], [0, 0.0, 1.0, 0]])
    adv = torch.tensor([1.0, -1.0])
    logp = old.clone().requires_grad_()
    plain, metrics = grpo_loss(logp, old, adv, mask, replace(GRPO, kl_coef=0.0), engine_logp=engine)
    assert "train/tis_weight_mean" not in metrics
    weighted, metrics = grpo_loss(logp, old, adv, mask, replace(GRPO, kl_coef=0.0, tis_cap=2.0),
                                  engine_logp=engine)
    weight = torch.exp(old - engine).clamp(max=2.0)
    assert weight[0, 3] == 2.0 and weight[0, 2] < 1   # one capped, one below 1
    per_token, _ = clipped_policy_loss(logp, old, adv, GRPO.clip_eps_low, GRPO.clip_eps_high)
    torch.testing.assert_close(weighted, (per_token * weight * mask).sum() / mask.sum())
    torch.testing.assert_close(metrics["train/tis_weight_mean"], token_mean(weight, mask))
    assert not torch.allclose(weighted, plain)
    weighted.backward()   # d/dlogp of -ratio * A * w at ratio 1: -A * w / tokens
    want = -(adv[:, None] * weight * mask) / mask.sum()
    torch.testing.assert_close(logp.grad, want)
    with pytest.raises(ValueError, match="engine_logp"):
        grpo_loss(logp, old, adv, mask, replace(GRPO, tis_cap=2.0), ref_logp=old)
    with pytest.raises(ValueError, match="tis_cap"):
        GRPOConfig(tis_cap=-1.0)


def test_batch_packing_and_logprob_gap():
    tokens, mask = pack_sequences([[5, 6], [7]], [[8, 9, 10], [11]])
    assert tokens.tolist() == [[5, 6, 8, 9, 10], [7, 11, 0, 0, 0]]
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    values = [[-1.0, -2.0, -3.0], [-4.0]]
    assert gather_responses(scatter_responses(values, mask), mask) == values
    batch = GRPOBatch.from_responses([[5, 6], [7]], [[8, 9, 10], [11]], values, [1.0, -1.0])
    assert torch.equal(batch.tokens, tokens) and len(batch.dp_shard(1, 2)) == 1
    # the engine's logprobs ride along; the old ones come from the trainer's own forward
    assert batch.old_logprobs is None
    assert gather_responses(batch.engine_logprobs, mask) == values
    assert batch.padded_to(7).engine_logprobs.shape == (2, 7) and batch.rows(slice(1, 2)).old_logprobs is None
    assert _max_gap(values, [[-1.0, -2.5, -3.0], [-3.75]]) == 0.5
    with pytest.raises(ValueError, match="differ in shape"):
        _max_gap(values, [[-1.0], [-4.0]])


# -------------------------------------------------------------------- one step, any layout

@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama", vocab_size=VOCAB, num_layers=4)


def _hf_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(model(tokens).logits[:, :-1].float(), dim=-1)
    return torch.nn.functional.pad(logp.gather(-1, tokens[:, 1:, None])[..., 0], (1, 0))


def _hf_grad_norm(model, batch: GRPOBatch) -> float:
    """Norm of the gradient of the token-mean GRPO loss over the whole batch, in transformers."""
    model.zero_grad()
    loss, _ = grpo_loss(_hf_logprobs(model, batch.tokens), batch.old_logprobs, batch.advantages,
                        batch.response_mask, GRPO, ref_logp=batch.ref_logprobs)
    loss.backward()
    return float(torch.stack([p.grad.norm() for p in model.parameters()]).norm())


def _sequences(seed, prompt_lengths, response_lengths):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in prompt_lengths]
    responses = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in response_lengths]
    return prompts, responses


@pytest.fixture(scope="module")
def batch(checkpoint):
    """2 prompts x 4 samples; the data-parallel halves hold 21 and 18 response tokens, and
    micro-batches of 2 hold 9, 12, 11 and 7 (so any per-piece averaging would show). Also
    transformers' logprobs and the gradient norm of the token-mean loss."""
    from transformers import AutoModelForCausalLM

    prompts, responses = _sequences(0, [4, 4, 4, 4, 6, 6, 6, 6], [2, 7, 5, 7, 9, 2, 4, 3])
    prompts = prompts[:1] * GROUP + prompts[GROUP:GROUP + 1] * GROUP
    tokens, mask = pack_sequences(prompts, responses)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        logp = _hf_logprobs(model, tokens) * mask
        dist = torch.log_softmax(model(tokens).logits[:, :-1], dim=-1)
        entropy = torch.nn.functional.pad(-(dist.exp() * dist).sum(-1), (1, 0))
    g = torch.Generator().manual_seed(1)
    old = (logp + 0.3 * torch.randn(mask.shape, generator=g)) * mask  # ratios beyond both clips
    ref = (logp + 0.2 * torch.randn(mask.shape, generator=g)) * mask
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 1.0, 0.0, 0.0])
    data = GRPOBatch(tokens, mask, old, group_advantages(rewards, GROUP), ref)
    return SimpleNamespace(data=data, logp=logp, grad_norm=_hf_grad_norm(model, data),
                           entropy=float(token_mean(entropy, mask)))


@pytest.fixture(scope="module")
def probe():
    return _sequences(2, [3, 8, 5, 12], [16, 9, 20, 4])


def _reference_worker(checkpoint, batch, probe, with_engine):
    """TP=1, one process: logprobs before the step, the step, the probe gap after it."""
    init_distributed(1, 1, seed=7)
    trainer = _trainer(checkpoint)
    before = trainer.logprobs(batch.tokens, batch.response_mask)
    metrics = trainer.train_step(batch).metrics
    weights = dict(trainer.resharder().named_tensors())
    probe_tokens, probe_mask = pack_sequences(*probe)
    mine = gather_responses(trainer.logprobs(probe_tokens, probe_mask), probe_mask)
    destroy_distributed()  # the in-process engine below starts its own one-rank world
    sync = _engine_gap(checkpoint, weights, probe, mine) if with_engine else None
    return before, metrics, weights, sync


def _engine_gap(checkpoint, weights, probe, mine):
    from megatron_bubblespec.sampling.requests import RolloutRequest
    from megatron_bubblespec.rollout.vllm_engine import VLLMEngine
    from megatron_bubblespec.sampling import SamplingParams

    engine = VLLMEngine(checkpoint, max_model_len=64, kv_cache_memory_bytes=16 << 20)

    def score():  # the whole response is a fixed prefix: logprobs without generating
        requests = [RolloutRequest(f"probe-{i}", prompt, key=0, max_new_tokens=len(response),
                                   response_prefix=response)
                    for i, (prompt, response) in enumerate(zip(*probe))]
        return [r.logprobs for r in engine.generate(requests, SamplingParams(1.0))]

    stale = _max_gap(mine, score())
    engine.update_weights(weights.items())
    return {"stale": stale, "synced": _max_gap(mine, score())}


def _trainer(checkpoint, config=TRAIN):
    from megatron_bubblespec.train.model import build_gpt_model
    from megatron_bubblespec.train.sharding import load_hf_weights

    arch, tensors = load_checkpoint(checkpoint)
    with megatron_cpu_mode():
        model = build_gpt_model(arch)
        load_hf_weights(model, arch, tensors)
    return MegatronTrainer(model, arch, config)


def _parallel_worker(checkpoint, batch, tp, pp, micro_batch_size, distributed_optimizer):
    from megatron.core import parallel_state as ps

    init_distributed(tp, pp, seed=11)
    trainer = _trainer(checkpoint, replace(TRAIN, micro_batch_size=micro_batch_size,
                                           use_distributed_optimizer=distributed_optimizer))
    metrics = trainer.train_step(batch.dp_shard(ps.get_data_parallel_rank(),
                                                ps.get_data_parallel_world_size())).metrics
    weights = dict(trainer.resharder().named_tensors())
    destroy_distributed()
    return metrics, weights


@pytest.fixture(scope="module")
def reference(checkpoint, batch, probe):
    with_engine = importlib.util.find_spec("vllm") is not None
    return launch_local(_reference_worker, 1, checkpoint, batch.data, probe, with_engine)[0]


@pytest.mark.slow
def test_single_process_step_matches_pure_torch(reference, batch, checkpoint):
    before, metrics, weights, _ = reference
    data = batch.data
    torch.testing.assert_close(before, batch.logp, rtol=0, atol=HF_LOGPROB_ATOL)
    _, want = grpo_loss(batch.logp, data.old_logprobs, data.advantages, data.response_mask, GRPO,
                        ref_logp=data.ref_logprobs)
    for name in ("train/loss", "train/pg_loss", "train/kl", "train/clip_frac"):
        assert metrics[name] == pytest.approx(float(want[name]), abs=LOSS_ATOL), name
    assert metrics["train/entropy"] == pytest.approx(batch.entropy, abs=LOSS_ATOL)
    assert metrics["train/num_tokens"] == data.response_mask.sum()
    assert 0 < metrics["train/clip_frac"] < 1
    # the gradient is that of the token mean over the whole batch (not, e.g., a mean of
    # micro-batch means), and large enough for clipping to act
    assert metrics["train/grad_norm"] == pytest.approx(batch.grad_norm, rel=GRAD_NORM_RTOL)
    assert metrics["train/grad_norm"] > TRAIN.clip_grad
    _, initial = load_checkpoint(checkpoint)
    step = max(float((weights[k] - initial[k]).abs().max()) for k in initial)
    assert 0.5 * LR < step < 1.5 * LR


# micro-batch counts per rank differ from the reference's 4 (micro-batch size 2) on purpose
@pytest.mark.parametrize("tp,pp,dp,micro_batch_size,distributed_optimizer", [
    (2, 1, 1, 4, False), (1, 2, 1, 1, False), (1, 1, 2, 1, False), (1, 1, 2, 2, True),
    (2, 2, 1, 2, False)], ids=["tp2", "pp2", "dp2", "dp2-distopt", "tp2xpp2"])
@pytest.mark.slow
def test_parallel_step_matches_single_process(reference, checkpoint, batch, tp, pp, dp,
                                              micro_batch_size, distributed_optimizer):
    _, ref_metrics, ref_weights, _ = reference
    results = launch_local(_parallel_worker, tp * pp * dp, checkpoint, batch.data, tp, pp,
                           micro_batch_size, distributed_optimizer)
    loss_gap = max(abs(m["train/loss"] - ref_metrics["train/loss"]) for m, _ in results)
    weight_gap = max(float((w[k] - t).abs().max())
                     for _, w in results for k, t in ref_weights.items())
    print(f"tp{tp} pp{pp} dp{dp}: |loss - ref| = {loss_gap:.1e}, max |w - ref| = {weight_gap:.1e}")
    for metrics, weights in results:  # every rank reports the metrics and holds the weights
        for name in ("train/loss", "train/kl", "train/clip_frac", "train/entropy"):
            assert metrics[name] == pytest.approx(ref_metrics[name], abs=LOSS_ATOL), name
        assert metrics["train/grad_norm"] == pytest.approx(ref_metrics["train/grad_norm"],
                                                           rel=GRAD_NORM_RTOL)
        assert metrics["train/num_tokens"] == ref_metrics["train/num_tokens"]
        assert set(weights) == set(ref_weights)
        for name, tensor in ref_weights.items():
            torch.testing.assert_close(weights[name], tensor, rtol=0, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.slow
def test_engine_logprobs_match_trainer_after_step(reference):
    sync = reference[3]
    if sync is None:
        pytest.skip("vllm is not installed")
    print(f"sync/logprob_abs_diff = {sync['synced']:.3e} (stale engine: {sync['stale']:.3e})")
    assert sync["synced"] <= SYNC_LOGPROB_ATOL
    assert sync["stale"] > 100 * SYNC_LOGPROB_ATOL  # the check sees a missed update


def _bf16_worker(checkpoint, batch):
    from megatron_bubblespec.train.model import build_gpt_model
    from megatron_bubblespec.train.sharding import load_hf_weights

    init_distributed(1, 1, seed=7)
    arch, tensors = load_checkpoint(checkpoint)
    with megatron_cpu_mode():
        model = build_gpt_model(arch, params_dtype=torch.bfloat16)
        load_hf_weights(model, arch, tensors)
    trainer = MegatronTrainer(model, arch, TRAIN)
    before = trainer.logprobs(batch.tokens, batch.response_mask)
    metrics = trainer.train_step(batch).metrics
    weights = {k: t.float() for k, t in trainer.resharder().named_tensors()}
    dtypes = {t.dtype for t in model.parameters()}
    destroy_distributed()
    return before, metrics, weights, dtypes


@pytest.mark.slow
def test_bf16_step_tracks_the_float32_step(reference, checkpoint, batch):
    """bfloat16 weights with fp32 master weights (Megatron's Float16Module + mixed-precision
    Adam): logprobs agree with float32 to bf16 precision, and every weight matrix moves in the
    float32 step's direction by about its size."""
    ref_before, ref_metrics, ref_weights, _ = reference
    before, metrics, weights, dtypes = launch_local(_bf16_worker, 1, checkpoint, batch.data)[0]
    assert dtypes == {torch.bfloat16}
    assert float((before - ref_before).abs().max()) < 0.1          # bf16 has 8 mantissa bits
    assert metrics["train/loss"] == pytest.approx(ref_metrics["train/loss"], abs=2e-2)
    _, initial = load_checkpoint(checkpoint)
    matrices = [name for name, tensor in ref_weights.items() if tensor.dim() == 2]
    assert len(matrices) > 0.5 * len(ref_weights)
    for name in matrices:
        start = initial[name].to(torch.bfloat16).float()    # what the bf16 model starts from
        moved = (weights[name] - start).flatten()
        wanted = (ref_weights[name] - initial[name]).flatten()
        cosine = float(torch.nn.functional.cosine_similarity(moved, wanted, dim=0))
        size = float(moved.norm() / wanted.norm())
        # Measured: cosine 0.93-0.97, size 1.03-1.09 (bf16 rounds each weight's new value).
        assert cosine > 0.85 and 0.8 < size < 1.25, (name, cosine, size)
    # The norm weights (about 1.0, where bf16's step is 2**-7) cannot show a ~LR update in one
    # step: it is kept in the fp32 master weights, the bf16 copy moves once it adds up.


def _step_logprobs_worker(checkpoint, batch, pp):
    init_distributed(1, pp, seed=7)
    trainer = _trainer(checkpoint, replace(TRAIN, micro_batch_size=2))
    before = trainer.logprobs(batch.tokens, batch.response_mask)
    last = trainer.train_step(batch).logprobs
    destroy_distributed()
    return before, last


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2])
def test_train_step_reports_the_logprobs_before_its_update(checkpoint, batch, pp):
    """The step's own forward gives the rollout logprobs under the old weights (what the loop's
    engine-vs-Megatron check reads), on every pipeline stage."""
    for before, last in launch_local(_step_logprobs_worker, pp, checkpoint, batch.data, pp):
        torch.testing.assert_close(last, before, rtol=0, atol=1e-6)


def _temperature_worker(checkpoint, batch, pp, temperatures):
    """Per temperature T, a trainer whose rollouts were drawn at T: its logprobs (tempered and
    raw) and one step's, on a batch without old logprobs (the loop's)."""
    init_distributed(1, pp, seed=7)
    out = {}
    for temperature in temperatures:
        trainer = _trainer(checkpoint, replace(TRAIN, micro_batch_size=2, temperature=temperature,
                                               grpo=replace(GRPO, kl_coef=0.0)))
        data = replace(batch, old_logprobs=None, ref_logprobs=None)
        tempered = trainer.logprobs(data.tokens, data.response_mask)
        raw = trainer.logprobs(data.tokens, data.response_mask, raw=True)
        step = trainer.train_step(data)
        out[temperature] = (tempered, raw, step)
    destroy_distributed()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2])
def test_the_learner_scores_the_distribution_the_rollout_samples(checkpoint, batch, pp):
    """At rollout temperature T the policy is softmax(logits / T): the learner's logprobs, the
    step's own ones and its entropy are of it (computed here independently in transformers);
    the raw ones (T = 1, what engines report for the on-policy check) are the logits' own; and
    with the old logprobs from the step's own forward, the ratio is exactly 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokens, mask = batch.data.tokens, batch.data.response_mask
    with torch.no_grad():
        logits = model(tokens).logits[:, :-1].float()
    temperatures = (0.5, 0.7)
    for out in launch_local(_temperature_worker, pp, checkpoint, batch.data, pp, temperatures):
        for temperature, (tempered, raw, step) in out.items():
            dist = torch.log_softmax(logits / temperature, dim=-1)
            want = torch.nn.functional.pad(dist.gather(-1, tokens[:, 1:, None])[..., 0],
                                           (1, 0)) * mask
            entropy = torch.nn.functional.pad(-(dist.exp() * dist).sum(-1), (1, 0))
            for got in (tempered, step.logprobs):
                torch.testing.assert_close(got, want, rtol=0, atol=HF_LOGPROB_ATOL)
            torch.testing.assert_close(raw, batch.logp, rtol=0, atol=HF_LOGPROB_ATOL)
            torch.testing.assert_close(step.raw_logprobs, raw, rtol=0, atol=1e-6)
            assert float((want - batch.logp).abs().max()) > 0.1   # T matters on this batch
            assert step.metrics["train/entropy"] == pytest.approx(
                float(token_mean(entropy, mask)), abs=LOSS_ATOL)
            assert step.metrics["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
            assert step.metrics["train/clip_frac"] == 0.0


def _kl_worker(checkpoint, batch, kl_coef, steps):
    """``steps`` steps on the same batch (without its own ref_logprobs); per step: metrics and
    the batch's logprobs after it. Also the reference's logprobs at the end."""
    init_distributed(1, 1, seed=7)
    trainer = _trainer(checkpoint, replace(TRAIN, grpo=replace(GRPO, kl_coef=kl_coef)))
    batch = replace(batch, ref_logprobs=None)
    initial = trainer.logprobs(batch.tokens, batch.response_mask)
    metrics, after = [], []
    for _ in range(steps):
        metrics.append(trainer.train_step(batch).metrics)
        after.append(trainer.logprobs(batch.tokens, batch.response_mask))
    weights = {k: t.clone() for k, t in trainer.resharder().named_tensors()}
    reference = None if trainer.reference is None else \
        trainer.reference_logprobs(batch.tokens, batch.response_mask)
    destroy_distributed()
    return initial, metrics, after, weights, reference


@pytest.mark.slow
def test_kl_penalty_pulls_towards_the_frozen_initial_policy(checkpoint, batch):
    """kl_coef > 0: the reference is the initial policy, frozen (its logprobs never move); the
    first step equals the kl_coef = 0 step bitwise (k3 and its gradient vanish where the policies
    agree); later steps stay closer to the reference than without the penalty."""
    steps = 4
    free = launch_local(_kl_worker, 1, checkpoint, batch.data, 0.0, steps)[0]
    tied = launch_local(_kl_worker, 1, checkpoint, batch.data, 1.0, steps)[0]
    initial, free_metrics, free_after, _, no_reference = free
    _, tied_metrics, tied_after, _, reference = tied
    assert no_reference is None and "train/kl" not in free_metrics[0]
    assert torch.equal(reference, initial)                         # frozen, the initial policy
    assert tied_metrics[0]["train/kl"] == 0.0
    assert torch.equal(tied_after[0], free_after[0])               # step 1: same update
    mask = batch.data.response_mask

    def kl_to_reference(logp):
        return float(token_mean(kl_k3(logp, initial), mask))

    assert all(m["train/kl"] > 0 for m in tied_metrics[1:])
    assert tied_metrics[1]["train/kl"] == pytest.approx(kl_to_reference(tied_after[0]), rel=1e-4)
    free_kl = [kl_to_reference(logp) for logp in free_after]
    tied_kl = [kl_to_reference(logp) for logp in tied_after]
    assert tied_kl[-1] < 0.9 * free_kl[-1], (tied_kl, free_kl)


def _entropy_worker(tp: int):
    from megatron.core import parallel_state as ps

    from megatron_bubblespec.train.logprobs import ENTROPY_CHUNK, _entropy

    init_distributed(tp, 1, seed=5)
    full = torch.randn(2, 2 * ENTROPY_CHUNK + 7, 40, generator=torch.Generator().manual_seed(1))
    shard = full.chunk(tp, dim=-1)[ps.get_tensor_model_parallel_rank()]
    entropy = _entropy(shard)
    destroy_distributed()
    return entropy, torch.distributions.Categorical(logits=full).entropy()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_the_entropy_metric_over_chunks_and_vocab_shards(tp):
    """train.logprobs._entropy, a chunk of positions at a time over a vocabulary split by TP, is
    the entropy of the whole distribution at every position."""
    for entropy, expected in launch_local(_entropy_worker, tp, tp):
        torch.testing.assert_close(entropy, expected, rtol=1e-5, atol=1e-5)
