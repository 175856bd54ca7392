"""The resharder re-checks the weights manifest (names, shapes, dtypes agreed by every rank at
start) before every transfer: a parameter whose dtype or shape changed, or that was replaced by
another tensor object, fails the transfer with a message instead of sending what the engine does
not expect."""

import pytest
import torch

from megatron_bubblespec.distributed import destroy_distributed, init_distributed, megatron_cpu_mode
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.models.architecture import load_checkpoint
from megatron_bubblespec.train.model import build_gpt_model
from megatron_bubblespec.train.reshard import Resharder
from megatron_bubblespec.train.sharding import load_hf_weights


pytestmark = pytest.mark.slow


def _manifest_worker(path):
    init_distributed(1, 1, seed=0)
    arch, tensors = load_checkpoint(path)
    with megatron_cpu_mode():
        model = build_gpt_model(arch)
        load_hf_weights(model, arch, tensors)
    resharder = Resharder(model, arch)
    outcomes = {"intact": len(list(resharder.named_tensors()))}
    name, param = next(iter(model.named_parameters()))
    original = param.data
    for change, tensor in (("dtype", original.double()), ("shape", original[:-1])):
        param.data = tensor
        try:
            list(resharder.named_tensors())
            outcomes[change] = "sent"
        except RuntimeError as err:
            outcomes[change] = str(err)
        param.data = original
    outcomes["restored"] = len(list(resharder.named_tensors()))
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, torch.nn.Parameter(original.clone()))
    try:
        list(resharder.named_tensors())
        outcomes["replaced"] = "sent"
    except RuntimeError as err:
        outcomes["replaced"] = str(err)
    destroy_distributed()
    return name, outcomes


def test_a_changed_or_replaced_parameter_fails_the_transfer(tiny_checkpoint):
    path = tiny_checkpoint("llama", vocab_size=128, num_layers=2)
    name, outcomes = launch_local(_manifest_worker, 1, path)[0]
    assert outcomes["intact"] == outcomes["restored"] > 0
    for change in ("dtype", "shape"):
        assert "manifest changed" in outcomes[change] and name in outcomes[change], outcomes
    assert "were replaced" in outcomes["replaced"] and name in outcomes["replaced"], outcomes
