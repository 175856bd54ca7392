"""Requests + drafts -> one forward of the policy over prompt + prefix + draft -> a Verdict.

The reference engine's verification before the rollout (``spec.verifier: engine``,
``speculative.EngineVerifier``), under any rule of ``speculative.rules``. The keyed rule is exact
and token-identical to plain keyed decoding; the rules that read the drafts' distributions take them
from the drafting policy, the weights before the latest update.
"""

from __future__ import annotations

import torch

from megatron_bubblespec.rollout.torch_llama import TorchLlama
from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.sampling.requests import RolloutRequest
from megatron_bubblespec.speculative.rules import KEYED, RuleChoice
from megatron_bubblespec.speculative.verify import draft_words, target_probs
from megatron_bubblespec.tokens import pad_token_rows


@torch.no_grad()
def verify_with_model(model: TorchLlama, drafting_model: TorchLlama | None,
                  requests: list[RolloutRequest], drafts: list[list[int]],
                  params: SamplingParams, rule: RuleChoice = KEYED):
    """``speculative.Verdict`` of ``drafts`` (response positions after each request's prefix)
    under ``rule``; ``drafting_model``: the policy that drafted them (None: only rules that do
    not read the drafts' distributions)."""
    eos = [r.eos_token_ids for r in requests]   # each sample settles on its own EOS ids
    target = draft_logits(model, requests, drafts)
    draft_tokens, draft_lens = pad_token_rows(drafts)
    keys = torch.tensor([r.key for r in requests])
    words = draft_words(params, requests, drafts, draft_tokens.shape[1] + 1)
    q = None
    if rule.rule.reads_draft_probs:
        if drafting_model is None:
            raise ValueError(f"rule {rule.name!r} needs the drafting policy's distributions: "
                             "build the engine with keep_previous_weights=True")
        q = target_probs(draft_logits(drafting_model, requests, drafts)[:, :-1], params)
    return rule.settle(target, q, draft_tokens, draft_lens, keys, words, params, eos)


def draft_logits(model: TorchLlama, requests: list[RolloutRequest],
                 drafts: list[list[int]]) -> torch.Tensor:
    """Logits [B, L + 1, V] of ``model`` at the last prefix position and every draft
    position (they predict response positions len(prefix) ... len(prefix) + L)."""
    slots = [model.cache.acquire() for _ in requests]
    try:
        rows = [r.prompt_token_ids + r.response_prefix + d for r, d in zip(requests, drafts)]
        tokens, lengths = pad_token_rows(rows)
        logits = model.forward(tokens, torch.tensor(slots), torch.zeros_like(lengths), lengths)
    finally:
        for slot in slots:
            model.cache.release(slot)
    width = max(len(d) for d in drafts) + 1
    starts = torch.tensor([len(r.prompt_token_ids) + len(r.response_prefix) - 1
                           for r in requests])
    index = (starts.view(-1, 1) + torch.arange(width)).clamp(max=tokens.shape[1] - 1)
    return logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
