"""Process world: torchrun / Slurm environment -> torch.distributed + Megatron TP x CP x EP x DP x PP groups.

One process per device. The rank layout comes from torchrun's variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) when present, else from Slurm's (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID, with the rendezvous on the first node of SLURM_JOB_NODELIST), else a single process.
Backend: NCCL with a GPU, gloo without.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_bubblespec.distributed.cpu_compat import (
    apply_cpu_patches,
    apply_no_te_shims,
    device_config_overrides,
    megatron_cpu_mode,
)

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "single"


def _resolvable(host: str) -> bool:
    try:
        socket.gethostbyname(host)
        return True
    except OSError:
        return False


def _first_slurm_host(env) -> str:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
        host = out[0] if out else nodelist
    except (OSError, subprocess.SubprocessError):
        host = nodelist.split(",")[0].split("[")[0]
    return host if _resolvable(host) else "127.0.0.1"


def detect_world(env=None) -> WorldInfo:
    """Read the rank layout from the environment (torchrun first, then Slurm, else one process)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return WorldInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         env.get("MASTER_ADDR", "127.0.0.1"),
                         int(env.get("MASTER_PORT", DEFAULT_PORT)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job = int(env.get("SLURM_JOB_ID", "0"))
        return WorldInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                         int(env.get("SLURM_LOCALID", 0)),
                         env.get("MASTER_ADDR") or _first_slurm_host(env),
                         int(env.get("MASTER_PORT", 20000 + job % 20000)), "slurm")
    return WorldInfo(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"),
                     int(env.get("MASTER_PORT", DEFAULT_PORT)), "single")


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(*, backend: str | None = None, timeout_s: float = 600.0,
                       world: WorldInfo | None = None) -> WorldInfo:
    """Start the default process group from the environment (no-op if it already exists)."""
    world = world or detect_world()
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(world.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend, rank=world.rank, world_size=world.world_size,
            init_method=f"tcp://{world.master_addr}:{world.master_port}",
            timeout=datetime.timedelta(seconds=timeout_s))
    return world


def init_distributed(tensor_parallel: int = 1, pipeline_parallel: int = 1, *, seed: int = 0,
                     backend: str | None = None, timeout_s: float = 600.0,
                     world: WorldInfo | None = None, context_parallel: int = 1,
                     order: str = "tp-cp-ep-dp-pp", expert_parallel: int = 1) -> WorldInfo:
    """Start the default process group and Megatron's TP x CP x PP x DP groups, ranks in
    ``order`` (innermost first: Megatron's ``initialize_model_parallel``), and its expert groups:
    EP ranks split the experts among data-parallel ranks, each expert split over TP ranks as the
    dense layers are (expert-tensor parallelism = TP). Returns the layout.

    Raises a ValueError naming the sizes when TP x CP x PP does not divide the world size or EP
    does not divide the data-parallel size.
    """
    world = world or detect_world()
    if world.world_size % (tensor_parallel * pipeline_parallel * context_parallel):
        raise ValueError(
            f"world size {world.world_size} is not divisible by tensor_parallel x "
            f"context_parallel x pipeline_parallel = {tensor_parallel} x {context_parallel} x "
            f"{pipeline_parallel}; choose sizes whose product divides the number of processes "
            "(the rest becomes data parallelism)")
    data_parallel = world.world_size // (tensor_parallel * pipeline_parallel * context_parallel)
    if data_parallel % expert_parallel:
        raise ValueError(f"parallel.expert={expert_parallel} does not divide the data-parallel "
                         f"size {data_parallel}: expert-parallel ranks are data-parallel ranks; "
                         f"choose a divisor of {data_parallel}")
    init_process_group(backend=backend, timeout_s=timeout_s, world=world)
    apply_cpu_patches()
    apply_no_te_shims()
    from megatron.core import parallel_state, tensor_parallel as mp_tensor_parallel

    with megatron_cpu_mode():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            context_parallel_size=context_parallel, order=order,
            expert_model_parallel_size=expert_parallel)
        mp_tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return world


def megatron_config_overrides() -> dict:
    """TransformerConfig fields this process needs: its TP/PP sizes (megatron builds a pipeline
    stage's layers from them) and the device settings of ``device_config_overrides``."""
    from megatron.core import parallel_state

    return {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        **device_config_overrides(),
    }


def expert_parallel_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_world_size()


def expert_parallel_peaks(values: Sequence[int]) -> list[int]:
    """The largest of each of ``values`` over this rank's TP x EP group (``values`` themselves
    without expert parallelism). Megatron's allgather token dispatcher gathers every MoE layer's
    tokens over that group with equal sizes, so its ranks must run the same number of forward
    passes, each over the same number of tokens: pad micro-batch sizes, counts and sequence
    lengths to these."""
    from megatron.core import parallel_state

    if expert_parallel_size() == 1:
        return list(values)
    peaks = torch.tensor(list(values), dtype=torch.int64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX,
                    group=parallel_state.get_expert_tensor_and_model_parallel_group())
    return peaks.tolist()


def expert_parallel_max(value: int) -> int:
    """The largest ``value`` over this rank's TP x EP group (``expert_parallel_peaks``)."""
    return expert_parallel_peaks([value])[0]


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def default_store():
    """The key-value store of the default process group (TCP store under torchrun/Slurm/launcher)."""
    return dist.distributed_c10d._get_default_store()
