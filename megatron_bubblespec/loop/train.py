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

from megatron_bubblespec.config import Config, to_yaml
from megatron_bubblespec.distributed import destroy_distributed
from megatron_bubblespec.distributed.launch import RankFailure, launch_local
from megatron_bubblespec.logs import LOG_DIR, route_third_party_output, tail
from megatron_bubblespec.loop.checkpoint import (checkpoint_root, complete_checkpoints,
                                                  load_checkpoint_into, resolve_resume,
                                                  save_checkpoint)
from megatron_bubblespec.loop.heartbeat import (EXIT_PREEMPTED, STOP_SIGNALS, Heartbeat,
                                                 PreemptionFlag, lost_work, read_heartbeat)
from megatron_bubblespec.loop.replica import build_replica
from megatron_bubblespec.loop.step import gather_step, run_step
from megatron_bubblespec.metrics import (MetricsWriter, RunProgress, aggregate_step, plot_run,
                                         print_summary, read_metrics, to_json)
from megatron_bubblespec.metrics.rollouts import append_rollouts, read_rollouts, write_rollouts
from megatron_bubblespec.rollout.vllm_engine import BATCH_INVARIANT_ENV
from megatron_bubblespec.train.checkpoint import check_checkpointable
from megatron_bubblespec.train.export import export_final


def run_dir(cfg: Config) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def _history(out_dir: Path, start_step: int) -> tuple[list[dict], list[dict]]:
    """The records and rollouts of steps < ``start_step`` from the run directory; the files are
    cut back to them (a resumed run rewrites the steps after its checkpoint)."""
    if start_step == 0:
        write_rollouts(out_dir, [])
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run starts a fresh record
        return [], []
    has_metrics = (out_dir / "metrics.jsonl").is_file()
    records = [r for r in read_metrics(out_dir) if r["step"] < start_step] if has_metrics else []
    rollouts = read_rollouts(out_dir, before_step=start_step)
    with open(out_dir / "metrics.jsonl", "w") as f:
        f.writelines(to_json(r) + "\n" for r in records)
    write_rollouts(out_dir, rollouts)
    return records, rollouts


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

    # vLLM reads its log level when first imported (in build_replica): keep the console for the
    # progress display unless the user asked for vLLM's own logs.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if cfg.rollout.batch_invariant:   # read when vLLM's kernels are imported
        os.environ[BATCH_INVARIANT_ENV] = "1"     # (vllm_engine.check_batch_invariance)
    route_third_party_output(run_dir(cfg))
    out_dir = run_dir(cfg)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    heartbeat = Heartbeat(out_dir / "heartbeat", rank, cfg.run.stall_timeout_s)
    ckpt_root = checkpoint_root(cfg, out_dir)
    flag = PreemptionFlag(
        cfg.run.signal_grace_s, where=heartbeat.describe, limit_s=cfg.run.checkpoint_grace_s,
        heartbeat=heartbeat,
        lost=lambda: lost_work(heartbeat.step, heartbeat.stage, complete_checkpoints(ckpt_root)),
    ).install()
    heartbeat.beat(-1, "build")
    replica = build_replica(cfg)
    replica.heartbeat = heartbeat
    rank0 = dist.get_rank() == 0
    checkpointing = cfg.run.checkpoint_every > 0 or cfg.run.resume != "none"
    if checkpointing:
        check_checkpointable(replica.trainer)
    start_step = 0
    resume_from = resolve_resume(cfg, out_dir) if rank0 else None
    box = [str(resume_from) if resume_from else None]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        heartbeat.beat(-1, "resume")
        start_step = load_checkpoint_into(replica, Path(box[0]))
        if rank0:
            print(f"resumed from {box[0]} at step {start_step}", flush=True)
    records, rollouts = [], []
    writer = progress = None
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(to_yaml(cfg))
        records, rollouts = _history(out_dir, start_step)
        writer = MetricsWriter(out_dir, tensorboard=cfg.logging.tensorboard)
        progress = RunProgress(cfg.run.steps) if cfg.logging.progress else None
        if progress:
            progress.__enter__()
    preempted = False
    try:
        for step in range(start_step, cfg.run.steps):
            outputs = gather_step(replica, run_step(replica, step))
            heartbeat.beat(step, "log")
            if rank0:
                record = aggregate_step(step, [o.rank_metrics for o in outputs])
                record.update(outputs[0].global_metrics)
                records.append(record)
                writer.write(record)
                step_rollouts = {g: t for o in outputs for g, t in o.rollouts.items()}
                rollouts.append(step_rollouts)
                append_rollouts(out_dir, step, step_rollouts)
                if progress:
                    progress.update(step, record)
            done = step + 1
            preempted = _preempted(flag) and done < cfg.run.steps
            every = cfg.run.checkpoint_every
            if preempted or (every and (done % every == 0 or done == cfg.run.steps)):
                heartbeat.beat(step, "checkpoint")
                saved = save_checkpoint(replica, ckpt_root, done, cfg.run.keep_checkpoints)
                if preempted:
                    flag.saved(saved)
                if rank0 and preempted:
                    print(f"preempted (signal {flag.signal}): checkpoint {saved} written after "
                          f"step {step}; resume with run.resume=auto", flush=True)
            if preempted:
                break
        heartbeat.beat(cfg.run.steps, "export")
        weights = None if preempted else export_final(replica, out_dir / "final")
    finally:
        if progress:
            progress.__exit__(None, None, None)
        if writer:
            writer.close()
    if rank0 and not preempted:
        print_summary(records)
        if cfg.logging.plot:
            plot_run(records, out_dir / "bubblespec.png")
        print(f"run directory: {out_dir} (metrics.jsonl, rollouts.jsonl, final/, tensorboard/, "
              "bubblespec.png)")
    heartbeat.beat(cfg.run.steps, "shutdown")
    _shutdown(replica)
    heartbeat.beat(cfg.run.steps, "done")
    heartbeat.close()
    flag.uninstall()
    if preempted:
        sys.exit(EXIT_PREEMPTED)
    if not rank0:
        return None
    return {"records": records, "rollouts": rollouts,
            "weights": weights if return_weights else None}


def _shutdown(replica) -> None:
    """Release the engine before the process groups (vLLM tears down its own groups)."""
    import torch.distributed as dist

    dist.barrier()  # nobody is inside a collective any more
    engine = replica.engine_shard
    replica.engine = replica.drafter = replica.engine_shard = None
    if engine is not None and hasattr(engine, "shutdown"):
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
        beat = read_heartbeat(run_dir(cfg) / "heartbeat", failure.rank)
        where = (f" during stage {beat['stage']!r} of step {beat['step']}" if beat
                 else " before it started")
        if failure.exit_code in [128 + s for s in STOP_SIGNALS]:   # its own message said why
            raise RankFailure(f"{failure}: it ended itself{where} after a stop signal, without a "
                              "checkpoint (see its message above)", failure.rank,
                              failure.exit_code, failure.signal_name) from None
        message = (f"{failure}; rank {failure.rank} was last seen{where} (heartbeat: "
                   f"{run_dir(cfg) / 'heartbeat'})")
        log = run_dir(cfg) / LOG_DIR / f"rank{failure.rank}.log"   # its native output too
        if lines := tail(log):
            message += f"; the end of its log {log}:" + "".join(f"\n    {x}" for x in lines)
        raise RankFailure(message, failure.rank, failure.exit_code,
                          failure.signal_name) from None
