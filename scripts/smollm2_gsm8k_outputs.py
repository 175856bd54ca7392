"""GSM8K test questions -> the GSM8K task's chat prompts -> SmolLM2-135M-Instruct on vLLM -> JSONL of
decoded responses (the grader comparison's real model outputs, tests/data/smollm2_gsm8k_outputs.jsonl).

The first ``--questions`` test questions, each answered twice with the project's own engine and
keyed sampler: once greedily (T = 0) and once at T = 1 (the training temperature), at most
``--max-new-tokens`` new tokens, ``--batch`` requests at a time. Sample keys are
``sample_key(--seed, 0, uid, 0)``, so the output is reproducible on the same stack. One row per
response: ``{"uid", "temperature", "finish_reason", "response"}`` (the text up to the first EOS).

Regenerate the committed file with (about two minutes on 2 CPU cores)::

    TORCHDYNAMO_DISABLE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        .venv/bin/python scripts/smollm2_gsm8k_outputs.py tests/data/smollm2_gsm8k_outputs.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_bubblespec.data.tasks import GSM8KTask
from megatron_bubblespec.models.smollm2 import load_tokenizer, smollm2_checkpoint
from megatron_bubblespec.rollout.vllm_engine import VLLMEngine
from megatron_bubblespec.sampling import SamplingParams, sample_key
from megatron_bubblespec.sampling.requests import RolloutRequest

TEMPERATURES = (0.0, 1.0)


def generate(questions: int, max_new_tokens: int, batch: int, seed: int) -> list[dict]:
    """One row per (question, temperature), in question order, greedy first."""
    task = GSM8KTask("test", load_tokenizer())
    engine = VLLMEngine(smollm2_checkpoint(), max_model_len=1024, seed=seed)
    prompts = [task.prompt(i) for i in range(questions)]
    rows = []
    try:
        for start in range(0, questions, batch):
            chunk = prompts[start:start + batch]
            for temperature in TEMPERATURES:
                requests = [RolloutRequest(f"{p.uid}-t{temperature}", p.token_ids,
                                           sample_key(seed, 0, p.uid, 0), max_new_tokens,
                                           eos_token_ids=task.eos_token_ids) for p in chunk]
                results = engine.generate(requests, SamplingParams(temperature=temperature))
                for prompt, result in zip(chunk, results):
                    text, _ = task.decode(result.token_ids)
                    rows.append({"uid": prompt.uid, "temperature": temperature,
                                 "finish_reason": result.finish_reason, "response": text})
            print(f"{min(start + batch, questions)}/{questions} questions", flush=True)
    finally:
        engine.shutdown()
    rows.sort(key=lambda r: (int(r["uid"].rsplit("-", 1)[1]), r["temperature"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="JSONL file to write")
    parser.add_argument("--questions", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = generate(args.questions, args.max_new_tokens, args.batch, args.seed)
    args.out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows),
                        encoding="utf-8")
    print(f"wrote {len(rows)} responses to {args.out}")


if __name__ == "__main__":
    main()
