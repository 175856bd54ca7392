"""Model checkpoints: HF directories (tiny random or shipped SmolLM2) -> ModelSpec + tensors."""
