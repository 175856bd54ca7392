"""Rollout engines: keyed generation requests -> responses (reference torch engine, vLLM engine)."""
