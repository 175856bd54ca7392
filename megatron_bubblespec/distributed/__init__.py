"""Processes and groups: torchrun/Slurm environment -> process groups (gloo/NCCL) -> Megatron TP x PP x EP x DP."""

from megatron_bubblespec.distributed.cpu_compat import (
    apply_cpu_patches,
    apply_no_te_shims,
    device_config_overrides,
    megatron_cpu_mode,
)
from megatron_bubblespec.distributed.world import (
    WorldInfo,
    destroy_distributed,
    detect_world,
    expert_parallel_max,
    expert_parallel_peaks,
    expert_parallel_size,
    init_distributed,
    init_process_group,
    megatron_config_overrides,
)

__all__ = [
    "WorldInfo", "apply_cpu_patches", "apply_no_te_shims", "destroy_distributed", "detect_world",
    "expert_parallel_max", "expert_parallel_peaks", "expert_parallel_size",
    "init_distributed", "init_process_group", "megatron_config_overrides",
    "megatron_cpu_mode", "device_config_overrides",
]
