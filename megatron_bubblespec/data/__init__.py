"""Data: tasks (prompts + verifiable rewards: synthetic arithmetic, arithmetic word problems, GSM8K) and the lookahead prompt sampler."""
