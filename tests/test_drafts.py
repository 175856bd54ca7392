"""Draft packing, the DP all-gather exchange (its route per backend; over gloo here, over NCCL on
two GPUs), and the filters that drop bad drafts."""

import warnings
from unittest import mock

import pytest
import torch

from megatron_bubblespec.distributed import (destroy_distributed, init_distributed,
                                             init_process_group)
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.speculative import drafts as drafts_module
from megatron_bubblespec.speculative.drafts import (Draft, choose_route, data_parallel_gloo_twin, exchange,
                                             exchange_route, pack, select_drafts, unpack)

DRAFTS = [Draft(1, 0, -5, 3, (1, 2, 3)), Draft(2, 7, 2**62, 3, ()),
          Draft(1, 2, 9, 2, tuple(range(40)))]


def test_pack_round_trip():
    assert unpack(pack(DRAFTS)) == DRAFTS
    assert unpack(pack([])) == []


@pytest.mark.parametrize("mangle", [
    lambda t: t[:-5],                                     # truncated
    lambda t: torch.cat([t[:2], torch.tensor([-1]), t[3:]]),  # negative sample index
    lambda t: torch.cat([t[:1], torch.tensor([-1]), t[2:]]),  # negative step
    lambda t: torch.cat([t[:5], torch.tensor([10**6]), t[6:]]),  # absurd length
])
def test_malformed_packs_warn_and_keep_only_what_parses(mangle):
    with pytest.warns(UserWarning):
        out = unpack(mangle(pack(DRAFTS)))
    assert all(d in DRAFTS for d in out)


def test_garbage_never_raises():
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(200):
            size = int(torch.randint(0, 30, (1,), generator=g))
            assert isinstance(unpack(torch.randint(-50, 50, (size,), generator=g)), list)


def test_select_keeps_mine_and_drops_bad_ones():
    expected = {(1, 0): -5, (1, 2): 9, (1, 5): 11, (2, 0): 4}
    drafts = [Draft(1, 0, -5, 3, (1, 2, 3)),     # kept
              Draft(2, 0, 4, 3, (8,)),           # another step's sample 0: kept
              Draft(1, 7, 2**62, 3, (4,)),       # a sample nobody drafts: dropped
              Draft(1, 5, 12, 3, (1,)),          # wrong key: dropped
              Draft(1, 2, 9, 2, (1, 500)),       # token outside the vocabulary: dropped
              Draft(1, 0, -5, 3, (9,))]          # second draft for sample 0: dropped
    with pytest.warns(Warning) as caught:
        kept = select_drafts(drafts, expected, vocab_size=100, max_tokens=10)
    assert set(kept) == {(1, 0), (2, 0)} and kept[1, 0].tokens == (1, 2, 3)
    assert len(caught) == 4
    with pytest.warns(RuntimeWarning, match="truncated"):
        long = select_drafts([Draft(1, 2, 9, 2, (1, 2, 3) * 10)], expected, vocab_size=100,
                             max_tokens=10)
    assert long[1, 2].tokens == ((1, 2, 3) * 10)[:10]


def _exchange_worker():
    world = init_process_group(backend="gloo", timeout_s=60)
    route = exchange_route()
    out = exchange(_mine(world.rank))
    destroy_distributed()
    return route.device.type, out


@pytest.mark.slow
def test_exchange_over_three_gloo_ranks():
    assert all(res == ("cpu", _everyone(3)) for res in launch_local(_exchange_worker, 3))


def _mine(rank: int) -> list[Draft]:
    return [Draft(3 + i % 2, 10 * rank + i, rank, 1, tuple(range(rank + i)))
            for i in range(rank + 1)]


def _everyone(world: int) -> list[Draft]:
    return [d for r in range(world) for d in _mine(r)]


def test_route_per_backend():
    group, twin = object(), object()
    gloo = choose_route("gloo", group, twin)
    assert gloo.group is group and gloo.device.type == "cpu"
    mixed = choose_route("cpu:gloo,cuda:nccl", group, twin)      # a group with both backends
    assert mixed.group is group and mixed.device.type == "cpu"
    nccl = choose_route("nccl", group, twin)                      # CPU tensors on the gloo twin
    assert nccl.group is twin and nccl.device.type == "cpu"
    bare = choose_route("nccl", group, None)                      # no twin: device tensors
    assert bare.group is group and bare.device.type == "cuda"
    cuda_only = choose_route("cuda:nccl", group, None)
    assert cuda_only.device.type == "cuda"


def _twin_worker():
    """Megatron's DP=4 groups over gloo. The NCCL backend name is mocked (no NCCL on a CPU): the
    exchange must then run both of its all-gathers on megatron-core's gloo twin, with CPU tensors."""
    from megatron.core import parallel_state as ps

    world = init_distributed(1, 1, seed=0, backend="gloo", timeout_s=60)
    dp, twin = ps.get_data_parallel_group(), ps.get_data_parallel_group_gloo()
    pair = torch.distributed.new_group([0, 1])       # collective: every rank creates it
    found = {"twin_found": data_parallel_gloo_twin(dp) is twin,
             # a group with other ranks than the DP group's has no twin
             "pair_twin": data_parallel_gloo_twin(pair) if world.rank < 2 else None}
    calls = []
    real_all_gather = drafts_module.dist.all_gather

    def spy(tensors, tensor, group=None, **kw):
        calls.append((group is twin, tensor.device.type))
        return real_all_gather(tensors, tensor, group=group, **kw)

    with mock.patch.object(drafts_module.dist, "get_backend", return_value="nccl"), \
            mock.patch.object(drafts_module.dist, "all_gather", spy):
        route = exchange_route(dp)
        out = exchange(_mine(world.rank), group=dp)
    destroy_distributed()
    return {**found, "route": (route.group is twin, route.device.type), "calls": calls,
            "drafts": out}


@pytest.mark.slow
def test_nccl_route_uses_megatrons_gloo_twin():
    results = launch_local(_twin_worker, 4)
    for res in results:
        assert res["twin_found"] and res["route"] == (True, "cpu"), res
        assert res["calls"] == [(True, "cpu"), (True, "cpu")], res["calls"]
        assert res["drafts"] == _everyone(4)
    assert all(res["pair_twin"] is None for res in results)


def _nccl_worker(with_twin: bool):
    """Two GPUs over NCCL: the exchange through the gloo twin, or with device tensors."""
    import torch.distributed as dist

    if with_twin:
        from megatron.core import parallel_state as ps

        world = init_distributed(1, 1, seed=0, timeout_s=120)
        group = ps.get_data_parallel_group()
    else:
        world = init_process_group(timeout_s=120)
        group = None
    route = exchange_route(group)
    out = exchange(_mine(world.rank), group=group)
    backend = dist.get_backend(group)
    destroy_distributed()
    return backend, route.device.type, out


@pytest.mark.gpu
@pytest.mark.parametrize("with_twin", [True, False], ids=["gloo-twin", "device-tensors"])
def test_exchange_over_nccl(with_twin):
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank: two GPUs")
    for backend, device, out in launch_local(_nccl_worker, 2, with_twin):
        assert backend == "nccl"
        assert device == ("cpu" if with_twin else "cuda")
        assert out == _everyone(2)
