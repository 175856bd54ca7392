"""Context parallelism of the training model: refused without Transformer Engine on CUDA (CPU
here, with real CP groups over gloo), the load-balanced sequence split and its inverse over a real
CP group, and on two GPUs (``gpu``): the CP=2 forward gives the CP=1 logits, the Megatron
verifier, which reads whole sequences gathered over CP, gives the same result on every CP rank as
without CP, and a CP=2 train step gives the CP=1 loss, grad norm and logprobs."""

import pytest
import torch

from megatron_bubblespec.distributed import (apply_cpu_patches, destroy_distributed,
                                             init_process_group, megatron_cpu_mode)
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.models.architecture import load_checkpoint
from megatron_bubblespec.train.forward import (context_parallel_gather, context_parallel_split,
                                               megatron_forward, pad_for_context_parallel)
from megatron_bubblespec.train.model import build_gpt_model
from megatron_bubblespec.train.sharding import load_hf_weights

VOCAB = 250


def _init(context_parallel: int, backend: str | None = None) -> None:
    """The default group and Megatron's groups with CP (the launcher-level ``init_distributed``
    takes TP and PP only)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    init_process_group(backend=backend, timeout_s=120)
    apply_cpu_patches()
    with megatron_cpu_mode():
        ps.initialize_model_parallel(context_parallel_size=context_parallel)
        tensor_parallel.model_parallel_cuda_manual_seed(0)


def _refusal_worker(path):
    _init(2, backend="gloo")
    arch, _ = load_checkpoint(path)
    try:
        with megatron_cpu_mode():
            build_gpt_model(arch)
        message = None
    except ValueError as err:
        message = str(err)
    destroy_distributed()
    return message


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama", vocab_size=VOCAB, num_layers=2)


@pytest.mark.slow
def test_context_parallel_is_refused_without_cuda(checkpoint):
    if torch.cuda.is_available():
        pytest.skip("this machine can run context parallelism")
    for message in launch_local(_refusal_worker, 2, checkpoint):
        assert message is not None and message.startswith("parallel.context=2: "), message
        assert "Transformer Engine" in message and "set parallel.context=1" in message


def _split_worker():
    from megatron.core import parallel_state as ps

    _init(2, backend="gloo")
    tokens = torch.arange(2 * 7).view(2, 7)
    padded = pad_for_context_parallel(tokens, sequence_parallel=False)
    local_tokens, local_values = context_parallel_split(padded, padded.float() * 10)
    whole = context_parallel_gather(local_values)
    out = (ps.get_context_parallel_rank(), padded, local_tokens, whole)
    destroy_distributed()
    return out


@pytest.mark.slow
def test_split_and_gather_over_a_context_parallel_group():
    for rank, padded, local, whole in launch_local(_split_worker, 2):
        assert padded.shape == (2, 8) and torch.equal(padded[:, 7], torch.zeros(2, dtype=torch.long))
        # 4 chunks of 2 positions: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
        positions = [[0, 1, 6, 7], [2, 3, 4, 5]][rank]
        assert torch.equal(local, padded[:, positions]), (rank, local)
        assert torch.equal(whole, padded.float() * 10)


# ------------------------------------------------------------------------------ two GPUs

def _fp32_model(path, context_parallel):
    """The checkpoint as an fp32 model (no TF32) under CP = ``context_parallel`` over NCCL."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    _init(context_parallel)
    arch, tensors = load_checkpoint(path)
    model = build_gpt_model(arch)
    load_hf_weights(model, arch, tensors)
    return arch, model


def _forward_worker(path, context_parallel):
    """fp32 Transformer Engine model, CP = 1 or 2 over NCCL: whole-sequence logits (gathered
    over CP) of an odd-length batch, and the verifier's result on drafts of it."""
    from megatron_bubblespec.sampling import SamplingParams, sample_key
    from megatron_bubblespec.sampling.requests import RolloutRequest
    from megatron_bubblespec.speculative.megatron_verifier import MegatronVerifier

    arch, model = _fp32_model(path, context_parallel)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (4, 37), generator=g)
    (logits,) = megatron_forward(model, tokens, lambda out, rows: out[..., :VOCAB].float().cpu())
    requests = [RolloutRequest(f"r{i}", tokens[i, :9].tolist(), sample_key(1, 0, i, 0), 28)
                for i in range(4)]
    drafts = [tokens[i, 9:9 + 8 * (i + 1) // 2].tolist() for i in range(4)]
    result = MegatronVerifier(model, arch, SamplingParams(1.0)).verification(requests, drafts)
    destroy_distributed()
    return logits, (result.accepted.tolist(), result.next_token.tolist())


@pytest.mark.gpu
def test_context_parallel_forward_and_verifier_match_no_context_parallelism(checkpoint):
    pytest.importorskip("transformer_engine", reason="context parallelism needs Transformer Engine")
    if torch.cuda.device_count() < 2:
        pytest.skip("CP=2 needs two GPUs (NCCL allows one rank per GPU)")
    base_logits, base_verdict = launch_local(_forward_worker, 1, checkpoint, 1)[0]
    for logits, verdict in launch_local(_forward_worker, 2, checkpoint, 2):
        torch.testing.assert_close(logits, base_logits, rtol=0, atol=2e-4)
        assert verdict == base_verdict


def _train_worker(path, context_parallel):
    """One GRPO step of the fp32 TE model at CP = 1 or 2: loss, grad norm, pre-update logprobs."""
    from megatron_bubblespec.train.batch import GRPOBatch
    from megatron_bubblespec.train.trainer import MegatronTrainer, TrainerConfig

    arch, model = _fp32_model(path, context_parallel)
    trainer = MegatronTrainer(model, arch, TrainerConfig(lr=1e-4, micro_batch_size=2))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (5,), generator=g).tolist() for _ in range(4)]
    responses = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 16, 4, 12)]
    batch = GRPOBatch.from_responses(prompts, responses, [[-1.0] * len(r) for r in responses],
                                     torch.tensor([1.0, -1.0, 0.5, -0.5]))
    metrics, step_logprobs, _ = trainer.train_step(batch)
    after = trainer.logprobs(batch.tokens, batch.response_mask)
    destroy_distributed()
    return metrics["train/loss"], metrics["train/grad_norm"], step_logprobs, after


@pytest.mark.gpu
def test_context_parallel_train_step_matches_no_context_parallelism(checkpoint):
    pytest.importorskip("transformer_engine", reason="context parallelism needs Transformer Engine")
    if torch.cuda.device_count() < 2:
        pytest.skip("CP=2 needs two GPUs (NCCL allows one rank per GPU)")
    loss, norm, before, after = launch_local(_train_worker, 1, checkpoint, 1)[0]
    for cp_loss, cp_norm, cp_before, cp_after in launch_local(_train_worker, 2, checkpoint, 2):
        assert cp_loss == pytest.approx(loss, abs=1e-5)
        assert cp_norm == pytest.approx(norm, rel=1e-4)
        torch.testing.assert_close(cp_before, before, rtol=0, atol=2e-4)
        torch.testing.assert_close(cp_after, after, rtol=0, atol=2e-4)
