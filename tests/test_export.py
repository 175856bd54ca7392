"""The final HF export: every rank drives the resharder (PP=2 over gloo, so the stage-1 tensors
reach rank 0 by broadcast), only global rank 0 writes, in shards of at most the shard size (a
sharded index when the size is small), and the directory reloads to the model's own tensors."""

import json
import pickle
from types import SimpleNamespace

import pytest
import torch

from megatron_bubblespec.distributed import destroy_distributed, init_distributed, megatron_cpu_mode
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.models.architecture import load_checkpoint
from megatron_bubblespec.train import export
from megatron_bubblespec.train.model import build_gpt_model
from megatron_bubblespec.train.reshard import Resharder
from megatron_bubblespec.train.sharding import load_hf_weights

SMALL_SHARD = 80 << 10           # above the largest tensor (the 64 kB embedding), ~1/7 of the model


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen2", vocab_size=250, num_layers=4)


def _export_worker(path, out_root):
    """Each rank passes its own target directory, so a write by rank 1 would show."""
    world = init_distributed(1, 2, seed=0)
    arch, tensors = load_checkpoint(path)
    with megatron_cpu_mode():
        model = build_gpt_model(arch)
        load_hf_weights(model, arch, tensors)
    replica = SimpleNamespace(resharder=Resharder(model, arch, bucket_bytes=16 << 10),
                              model_path=path)
    written = []
    real_write = export.write_shards

    def spy(*args, **kwargs):
        stats = real_write(*args, **kwargs)
        written.append(stats.shards)
        return stats

    export.write_shards = spy
    results = {}
    for name, shard_bytes in (("sharded", SMALL_SHARD), ("single", export.DEFAULT_SHARD_BYTES)):
        out = export.export_final(replica, out_root / f"rank{world.rank}" / name, shard_bytes)
        results[name] = None if out is None else pickle.dumps(out)
    destroy_distributed()
    return results, written


@pytest.mark.slow
def test_export_on_rank_zero_only_sharded_and_reloads(checkpoint, tmp_path):
    _, original = load_checkpoint(checkpoint)
    ranks = launch_local(_export_worker, 2, checkpoint, tmp_path)
    (zero, zero_shards), (one, one_shards) = ranks
    assert one == {"sharded": None, "single": None} and one_shards == []
    assert not (tmp_path / "rank1").exists(), "rank 1 wrote files"
    sharded_sizes, single_sizes = zero_shards
    assert len(sharded_sizes) >= 4 and max(sharded_sizes) <= SMALL_SHARD, sharded_sizes
    assert len(single_sizes) == 1

    sharded, single = tmp_path / "rank0" / "sharded", tmp_path / "rank0" / "single"
    index = json.loads((sharded / export.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{k:05d}-of-{len(files):05d}.safetensors"
                     for k in range(1, len(files) + 1)]
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == files
    assert index["metadata"]["total_size"] == sum(sharded_sizes)
    assert (single / export.SINGLE_FILE).is_file() and not (single / export.INDEX_FILE).exists()
    assert not list(tmp_path.glob("rank0/*.partial"))
    for directory, returned in ((sharded, zero["sharded"]), (single, zero["single"])):
        assert (directory / "config.json").is_file()
        _, back = load_checkpoint(directory)
        weights = pickle.loads(returned)
        assert set(back) == set(original) == set(weights)
        for name, tensor in original.items():
            assert torch.equal(back[name], tensor), name
            assert torch.equal(weights[name], tensor), name


def test_write_shards_refuses_a_name_twice(tmp_path):
    bucket = [("a", torch.zeros(2)), ("a", torch.ones(2))]
    with pytest.raises(ValueError, match="'a' arrived twice"):
        export.write_shards([bucket], tmp_path)
