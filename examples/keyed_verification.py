"""Keyed sampling and exact draft verification in one page.

A toy policy (prefix -> logits) decodes a response with the keyed sampler. A slightly different
policy drafts the same sample with the same key, as a fast rank does in the bubble with last
step's weights. One verification pass by the real policy keeps the draft's agreeing prefix plus
the real policy's own next token, and decoding then continues: the response is token-identical to
plain decoding, in fewer sequential target forwards.

    python examples/keyed_verification.py
"""

import torch

from megatron_bubblespec.sampling import SamplingParams, keyed_sample, sample_key
from megatron_bubblespec.speculative import verify_keyed

VOCAB, EOS, MAX_NEW = 16, 0, 48
PARAMS = SamplingParams(temperature=1.0)


def make_policy(noise_seed: int | None = None, noise: float = 0.1):
    """A deterministic prefix -> logits function (the last two tokens index a random table)."""
    table = torch.randn(VOCAB * VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)) * 2.0
    table[:, EOS] -= 6.0  # responses of a few dozen tokens
    if noise_seed is not None:
        table += noise * torch.randn(table.shape, generator=torch.Generator().manual_seed(noise_seed))
    return lambda prefix: table[prefix[-2] * VOCAB + prefix[-1]]


def decode(policy, prompt, key, response=()):
    """Plain keyed decoding from an already-fixed response prefix: one forward per token.

    Keyed noise is indexed by absolute response position, so continuing from a prefix gives the
    same tokens as decoding from scratch."""
    response, forwards = list(response), 0
    while len(response) < MAX_NEW and (not response or response[-1] != EOS):
        logits = policy(prompt + response).unsqueeze(0)
        response.append(int(keyed_sample(logits, [key], [len(response)], PARAMS)))
        forwards += 1
    return response, forwards


def verify(policy, prompt, key, draft):
    """One verification pass (one batched forward in a real engine) over the whole draft."""
    logits = torch.stack([policy(prompt + draft[:j]) for j in range(len(draft) + 1)])
    result = verify_keyed(logits[None], torch.tensor([draft]), torch.tensor([len(draft)]),
                          torch.tensor([key]), torch.tensor([0]), PARAMS, eos_token_ids=[EOS])
    return result.tokens(torch.tensor([draft]))[0], int(result.accepted)


if __name__ == "__main__":
    prompt = [3, 7]
    key = sample_key(seed=1, step=2, prompt_uid="example-0", sample_index=0)
    target, old_policy = make_policy(), make_policy(noise_seed=1)

    plain, plain_forwards = decode(target, prompt, key)
    draft, _ = decode(old_policy, prompt, key)          # drafted in the bubble of the step before
    verified, accepted = verify(target, prompt, key, draft)
    response, rest_forwards = decode(target, prompt, key, verified)

    print(f"plain decoding : {len(plain)} tokens in {plain_forwards} sequential forwards")
    print(f"draft          : {len(draft)} tokens, {accepted} accepted")
    print(f"BubbleSpec     : {len(response)} tokens in 1 verify pass + {rest_forwards} forwards")
    assert response == plain, "verification changed a token"
    print("identical to plain decoding: True")
