"""Megatron's process world -> vLLM's parallel state, built alike on every rank before any engine.

vLLM, given an already initialised default process group, builds its world group over ALL ranks of
that group and calls ``torch.distributed.new_group`` for every rank list of every group it makes;
torch requires every rank of the default group to make the same ``new_group`` calls in the same
order. A rollout engine that only some ranks build (one per model replica) would therefore
deadlock against the ranks that are elsewhere (in Megatron's resharder, say). So every rank calls
:func:`init_vllm_parallel_state` once, right after Megatron's groups exist: vLLM's world, tensor-
and pipeline-parallel groups are then created collectively, and an engine built afterwards finds
them ready (``ensure_model_parallel_initialized`` only checks their sizes) and creates none.

Rollout tensor parallelism (``rollout_tp`` = r > 1): vLLM's tensor-parallel groups are contiguous
rank blocks ``[kr .. kr+r-1]``, which are exactly the rollout layout's engines (``loop.layout``: r
consecutive ranks of a replica; inside one replica when r divides TP x CP in Megatron's default
order, TP innermost, or TP x PP x CP with ``parallel.order`` tp-cp-ep-pp-dp);
:func:`init_vllm_parallel_state` asserts it. Every engine is built with
``distributed_executor_backend="external_launcher"``, one shard per rank. That executor reduces
the available KV-cache memory over vLLM's WORLD group, a collective the other engines never enter
at the same moment; :func:`patch_external_launcher` makes it reduce over the engine's own
tensor-parallel group, the ranks that share the cache size.

On CPU, vLLM's shared-memory communicator names its segments after ``VLLM_DIST_IDENT``; the
default (from ``env://``) is the same for every job on a machine, so two concurrent jobs collided
(``create shm in SHMManager failed. errno: 17``). The groups are created here, with a job-specific
name.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# The one vLLM version whose internals the project patches in process (the external launcher's
# memory reduce here, the spec-decode step in ``rollout.vllm_patches``); preflight refuses others.
VLLM_VERSION = "0.32.0"


def _check_version() -> None:
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        raise RuntimeError(
            f"vLLM {vllm.__version__} is installed; the rollout process-group set-up is written "
            f"for vLLM {VLLM_VERSION} (it replaces ExecutorWithExternalLauncher."
            "determine_available_memory); install that version or port the patch")


def job_identifier(run_name: str) -> str:
    """A name unique to this job on this machine (MASTER_PORT is), without '/' (shm names)."""
    port = os.environ.get("MASTER_PORT", str(os.getppid()))
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in run_name)
    return f"bubblespec-{safe}-{port}"


def init_vllm_parallel_state(rollout_tp: int, engine_ranks=None, *,
                             run_name: str = "bubblespec") -> None:
    """Create vLLM's world / TP / PP groups on every rank (collective; call once, on all ranks).

    ``rollout_tp`` is the tensor parallelism of one rollout engine; ``engine_ranks`` the world
    ranks of this rank's engine (``loop.layout.RolloutLayout.engine_ranks``), which must be vLLM's
    tensor-parallel group.
    """
    from vllm.distributed import parallel_state as vllm_ps

    if vllm_ps.model_parallel_is_initialized():
        return
    _check_version()
    from vllm.config import VllmConfig, set_current_vllm_config

    os.environ["VLLM_DIST_IDENT"] = job_identifier(run_name)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    with set_current_vllm_config(VllmConfig()):
        vllm_ps.init_distributed_environment(world, rank, "env://", local_rank, backend)
        vllm_ps.initialize_model_parallel(rollout_tp, 1, backend=backend)
    if rollout_tp > 1:
        vllm_tp = vllm_ps.get_tp_group().ranks
        if engine_ranks is not None and list(engine_ranks) != list(vllm_tp):
            raise RuntimeError(
                f"rank {rank}: vLLM's tensor-parallel group {vllm_tp} is not this rank's rollout "
                f"engine {list(engine_ranks)}; rollout.tensor_parallel > 1 needs an engine's ranks "
                "consecutive: a rollout TP that divides parallel.tensor x parallel.context, or "
                "the replica size with parallel.order=tp-cp-ep-pp-dp")
        patch_external_launcher()


def engine_cpu_group():
    """The CPU (gloo) group of this rank's rollout engine shards: vLLM's TP group."""
    from vllm.distributed import parallel_state as vllm_ps

    return vllm_ps.get_tp_group().cpu_group


def patch_external_launcher() -> None:
    """Reduce the external-launcher engine's KV-cache memory over its own TP group, not WORLD."""
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher, UniProcExecutor

    if getattr(ExecutorWithExternalLauncher, "_bubblespec_patched", False):
        return

    def determine_available_memory(self) -> list[int]:
        memory = UniProcExecutor.determine_available_memory(self)
        free = torch.tensor([min(memory)], dtype=torch.int64)
        dist.all_reduce(free, group=engine_cpu_group(), op=dist.ReduceOp.MIN)
        return [int(free.item())]

    ExecutorWithExternalLauncher.determine_available_memory = determine_available_memory
    ExecutorWithExternalLauncher._bubblespec_patched = True
