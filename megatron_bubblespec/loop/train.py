"""The synchronous training loop: config -> ranks (launched here or by torchrun/srun) -> steps ->
metrics, rollouts, checkpoints, the final HF checkpoint, summary table and plot in the run
directory.

    replica = build_replica(cfg); resume from the latest complete checkpoint if asked
    for step in range(start, cfg.run.steps):
        out = run_step(replica, step)        # verify, rollout, bubble, exchange, learn, reshard
        rank 0: aggregate, write metrics + rollouts, update the progress display
        every run.checkpoint_every steps, or on SIGUSR1/SIGTERM: checkpoint (then exit 75)
    final/ (HF checkpoint); rank 0: summary table, plot

Every rank keeps ``heartbeat/rank<R>.json`` (step and stage) current; when a locally launched
rank dies, the launcher names it and the stage it died in.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from megatron_bubblespec.config import Config
from megatron_bubblespec.distributed import destroy_distributed
from megatron_bubblespec.distributed.launch import RankFailure, launch_local
from megatron_bubblespec.logs import route_third_party_output, tail
from megatron_bubblespec.loop.checkpoint import (complete_checkpoints, load_checkpoint_into,
                                                  resolve_resume, save_checkpoint)
from megatron_bubblespec.loop.heartbeat import (EXIT_PREEMPTED, STOP_SIGNALS, Heartbeat,
                                                 PreemptionFlag, lost_work, read_heartbeat)
from megatron_bubblespec.loop.replica import Replica, build_replica
from megatron_bubblespec.loop.run_dir import RunDir
from megatron_bubblespec.loop.run_log import RunLog
from megatron_bubblespec.loop.step import gather_step, run_step
from megatron_bubblespec.rollout.vllm_engine import BATCH_INVARIANT_ENV
from megatron_bubblespec.train.checkpoint import check_checkpointable
from megatron_bubblespec.train.export import export_final


def _preempted(flag: PreemptionFlag) -> bool:
    """Whether any rank got a preemption signal (collective)."""
    import torch
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    raised = torch.tensor([int(flag.raised)], device=device)
    dist.all_reduce(raised, op=dist.ReduceOp.MAX)
    return bool(raised.item())


def train_rank(cfg: Config, return_weights: bool = False) -> dict | None:
    """Run the whole job on this rank; rank 0 returns the run's records (and, if asked, the final
    HF-layout weights), the other ranks None. Exits with ``EXIT_PREEMPTED`` after writing a
    checkpoint when a preemption signal arrives."""
    import torch.distributed as dist

    run = RunDir.of(cfg)
    _prepare_process(cfg, run)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    heartbeat = Heartbeat(run.heartbeat, rank, cfg.run.stall_timeout_s)
    flag = PreemptionFlag(
        cfg.run.signal_grace_s, where=heartbeat.describe, limit_s=cfg.run.checkpoint_grace_s,
        heartbeat=heartbeat, lost=lambda: lost_work(heartbeat.step, heartbeat.stage,
                                                    complete_checkpoints(run.checkpoints)),
    ).install()
    heartbeat.beat(-1, "build")
    replica = build_replica(cfg)
    replica.heartbeat = heartbeat
    if cfg.run.checkpoint_every > 0 or cfg.run.resume != "none":
        check_checkpointable(replica.trainer)
    start_step = _resume(replica, run)
    log = RunLog(cfg, run, start_step) if dist.get_rank() == 0 else None
    try:
        preempted = _run_steps(replica, run, start_step, flag, log)
        heartbeat.beat(cfg.run.steps, "export")
        weights = None if preempted else export_final(replica, run.final)
    finally:
        if log:
            log.close()
    if log and not preempted:
        log.summarize()
    heartbeat.beat(cfg.run.steps, "shutdown")
    _shutdown(replica)
    heartbeat.beat(cfg.run.steps, "done")
    heartbeat.close()
    flag.uninstall()
    if preempted:
        sys.exit(EXIT_PREEMPTED)
    if log is None:
        return None
    return {"records": log.records, "rollouts": log.rollouts,
            "weights": weights if return_weights else None}


def _prepare_process(cfg: Config, run: RunDir) -> None:
    """The environment the libraries read when first imported, and where their output goes."""
    # vLLM reads its log level when first imported (in build_replica): keep the console for the
    # progress display unless the user asked for vLLM's own logs.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if cfg.rollout.batch_invariant:   # read when vLLM's kernels are imported
        os.environ[BATCH_INVARIANT_ENV] = "1"     # (vllm_engine.check_batch_invariance)
    route_third_party_output(run.path)


def _resume(replica: Replica, run: RunDir) -> int:
    """The step to start at: 0, or that of the checkpoint ``run.resume`` names (rank 0 finds it,
    every rank loads it)."""
    import torch.distributed as dist

    rank0 = dist.get_rank() == 0
    found = resolve_resume(replica.cfg, run.checkpoints) if rank0 else None
    box = [str(found) if found else None]
    dist.broadcast_object_list(box, src=0)
    if not box[0]:
        return 0
    replica.beat(-1, "resume")
    start_step = load_checkpoint_into(replica, Path(box[0]))
    if rank0:
        print(f"resumed from {box[0]} at step {start_step}", flush=True)
    return start_step


def _run_steps(replica: Replica, run: RunDir, start_step: int, flag: PreemptionFlag,
               log: RunLog | None) -> bool:
    """Steps ``start_step`` .. run.steps - 1, each logged (rank 0) and checkpointed when due;
    True when a preemption signal stopped the run early (its checkpoint written)."""
    cfg = replica.cfg
    for step in range(start_step, cfg.run.steps):
        outputs = gather_step(replica, run_step(replica, step))
        replica.beat(step, "log")
        if log:
            log.log_step(step, outputs)
        done = step + 1
        preempted = _preempted(flag) and done < cfg.run.steps
        every = cfg.run.checkpoint_every
        if preempted or (every and (done % every == 0 or done == cfg.run.steps)):
            replica.beat(step, "checkpoint")
            saved = save_checkpoint(replica, run.checkpoints, done, cfg.run.keep_checkpoints)
            if preempted:
                flag.saved(saved)
                if log:
                    print(f"preempted (signal {flag.signal}): checkpoint {saved} written after "
                          f"step {step}; resume with run.resume=auto", flush=True)
                return True
    return False


def _shutdown(replica) -> None:
    """Release the engine before the process groups (vLLM tears down its own groups)."""
    import torch.distributed as dist

    dist.barrier()  # nobody is inside a collective any more
    engine = replica.engine_shard
    replica.engine = replica.drafter = replica.engine_shard = None
    if engine is not None:
        engine.shutdown()
    del engine
    import gc

    gc.collect()
    destroy_distributed()


def inside_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ or "SLURM_PROCID" in os.environ


def train(cfg: Config, return_weights: bool = False) -> dict | None:
    """Run the job: inside an existing torchrun/srun world, or by launching the ranks locally.

    Locally launched, a rank that dies raises ``RankFailure`` naming it and the step and stage
    it was in; a preempted job (SIGUSR1/SIGTERM, checkpoint written) exits with
    ``EXIT_PREEMPTED``."""
    if inside_launcher():
        return train_rank(cfg, return_weights)
    env = {"TORCHDYNAMO_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    try:
        return launch_local(train_rank, cfg.parallel.world_size, cfg, return_weights, env=env)[0]
    except RankFailure as failure:
        if failure.exit_code == EXIT_PREEMPTED:
            sys.exit(EXIT_PREEMPTED)
        raise _where_it_died(failure, RunDir.of(cfg)) from None


def _where_it_died(failure: RankFailure, run: RunDir) -> RankFailure:
    """``failure`` with the step and stage its rank was last seen in and the end of its log."""
    beat = read_heartbeat(run.heartbeat, failure.rank)
    where = (f" during stage {beat['stage']!r} of step {beat['step']}" if beat
             else " before it started")
    if failure.exit_code in [128 + s for s in STOP_SIGNALS]:   # its own message said why
        return RankFailure(f"{failure}: it ended itself{where} after a stop signal, without a "
                           "checkpoint (see its message above)", failure.rank,
                           failure.exit_code, failure.signal_name)
    message = (f"{failure}; rank {failure.rank} was last seen{where} (heartbeat: "
               f"{run.heartbeat})")
    log = run.rank_log(failure.rank)   # its native output too
    if lines := tail(log):
        message += f"; the end of its log {log}:" + "".join(f"\n    {x}" for x in lines)
    return RankFailure(message, failure.rank, failure.exit_code, failure.signal_name)
