"""Model checkpoints: HF directories (tiny random or shipped SmolLM2) -> architecture spec + tensors."""
