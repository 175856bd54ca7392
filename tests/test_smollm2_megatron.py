"""SmolLM2-135M-Instruct loads into Megatron (TP=1) and gives transformers' logits on a GSM8K prompt."""

import pytest
import torch

from megatron_bubblespec.distributed import destroy_distributed, init_distributed, megatron_cpu_mode
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.models.architecture import load_checkpoint
from megatron_bubblespec.train.forward import megatron_forward
from megatron_bubblespec.train.model import build_gpt_model
from megatron_bubblespec.train.sharding import load_hf_weights

pytestmark = pytest.mark.slow   # multi-process or real-model runs: minutes on 2 cores

# fp32 end to end. Float32 rounding alone moves this model's logits (magnitude up to ~40) by up
# to ~8e-5 from the exact value: transformers' own fp32 forward is 7.9e-5 from its fp64 forward
# on this prompt, Megatron's 6.3e-5 (and bitwise equal to transformers' eager-attention fp32
# forward on CPU). Two correct fp32 implementations that order their operations differently
# (fused QKV and gate/up matmuls, baddbmm attention vs SDPA) may differ by about twice that; 2e-4
# is that bound with a little room. Conversion errors are far above it: a wrong RMSNorm epsilon
# (1e-6 for 1e-5) moves these logits by 3e-2, a wrong RoPE base (1e4 for 1e5) by 10. The second
# check makes the same argument without a constant: Megatron must be about as close to the fp64
# logits as transformers' fp32 forward is.
ATOL = 2e-4


def _prompt_ids() -> torch.Tensor:
    from megatron_bubblespec.data.gsm8k import load_gsm8k
    from megatron_bubblespec.models.smollm2 import load_tokenizer

    tokenizer = load_tokenizer().tokenizer
    question = load_gsm8k("test")[0].question
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    return inputs["input_ids"]


def _megatron_logits(path, tokens):
    init_distributed(1, 1, seed=0)
    arch, tensors = load_checkpoint(path)
    with megatron_cpu_mode():
        model = build_gpt_model(arch)
        load_hf_weights(model, arch, tensors)
    del tensors
    (logits,) = megatron_forward(model, tokens, lambda out, rows: out[..., :arch.vocab_size].clone())
    destroy_distributed()
    return logits


@pytest.mark.slow
def test_smollm2_megatron_logits_equal_transformers():
    from transformers import AutoModelForCausalLM

    from megatron_bubblespec.models.smollm2 import smollm2_checkpoint

    path = smollm2_checkpoint()
    tokens = _prompt_ids()
    assert 60 <= tokens.shape[1] <= 200, tokens.shape
    # one spawned rank (the Megatron groups live and die in it); its model is freed before ours
    (megatron,) = launch_local(_megatron_logits, 1, path, tokens, env={"OMP_NUM_THREADS": "2"})
    want = {}
    for dtype in (torch.float32, torch.float64):   # one model in memory at a time
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        with torch.no_grad():
            want[dtype] = hf(tokens).logits
        del hf
    hf32, exact = want[torch.float32], want[torch.float64]
    assert megatron.shape == hf32.shape == (1, tokens.shape[1], 49152)
    diff = (megatron - hf32).abs().max().item()
    megatron_err = (megatron.double() - exact).abs().max().item()
    hf_err = (hf32.double() - exact).abs().max().item()
    print(f"SmolLM2, {tokens.shape[1]} prompt tokens, max |logit| {exact.abs().max().item():.1f}: "
          f"max abs diff Megatron vs transformers (fp32) {diff:.3g}; vs fp64: Megatron "
          f"{megatron_err:.3g}, transformers fp32 {hf_err:.3g}")
    assert diff <= ATOL, diff
    assert megatron_err <= 2 * hf_err, (megatron_err, hf_err)
    assert torch.equal(megatron.argmax(-1), hf32.argmax(-1))
    assert torch.equal(megatron.argmax(-1), exact.argmax(-1))
