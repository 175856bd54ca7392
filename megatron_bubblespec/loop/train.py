"""The synchronous training loop: config -> ranks (launched here or by torchrun/srun) -> steps ->
metrics, rollouts, summary table and plot in the run directory.

    replica = build_replica(cfg)
    for step in range(cfg.run.steps):
        out = run_step(replica, step)        # verify, rollout, bubble, exchange, learn, reshard
        rank 0: aggregate, write metrics + rollouts, update the progress display
    rank 0: summary table, plot
"""

from __future__ import annotations

import json
import os
from pathlib import Path


from megatron_bubblespec.config import Config, to_yaml
from megatron_bubblespec.distributed import destroy_distributed
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.loop.replica import build_replica
from megatron_bubblespec.loop.step import gather_step, run_step
from megatron_bubblespec.metrics import (MetricsWriter, RunProgress, aggregate_step, plot_run,
                                         print_summary)


def run_dir(cfg: Config) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def train_rank(cfg: Config, return_weights: bool = False) -> dict | None:
    """Run the whole job on this rank; rank 0 returns the run's records (and, if asked, the final
    HF-layout weights), the other ranks None."""
    import torch.distributed as dist

    # vLLM reads its log level when first imported (in build_replica): keep the console for the
    # progress display unless the user asked for vLLM's own logs.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    replica = build_replica(cfg)
    rank0 = dist.get_rank() == 0
    out_dir = run_dir(cfg)
    records, rollouts = [], []
    writer = progress = None
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(to_yaml(cfg))
        (out_dir / "rollouts.jsonl").write_text("")
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run starts a fresh record
        writer = MetricsWriter(out_dir, tensorboard=cfg.logging.tensorboard)
        progress = RunProgress(cfg.run.steps) if cfg.logging.progress else None
        if progress:
            progress.__enter__()
    try:
        for step in range(cfg.run.steps):
            outputs = gather_step(replica, run_step(replica, step))
            if rank0:
                record = aggregate_step(step, [o.rank_metrics for o in outputs])
                record.update(outputs[0].global_metrics)
                records.append(record)
                writer.write(record)
                step_rollouts = {g: t for o in outputs for g, t in o.rollouts.items()}
                rollouts.append(step_rollouts)
                with open(out_dir / "rollouts.jsonl", "a") as f:
                    f.write(json.dumps({"step": step, "responses": {str(g): t for g, t in
                                                                     sorted(step_rollouts.items())}})
                            + "\n")
                if progress:
                    progress.update(step, record)
        weights = None
        if return_weights:
            weights = {name: t.clone() for name, t in replica.resharder.named_tensors()}
    finally:
        if progress:
            progress.__exit__(None, None, None)
        if writer:
            writer.close()
    if rank0:
        print_summary(records)
        if cfg.logging.plot:
            plot_run(records, out_dir / "bubblespec.png")
        print(f"run directory: {out_dir} (metrics.jsonl, rollouts.jsonl, tensorboard/, bubblespec.png)")
    _shutdown(replica)
    if not rank0:
        return None
    return {"records": records, "rollouts": rollouts, "weights": weights}


def _shutdown(replica) -> None:
    """Release the engine before the process groups (vLLM tears down its own groups)."""
    import torch.distributed as dist

    dist.barrier()  # nobody is inside a collective any more
    engine = replica.engine
    replica.engine = replica.drafter = None
    if engine is not None and hasattr(engine, "shutdown"):
        engine.shutdown()
    del engine
    import gc

    gc.collect()
    destroy_distributed()


def inside_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ or "SLURM_PROCID" in os.environ


def train(cfg: Config, return_weights: bool = False) -> dict | None:
    """Run the job: inside an existing torchrun/srun world, or by launching the ranks locally."""
    if inside_launcher():
        return train_rank(cfg, return_weights)
    env = {"TORCHDYNAMO_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return launch_local(train_rank, cfg.parallel.world_size, cfg, return_weights, env=env)[0]
