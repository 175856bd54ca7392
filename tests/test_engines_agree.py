"""The reference engine and the vLLM engine draw the same tokens for the same keys, and the shipped
SmolLM2 runs offline in both with transformers' greedy tokens."""

import pytest
import torch

from megatron_bubblespec.sampling.requests import RolloutRequest
from megatron_bubblespec.rollout.reference import ReferenceEngine
from megatron_bubblespec.sampling import SamplingParams, perturbed_scores, sample_key

pytestmark = pytest.mark.slow   # both tests start a vLLM engine

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def vllm_tiny(tiny):
    from megatron_bubblespec.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(tiny, max_model_len=512)


def _requests(prompts, max_new=NEW_TOKENS, eos=()):
    return [RolloutRequest(f"r{i}", p, sample_key(11, 3, i, 0), max_new, eos_token_ids=eos)
            for i, p in enumerate(prompts)]


def _explain_first_difference(engine, request, a, b, params):
    """Locate the first differing token and the keyed-score margin the reference engine saw there."""
    pos = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    seq = torch.tensor([request.prompt_token_ids + a[:pos]])
    slot = engine.model.cache.acquire()
    logits = engine.model.forward(seq, torch.tensor([slot]), torch.tensor([0]),
                                  torch.tensor([seq.shape[1]]))[0, -1:]
    engine.model.cache.release(slot)
    scores = perturbed_scores(logits, [request.key], [pos], params)[0]
    margin = float(scores[a[pos]] - scores[b[pos]])
    kind = "a NEAR-TIE flipped by float differences" if abs(margin) < 1e-3 else "a REAL mismatch"
    return (f"{request.request_id}: first difference at response position {pos}: reference "
            f"{a[pos]} vs vLLM {b[pos]}, keyed-score margin {margin:.3g} -> {kind}")


@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0)], ids=["greedy", "t1"])
def test_reference_and_vllm_draw_the_same_tokens(tiny, vllm_tiny, params):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 40, (8,), generator=g)]
    reference = ReferenceEngine(tiny)
    ref = reference.generate(_requests(prompts), params)
    got = vllm_tiny.generate(_requests(prompts), params)
    for request, r, v in zip(_requests(prompts), ref, got):
        assert len(r.token_ids) == len(v.token_ids) == NEW_TOKENS
        if r.token_ids != v.token_ids:
            pytest.fail(_explain_first_difference(reference, request, r.token_ids, v.token_ids, params))
        torch.testing.assert_close(torch.tensor(v.logprobs), torch.tensor(r.logprobs),
                                   rtol=0, atol=1e-4)
        assert r.decode_steps == v.decode_steps == NEW_TOKENS - 1


def test_smollm2_offline_in_both_engines_matches_transformers_greedy():
    from transformers import AutoModelForCausalLM

    from megatron_bubblespec.data.gsm8k import load_gsm8k
    from megatron_bubblespec.models.smollm2 import load_tokenizer, smollm2_checkpoint
    from megatron_bubblespec.rollout.vllm_engine import VLLMEngine

    path, tok = smollm2_checkpoint(), load_tokenizer()
    question = load_gsm8k("test")[0].question
    prompt = tok.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               add_generation_prompt=True, return_dict=True)
    prompt = list(prompt["input_ids"])
    n = 12
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):]
    del hf
    request = [RolloutRequest("q0", prompt, sample_key(0, 0, "q0", 0), n)]
    greedy = SamplingParams(0.0)
    assert ReferenceEngine(path, max_model_len=1024).generate(request, greedy)[0].token_ids == want.tolist()
    engine = VLLMEngine(path, max_model_len=1024)
    assert engine.generate(request, greedy)[0].token_ids == want.tolist()
