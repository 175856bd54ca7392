"""ModelSpec + parallel sizes -> what the model's experts cannot be split by (problems a user can act on).

Expert parallelism (``parallel.expert``, Megatron's EP) gives each of EP data-parallel ranks
``num_experts / EP`` whole experts of every MoE layer; each expert's weights are then split over
the tensor-parallel ranks as a dense MLP's are. The attention heads, layers and dense MLP widths
are checked with the rest of the layout by the preflight.
"""

from __future__ import annotations

from megatron_bubblespec.models.architecture import ModelSpec


def experts_per_rank(arch: ModelSpec, expert: int) -> int:
    """Experts of each MoE layer that one expert-parallel rank holds (0 for a dense model)."""
    return arch.num_experts // expert if arch.is_moe else 0


def check_expert_layout(arch: ModelSpec, tensor: int, expert: int, data: int) -> list[str]:
    """Every reason ``parallel.expert=expert`` cannot split this model at TP ``tensor`` and DP
    ``data``, each naming the numbers and the fix; empty when it can."""
    problems = []
    if expert > 1 and not arch.is_moe:
        problems.append(f"parallel.expert={expert} needs a mixture-of-experts model; this "
                        f"{arch.arch} model is dense: set parallel.expert=1")
        return problems
    if data % expert:
        problems.append(f"parallel.expert={expert} does not divide the data-parallel size {data}: "
                        "expert-parallel ranks are data-parallel ranks; choose a divisor of "
                        f"{data}")
    if arch.is_moe and arch.num_experts % expert:
        problems.append(f"parallel.expert={expert} does not divide the model's "
                        f"{arch.num_experts} experts; choose a divisor of {arch.num_experts}")
    if arch.is_moe and arch.moe_intermediate_size % tensor:
        problems.append(f"parallel.tensor={tensor} does not divide the experts' "
                        f"moe_intermediate_size {arch.moe_intermediate_size} (each expert is "
                        "split over the tensor-parallel ranks); choose a divisor of it")
    return problems
