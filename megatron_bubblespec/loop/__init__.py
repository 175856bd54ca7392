"""The synchronous BubbleSpec loop: verify -> rollout -> bubble -> exchange -> learn -> reshard, per step."""
