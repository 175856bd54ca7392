"""SmolLM2 in Megatron, one sequence of --tokens random tokens -> one forward and backward with
Megatron's local core attention, then with ``train.attention.FusedCoreAttention`` -> the peak
resident memory each adds, its time, and the largest difference of their last positions' logits
(docs/results/memory.md).

    LD_PRELOAD=.venv/lib/libtcmalloc_minimal.so.4 .venv/bin/python scripts/attention_memory.py \\
        --tokens 1200
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_bubblespec.distributed.launch import launch_local


def _peak_gb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1e6
    raise RuntimeError("no VmHWM in /proc/self/status")


def _worker(fused: bool, tokens: int):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_bubblespec.distributed.cpu_compat import megatron_cpu_mode
    from megatron_bubblespec.distributed.world import init_distributed
    from megatron_bubblespec.models.architecture import load_checkpoint
    from megatron_bubblespec.models.smollm2 import smollm2_checkpoint
    from megatron_bubblespec.train import attention
    from megatron_bubblespec.train.model import build_gpt_model
    from megatron_bubblespec.train.sharding import load_hf_weights

    if not fused:   # this process only: every layer runs the parent's computation
        attention.FusedCoreAttention.forward = DotProductAttention.forward
    init_distributed(1, 1, seed=1)
    arch, tensors = load_checkpoint(smollm2_checkpoint())
    with megatron_cpu_mode():
        model = build_gpt_model(arch)
        load_hf_weights(model, arch, tensors)
    del tensors
    ids = torch.randint(0, arch.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    before, start = _peak_gb(), time.perf_counter()
    with megatron_cpu_mode():
        logits = model(ids, torch.arange(tokens)[None], None)
        logits.float().logsumexp(-1).mean().backward()
    return _peak_gb() - before, time.perf_counter() - start, logits[0, -5:].detach().clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1200)
    args = parser.parse_args()
    last = {}
    for fused in (False, True):
        peak, seconds, last[fused] = launch_local(_worker, 1, fused, args.tokens,
                                                  env={"TORCHDYNAMO_DISABLE": "1"})[0]
        name = "FusedCoreAttention" if fused else "DotProductAttention (Megatron's local)"
        print(f"{name}: +{peak:.2f} GB peak RSS, {seconds:.1f} s forward + backward")
    print(f"largest logit difference: {(last[True] - last[False]).abs().max().item():.2g}")


if __name__ == "__main__":
    main()
