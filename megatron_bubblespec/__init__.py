"""megatron-bubblespec: synchronous on-policy RL on Megatron-core + vLLM with BubbleSpec drafts."""
