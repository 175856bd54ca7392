"""The sampler's own time per decode step, keyed against vLLM's own sampler: engine -> a wrapper
timing vLLM's ``Sampler.forward`` (the keyed processor runs inside it) -> ms per decode step.

Whole-step throughput on a shared 2-core machine drifts by more than the difference this is about;
the sampler's own time is the part keyed and plain sampling do not share, measured inside the same
step. One engine per run (``--engine vllm`` keyed, ``plain`` vLLM's sampler), random-token
prompts (flat next-token rows: the keyed draw's worst case) or GSM8K questions, T = 1:

    python scripts/sampler_cost.py --engine vllm --batch-sizes 1,8,32,64
    python scripts/sampler_cost.py --engine plain --batch-sizes 1,8,32,64

Prints one JSON line per batch size: the median decode step, the sampler's milliseconds per decode
step (median and mean), and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("vllm", "plain"), required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", choices=("random", "gsm8k"), default="random")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if args.threads == 1
                          else f"0-{args.threads - 1}")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

    from vllm.v1.sample.sampler import Sampler

    from megatron_bubblespec.measure.engine_bench import model_info, resolved_model, start_engine
    from megatron_bubblespec.measure.engine_timing import prompt_plan, time_run
    from megatron_bubblespec.sampling import SamplingParams

    calls: list[float] = []
    forward = Sampler.forward

    def timed(self, *a, **k):
        start = time.perf_counter()
        try:
            return forward(self, *a, **k)
        finally:
            calls.append(time.perf_counter() - start)

    Sampler.forward = timed
    params = SamplingParams(1.0)
    with resolved_model(args.model) as (path, _name):
        engine = start_engine(args.engine, path, 1024)
        batches = [int(b) for b in args.batch_sizes.split(",")]
        plan = prompt_plan(args.prompts, args.model, path, model_info(path, _name)["vocab_size"],
                           batches, args.prompt_len, 1, 0)
        for batch in batches:
            time_run(engine, plan[batch][0], 4, params, seed=0, tag=f"warm{batch}")
            calls.clear()
            run = time_run(engine, plan[batch][1], args.new_tokens, params, seed=0,
                           tag=f"b{batch}")
            decode = calls[run["prefill_steps"]:]   # one sampler call per engine step
            step_ms = statistics.median(run["decode_step_s"]) * 1e3
            sampler_ms = statistics.median(decode) * 1e3
            print(json.dumps({"engine": args.engine, "prompts": args.prompts, "batch": batch,
                              "decode_steps": len(decode),
                              "median_decode_step_ms": round(step_ms, 2),
                              "sampler_ms_per_step": round(sampler_ms, 3),
                              "sampler_ms_mean": round(statistics.mean(decode) * 1e3, 3),
                              "sampler_share": round(sampler_ms / step_ms, 4),
                              "loadavg": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
    main()
