"""Reference engine: keyed tokens equal a transformers oracle, continuation and speculative
continuation are exact, step/abort keeps prefixes, update_weights replaces the policy."""

import pytest
import torch

from megatron_bubblespec.models.architecture import (
    load_checkpoint,
    perturb_checkpoint,
)
from megatron_bubblespec.sampling.requests import Proposals, RolloutRequest
from megatron_bubblespec.rollout.reference import ReferenceEngine
from megatron_bubblespec.sampling import SamplingParams, keyed_sample, sample_key
from megatron_bubblespec.speculative.continuation import ContinuationSettings
from megatron_bubblespec.speculative.rules import RuleChoice
from megatron_bubblespec.speculative.pool import DraftPool

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
PARAMS = [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.8, top_k=20, top_p=0.9)]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def qwen2_tied(tiny_checkpoint):
    return tiny_checkpoint("qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def perturbed(checkpoint, tmp_path_factory):
    """The same model with small weight noise: a stand-in for last step's policy."""
    return perturb_checkpoint(checkpoint, tmp_path_factory.mktemp("perturbed"), 0.01)


def _prompts(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _requests(prompts, *, step=1, max_new=NEW_TOKENS, prefixes=None, pools=None):
    """One sample per prompt, keyed by (seed 7, step, prompt index, sample 0)."""
    prefixes = prefixes or [[] for _ in prompts]
    pools = pools or [[] for _ in prompts]
    return [RolloutRequest(f"s{i}", p, sample_key(7, step, i, 0), max_new,
                           response_prefix=list(prefix), proposals=Proposals(pool))
            for i, (p, prefix, pool) in enumerate(zip(prompts, prefixes, pools))]


def _oracle(checkpoint, prompts, keys, params, max_new=NEW_TOKENS):
    """Plain keyed decoding with transformers (its own KV cache), one sequence at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    out = []
    for prompt, key in zip(prompts, keys):
        response, past, feed = [], None, torch.tensor([prompt])
        with torch.no_grad():
            for i in range(max_new):
                step = model(feed, past_key_values=past, use_cache=True)
                past = step.past_key_values
                response.append(int(keyed_sample(step.logits[0, -1:], [key], [i], params)))
                feed = torch.tensor([[response[-1]]])
        out.append(response)
    return out


@pytest.mark.parametrize("arch,params", [("llama", p) for p in PARAMS] + [("qwen2", PARAMS[1])],
                         ids=["llama-greedy", "llama-t1", "llama-topk-topp", "qwen2-tied-t1"])
def test_tokens_equal_transformers_oracle(request, arch, params):
    checkpoint = request.getfixturevalue("checkpoint" if arch == "llama" else "qwen2_tied")
    prompts = _prompts()
    requests = _requests(prompts)
    results = ReferenceEngine(checkpoint).generate(requests, params)
    want = _oracle(checkpoint, prompts, [r.key for r in requests], params)
    for result, expected in zip(results, want):
        assert result.token_ids == expected
        assert result.decode_steps == NEW_TOKENS - 1 and result.finish_reason == "length"
        assert len(result.logprobs) == NEW_TOKENS


def test_continuation_from_a_prefix_is_exact(checkpoint):
    engine, params = ReferenceEngine(checkpoint), SamplingParams(1.0)
    prompts = _prompts(4)
    full = engine.generate(_requests(prompts), params)
    for k in (1, 17, NEW_TOKENS - 1):
        continued = engine.generate(
            _requests(prompts, prefixes=[f.token_ids[:k] for f in full]), params)
        for c, f in zip(continued, full):
            assert c.token_ids == f.token_ids
            assert c.decode_steps == NEW_TOKENS - k - 1
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(f.logprobs),
                                       rtol=0, atol=1e-5)


@pytest.mark.parametrize("params", PARAMS[:2], ids=["greedy", "t1"])
def test_speculative_continuation_is_exact_and_saves_decode_steps(checkpoint, perturbed, params):
    prompts = _prompts(6, seed=3)
    plain = ReferenceEngine(checkpoint).generate(_requests(prompts), params)
    drafts = ReferenceEngine(perturbed).generate(_requests(prompts), params)
    g = torch.Generator().manual_seed(5)
    pools = {
        "perturbed-policy": [[d.token_ids] for d in drafts],
        "truth-with-errors": [[[t if torch.rand(1, generator=g) > 0.1 else 3 for t in p.token_ids]]
                              for p in plain],
        "random": [[torch.randint(3, 256, (NEW_TOKENS,), generator=g).tolist()] for _ in prompts],
    }
    engine = ReferenceEngine(checkpoint, continuation=ContinuationSettings.of(
        "spec.spec_k=6", "spec.min_match=2", "spec.proposal_sources=[bubble,realign]",
        "spec.proposal_token_cost=null"))
    for kind, pool in pools.items():
        results = engine.generate(_requests(prompts, pools=pool), params)
        assert [r.token_ids for r in results] == [p.token_ids for p in plain], kind
        if kind != "random":
            assert sum(r.decode_steps for r in results) < sum(r.decode_steps for r in plain), kind
            assert sum(r.accepted_tokens for r in results) > 0, kind


def test_verify_accepts_the_agreeing_prefix_and_continues_exactly(checkpoint, perturbed):
    engine, params = ReferenceEngine(checkpoint), SamplingParams(1.0)
    prompts = _prompts(6, seed=4)
    plain = engine.generate(_requests(prompts), params)
    drafts = ReferenceEngine(perturbed).generate(_requests(prompts), params)
    for prefix_len in (0, 5):
        requests = _requests(prompts, prefixes=[p.token_ids[:prefix_len] for p in plain])
        own = [p.token_ids[prefix_len:] for p in plain]
        truth = engine.verify(requests, own, params)
        assert truth.accepted.tolist() == [len(o) for o in own]
        verified = engine.verify(requests, [d.token_ids[prefix_len:] for d in drafts], params)
        prefixes = [r.response_prefix + t for r, t in
                    zip(requests, verified.tokens(torch.tensor([d.token_ids[prefix_len:] for d in drafts])))]
        finished = engine.generate(_requests(prompts, prefixes=prefixes), params)
        assert [f.token_ids for f in finished] == [p.token_ids for p in plain]
    assert int(verified.accepted.sum()) > 0


def test_abort_after_n_steps_returns_the_first_n_tokens(checkpoint):
    engine, params = ReferenceEngine(checkpoint), SamplingParams(1.0)
    prompts = _prompts(5)
    full = engine.generate(_requests(prompts), params)
    for n in (1, 9):
        engine.add(_requests(prompts), params)
        for _ in range(n):
            assert engine.step() == []
        partial = engine.abort()
        assert not engine.has_unfinished()
        for p, f in zip(sorted(partial, key=lambda r: r.request_id), full):
            assert p.finish_reason == "aborted" and p.token_ids == f.token_ids[:n]


def test_eos_ends_a_response(checkpoint):
    engine, params = ReferenceEngine(checkpoint), SamplingParams(1.0)
    prompts = _prompts(4)
    full = engine.generate(_requests(prompts), params)
    eos = full[0].token_ids[10]
    stop = full[0].token_ids.index(eos)
    requests = [RolloutRequest(r.request_id, r.prompt_token_ids, r.key, NEW_TOKENS,
                               eos_token_ids=(eos,)) for r in _requests(prompts)]
    result = engine.generate(requests, params)[0]
    assert result.token_ids == full[0].token_ids[:stop + 1] and result.finish_reason == "eos"


def test_update_weights_matches_a_fresh_engine(checkpoint, perturbed):
    params = SamplingParams(1.0)
    prompts = _prompts(4) + [list(range(3, 203))]  # one prompt longer than 128 tokens
    engine = ReferenceEngine(checkpoint)
    before = engine.generate(_requests(prompts, max_new=16), params)
    _, new_tensors = load_checkpoint(perturbed)
    engine.update_weights(new_tensors.items())
    assert engine.weight_version == 1
    after = engine.generate(_requests(prompts, max_new=16), params)
    fresh = ReferenceEngine(perturbed).generate(_requests(prompts, max_new=16), params)
    assert [a.token_ids for a in after] == [f.token_ids for f in fresh]
    for a, f in zip(after, fresh):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(f.logprobs), rtol=0, atol=1e-5)
    assert any(a.logprobs != b.logprobs for a, b in zip(after, before))


def test_update_weights_refuses_while_requests_run(checkpoint):
    engine = ReferenceEngine(checkpoint)
    engine.add(_requests(_prompts(2)), SamplingParams(1.0))
    engine.step()
    with pytest.raises(RuntimeError, match="abort or finish"):
        engine.update_weights([])


@pytest.mark.parametrize("fault", ["missing", "unexpected", "repeated", "misshapen"])
def test_update_weights_is_strict_and_all_or_nothing(checkpoint, perturbed, fault):
    """A weight update that lacks a tensor, brings an unknown one, repeats one or changes a shape
    is refused with the tensor's name, and the engine keeps sampling from its old weights (a
    silently skipped tensor would leave a stale piece of the policy in the oracle)."""
    params, prompts = SamplingParams(1.0), _prompts(2)
    engine = ReferenceEngine(checkpoint)
    before = engine.generate(_requests(prompts, max_new=8), params)
    _, new = load_checkpoint(perturbed)
    pairs = list(new.items())
    victim = "model.layers.1.mlp.up_proj.weight"
    if fault == "missing":
        pairs = [(n, t) for n, t in pairs if n != victim]
        error, name = KeyError, victim
    elif fault == "unexpected":
        pairs.append(("model.layers.9.mlp.up_proj.weight", new[victim]))
        error, name = KeyError, "model.layers.9.mlp.up_proj.weight"
    elif fault == "repeated":
        pairs.append((victim, new[victim]))
        error, name = KeyError, victim
    else:
        pairs = [(n, t[:-1] if n == victim else t) for n, t in pairs]
        error, name = ValueError, victim
    with pytest.raises(error, match=name.replace(".", r"\.")):
        engine.update_weights(pairs)
    assert engine.weight_version == 0
    after = engine.generate(_requests(prompts, max_new=8), params)
    assert [a.logprobs for a in after] == [b.logprobs for b in before]


def test_float64_engine_agrees_with_float32(checkpoint):
    prompts, params = _prompts(4), SamplingParams(1.0)
    r32 = ReferenceEngine(checkpoint).generate(_requests(prompts), params)
    r64 = ReferenceEngine(checkpoint, dtype=torch.float64).generate(_requests(prompts), params)
    assert [r.token_ids for r in r32] == [r.token_ids for r in r64]


def test_draft_pool_proposes_after_the_longest_suffix_match():
    pool = DraftPool([1, 2], [[3, 4, 5, 6, 7], [9, 4, 5, 8, 8]], min_match=2, max_match=4)
    assert pool.propose([1, 2, 3, 4, 5], 2) == ([6, 7], "bubble")   # longest: 3 4 5 in draft 0
    assert pool.propose([0, 9, 4, 5], 3) == ([8, 8], "bubble")      # 9 4 5 in draft 1
    assert pool.propose([7, 4, 5], 1) == ([6], "bubble")            # 4 5: earliest draft wins
    assert pool.propose([5, 9], 2) == ([], None)                    # no match of >= 2 tokens
    assert pool.propose([1, 2], 3) == ([3, 4, 5], "bubble")         # the prompt itself matches
    assert not DraftPool([1], [[]])


@pytest.mark.parametrize("rule", ["residual", "lenient"])
def test_ablation_rules_use_the_drafting_policy(checkpoint, perturbed, rule):
    """The residual and lenient rules read q from the policy before the last update: with q = p
    every draft token passes the ratio test; after an update some are rejected; without the
    previous policy they refuse to run."""
    prompts = _prompts(8, seed=3)
    params = SamplingParams(1.0)
    engine = ReferenceEngine(checkpoint, keep_previous_weights=True)
    drafts = [r.token_ids for r in engine.generate(_requests(prompts, max_new=16), params)]
    requests = _requests(prompts, max_new=16)
    same = engine.verify(requests, drafts, params, rule=RuleChoice(rule))
    assert same.accepted.tolist() == [len(d) for d in drafts]

    _, tensors = load_checkpoint(perturbed)
    engine.update_weights(tensors.items())     # previous_model keeps the drafting policy
    moved = engine.verify(requests, drafts, params, rule=RuleChoice(rule))
    assert moved.accepted.sum() < sum(map(len, drafts))

    with pytest.raises(ValueError, match="keep_previous_weights"):
        ReferenceEngine(checkpoint).verify(requests, drafts, params, rule=RuleChoice(rule))
