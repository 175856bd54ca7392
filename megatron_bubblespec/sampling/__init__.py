"""Keyed sampling: (logits, sample key, position) -> token; the one sampler of every engine and verifier."""

from megatron_bubblespec.sampling.keyed import (
    SamplingParams,
    gumbel_noise,
    keyed_sample,
    mix32,
    noise_bits,
    perturbed_scores,
    sample_key,
    truncation_mask,
    uniform_noise,
)

__all__ = [
    "SamplingParams", "gumbel_noise", "keyed_sample", "mix32", "noise_bits", "perturbed_scores",
    "sample_key", "truncation_mask", "uniform_noise",
]
