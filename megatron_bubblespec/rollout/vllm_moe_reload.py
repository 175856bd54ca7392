"""vLLM 0.32.0 in-place weight reload of a CPU MoE layer -> one patch -> the experts repacked.

vLLM's CPU experts (``CPUUnquantizedExperts``) prepack the expert weights into their grouped-gemm
layout when the model is first loaded. An in-place reload (``reload_weights``, what every weight
update of a rollout engine uses) loads the new weights in checkpoint layout and reruns the MoE
method's ``_setup_kernel``, which skips the prepack on a weight update (it assumes the kernel's
layout is the checkpoint's, as on CUDA), so the checkpoint-layout data is copied into the
prepacked storage: the engine then computes with scrambled experts, and its logprobs move far from
the trainer's after the first update (the on-policy check fails). ``install()`` wraps
``_setup_kernel`` so that a weight update of CPU experts repacks them as the first load did; the
layerwise reload then copies the repacked data into the kernel's storage. No file of vLLM is
edited; other versions are refused by ``vllm_patches.install`` already.
"""

from __future__ import annotations

import functools

_INSTALLED = False


def install() -> None:
    """Apply the patch once per process."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    original = UnquantizedFusedMoEMethod._setup_kernel

    @functools.wraps(original)
    def setup_kernel(self, layer, w13, w2):
        updating = self.moe_kernel is not None
        original(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if updating and isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)

    UnquantizedFusedMoEMethod._setup_kernel = setup_kernel
    _INSTALLED = True
