"""GPU memory between the phases, on one CUDA device: vLLM's sleep mode around a weight update
gives the same keyed tokens as an engine that never slept, and Megatron's optimizer state and
gradient buffers go to the host and back without changing the next train step. On CPU the
switches are refused before anything starts.

The GPU tests are marked ``gpu`` and skipped where torch sees no CUDA device (tests/conftest.py);
the vLLM one also needs vLLM for CUDA installed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron_bubblespec.models.architecture import load_checkpoint
from megatron_bubblespec.sampling import SamplingParams, sample_key
from megatron_bubblespec.sampling.requests import RolloutRequest

from conftest import TINY


def _requests(n=4, new=24):
    return [RolloutRequest(f"r{i}", [5 + i, 9, 11, 13], sample_key(7, 1, f"p{i}", 0), new)
            for i in range(n)]


@pytest.mark.gpu
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_around_a_weight_update_keeps_the_tokens(tiny_checkpoint, level):
    pytest.importorskip("vllm")
    from megatron_bubblespec.rollout.factory import build_engine

    path = tiny_checkpoint("llama")
    _, tensors = load_checkpoint(path)
    params = SamplingParams(1.0)
    awake = build_engine(path, kind="vllm", max_model_len=256, gpu_memory_utilization=0.2)
    expected = [r.token_ids for r in awake.generate(_requests(), params)]
    awake.shutdown()
    engine = build_engine(path, kind="vllm", max_model_len=256, gpu_memory_utilization=0.2,
                          sleep_mode=True)
    before = torch.cuda.memory_allocated()
    engine.sleep(level)
    engine.wake_up(["weights"])
    engine.update_weights(iter(tensors.items()))     # what the reshard pushes
    engine.wake_up(["kv_cache"])
    assert [r.token_ids for r in engine.generate(_requests(), params)] == expected
    assert torch.cuda.memory_allocated() <= before + (64 << 20)
    engine.shutdown()


@pytest.mark.gpu
def test_offloading_the_training_state_changes_no_train_step(tiny_checkpoint):
    """Two identical trainers take two steps; one offloads its optimizer state and gradient
    buffers between them: the weights after the second step are the same."""
    from megatron_bubblespec.distributed.launch import launch_local

    path = tiny_checkpoint("llama")
    plain = launch_local(_two_steps, 1, path, False)[0]
    offloaded = launch_local(_two_steps, 1, path, True)[0]
    assert set(plain) == set(offloaded)
    for name in plain:
        assert torch.equal(plain[name], offloaded[name]), name


def _two_steps(path, offload):
    from megatron_bubblespec.distributed import destroy_distributed, init_distributed
    from megatron_bubblespec.train.grpo import GRPOConfig
    from megatron_bubblespec.train.model import build_gpt_model
    from megatron_bubblespec.train.sharding import load_hf_weights
    from megatron_bubblespec.train.batch import GRPOBatch
    from megatron_bubblespec.train.trainer import MegatronTrainer, TrainerConfig

    init_distributed(1, 1, seed=0)
    arch, tensors = load_checkpoint(path)
    model = build_gpt_model(arch, params_dtype=torch.float32)
    load_hf_weights(model, arch, tensors)
    trainer = MegatronTrainer(model, arch, TrainerConfig(lr=1e-3, micro_batch_size=2,
                                                          grpo=GRPOConfig()))
    g = torch.Generator().manual_seed(0)
    prompts = [[5, 9, 11], [6, 9, 12]]
    responses = [torch.randint(3, 200, (8,), generator=g).tolist() for _ in prompts]
    batch = GRPOBatch.from_responses(prompts, responses, [[-1.0] * 8 for _ in prompts],
                                     torch.tensor([1.0, -1.0]))
    trainer.train_step(batch)
    if offload:
        trainer.offload_training_state()
        assert all(not v.is_cuda for state in trainer._optimizer_states()
                   for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        trainer.restore_training_state()
    trainer.train_step(batch)
    weights = {k: t.detach().cpu().clone() for k, t in trainer.resharder().named_tensors()}
    destroy_distributed()
    return weights


@pytest.mark.slow   # starts a process
@pytest.mark.parametrize("switch", ["rollout.sleep_during_train=true",
                                    "train.offload_during_rollout=true"])
def test_the_gpu_memory_switches_are_refused_on_cpu(switch):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the switches are allowed")
    proc = subprocess.run([sys.executable, "-m", "megatron_bubblespec.cli", "train", "--config",
                           str(TINY), switch], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert switch.split("=")[0] in proc.stderr and "need CUDA" in proc.stderr
