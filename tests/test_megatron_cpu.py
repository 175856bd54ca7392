"""megatron-core on CPU over gloo: a tiny Llama-style GPTModel trains forward+backward, and TP=2,
PP=2 and TP=2 x PP=2 give the TP=1 loss and gradients."""

from types import SimpleNamespace

import pytest
import torch

from megatron_bubblespec.distributed import (
    destroy_distributed,
    init_distributed,
    megatron_cpu_mode,
    megatron_config_overrides,
)
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.train.sharding import global_layer_names, load_full_state_dict, tp_shard

pytestmark = pytest.mark.slow   # multi-process or real-model runs: minutes on 2 cores

VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES = 128, 16, 2, 2


def _build_model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32,
        ffn_hidden_size=128, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        **megatron_config_overrides())
    from megatron.core import parallel_state as ps
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())


def _micro_batches():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCHES, MICRO_BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _train_step(model):
    """One pipeline-scheduled forward+backward; returns the token-mean loss (last stage) or None."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        positions = torch.arange(SEQ).expand_as(tokens)
        per_token = model(tokens, positions, None, labels=labels)

        def loss_func(output):
            total, count = output.sum(), torch.tensor(output.numel(), dtype=torch.int)
            return total, count, {"loss": torch.stack([total.detach(), count.float()])}

        return per_token, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(_micro_batches()), model=[model],
        num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
    if not ps.is_pipeline_last_stage():
        return None
    total = torch.stack([d["loss"] for d in losses]).sum(0)
    return float(total[0] / total[1])


def _reference_worker():
    init_distributed(1, 1, seed=1234)
    with megatron_cpu_mode():
        model = _build_model()
        full = {name: p.detach().clone() for name, p in model.named_parameters()}
        loss = _train_step(model)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    destroy_distributed()
    return full, loss, grads


def _parallel_worker(tp, pp, full):
    from megatron.core import parallel_state as ps

    init_distributed(tp, pp, seed=999)  # a different seed: every weight must come from ``full``
    with megatron_cpu_mode():
        model = _build_model()
        tp_rank = ps.get_tensor_model_parallel_rank()
        load_full_state_dict(model, full, tp_rank, tp)
        loss = _train_step(model)
    names = global_layer_names(model)
    grads = [(names[n], tp_rank, SimpleNamespace(
                  tensor_model_parallel=getattr(p, "tensor_model_parallel", False),
                  partition_dim=getattr(p, "partition_dim", 0),
                  partition_stride=getattr(p, "partition_stride", 1)), p.grad.clone())
             for n, p in model.named_parameters()]
    destroy_distributed()
    return loss, grads


@pytest.fixture(scope="module")
def reference():
    return launch_local(_reference_worker, 1)[0]


def test_tiny_gpt_forward_backward_on_cpu(reference):
    _, loss, grads = reference
    assert 4.0 < loss < 6.0  # ~log(128) for a random model
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert all(float(g.abs().sum()) > 0 for g in grads.values())


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_tensor_and_pipeline_parallel_match_single_process(reference, tp, pp):
    full, ref_loss, ref_grads = reference
    results = launch_local(_parallel_worker, tp * pp, tp, pp, full)
    losses = [loss for loss, _ in results if loss is not None]
    assert len(losses) == tp  # one per last-stage rank
    for loss in losses:
        assert loss == pytest.approx(ref_loss, rel=1e-6, abs=0)
    covered = set()
    for _, grads in results:
        for name, tp_rank, attrs, grad in grads:
            want = tp_shard(ref_grads[name], attrs, tp_rank, tp)
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7, msg=name)
            covered.add(name)
    assert covered == set(ref_grads)  # every parameter was compared on some rank
