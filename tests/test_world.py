"""Process world detection from torchrun / Slurm variables, and the CPU stand-ins for megatron's CUDA calls."""

import pytest
import torch

from megatron_bubblespec.distributed import detect_world, init_distributed, megatron_cpu_mode
from megatron_bubblespec.distributed.world import WorldInfo


def test_torchrun_variables_win():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node7",
           "MASTER_PORT": "1234", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    assert detect_world(env) == WorldInfo(3, 8, 1, "node7", 1234, "torchrun")


def test_slurm_variables_without_torchrun():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2", "SLURM_JOB_ID": "41",
           "MASTER_ADDR": "10.0.0.1"}
    assert detect_world(env) == WorldInfo(5, 6, 2, "10.0.0.1", 20041, "slurm")


def test_slurm_unresolvable_first_node_falls_back_to_loopback():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "no-such-node-xyz[1-2]"}
    assert detect_world(env).master_addr == "127.0.0.1"


def test_single_process_default():
    assert detect_world({}) == WorldInfo(0, 1, 0, "127.0.0.1", 29500, "single")


def test_indivisible_parallel_sizes_are_refused_before_any_group_starts():
    with pytest.raises(ValueError, match="tensor_parallel x context_parallel x pipeline_parallel = 2 x 1 x 2"):
        init_distributed(2, 2, world=WorldInfo(0, 6, 0, "127.0.0.1", 1, "single"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU stand-ins apply only without a GPU")
def test_cuda_placements_land_on_cpu_inside_megatron_mode():
    with megatron_cpu_mode():
        x = torch.zeros(3, device="cuda")
        y = torch.ones(2).cuda()
        z = torch.ones(2).to("cuda")
        assert {x.device.type, y.device.type, z.device.type} == {"cpu"}
        assert x.type() == "torch.cuda.FloatTensor"
        assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
        torch.cuda.synchronize()
    assert torch.zeros(1).type() == "torch.FloatTensor"  # the mode ends with the context
