"""Trained policy -> the resharder's buckets (every rank) -> rank 0 writes HF safetensors shards (+ index) -> final/.

``export_final`` is collective: every rank of the job drives ``Resharder.buckets()`` (its TP
gathers and PP broadcasts need them all), and only global rank 0 keeps what comes out, one shard
at a time: a shard is written as soon as the next bucket's tensors would push it past
``shard_bytes``, so no rank ever holds more than one shard plus one bucket of full tensors
beside its own training shard. Small models give a single ``model.safetensors``; larger ones HF's
sharded layout, ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``. The
initial model's config and tokenizer files are copied next to them. The directory appears
complete or not at all (written as ``<name>.partial``, then renamed).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

DEFAULT_SHARD_BYTES = 5 * 10**9     # transformers' save_pretrained default (5GB)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = SINGLE_FILE + ".index.json"
SIDE_FILE_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")


@dataclass
class ExportStats:
    shards: list[int] = field(default_factory=list)     # bytes of each shard written
    tensors: int = 0

    @property
    def bytes(self) -> int:
        return sum(self.shards)


def _shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def write_shards(buckets: Iterable[list[tuple[str, torch.Tensor]]], directory: Path,
                 shard_bytes: int = DEFAULT_SHARD_BYTES) -> ExportStats:
    """(HF name, full tensor) buckets -> safetensors shards of at most ``shard_bytes`` (a larger
    tensor gets a shard of its own) in ``directory``; one file needs no index."""
    from safetensors.torch import save_file

    stats, shard, size, weight_map, parts = ExportStats(), {}, 0, {}, []

    def flush():
        nonlocal shard, size
        part = directory / f"part-{len(parts):05d}.safetensors"
        save_file(shard, str(part), metadata={"format": "pt"})
        parts.append((part, list(shard)))
        stats.shards.append(size)
        shard, size = {}, 0

    for bucket in buckets:
        for name, tensor in bucket:
            nbytes = tensor.numel() * tensor.element_size()
            if shard and size + nbytes > shard_bytes:
                flush()
            if name in shard or name in weight_map:
                raise ValueError(f"export: tensor {name!r} arrived twice")
            shard[name] = tensor.detach().to("cpu").contiguous()
            weight_map[name] = len(parts)
            size += nbytes
            stats.tensors += 1
    if shard or not parts:
        flush()
    if len(parts) == 1:
        os.replace(parts[0][0], directory / SINGLE_FILE)
        return stats
    names = [_shard_name(k + 1, len(parts)) for k in range(len(parts))]
    for (part, _), name in zip(parts, names):
        os.replace(part, directory / name)
    index = {"metadata": {"total_size": stats.bytes},
             "weight_map": {tensor: names[k] for tensor, k in sorted(weight_map.items())}}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return stats


def copy_side_files(source: Path, directory: Path) -> None:
    """The initial model's config, generation config and tokenizer files (not its weight index)."""
    for path in source.iterdir():
        if path.is_file() and path.suffix in SIDE_FILE_SUFFIXES and path.name != INDEX_FILE \
                and not path.name.endswith(".index.json"):
            shutil.copy2(path, directory / path.name)


class ExportedWeights(Mapping):
    """The tensors of an exported directory, read one at a time from its files on access (cheap
    to keep and to pickle: it holds names and file paths, never the tensors; it reads the files
    as they are when a tensor is asked for)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        from megatron_bubblespec.models.architecture import weight_files

        self.directory = Path(directory)
        self.files: dict[str, Path] = {}
        for path in weight_files(self.directory, []):
            with safe_open(str(path), framework="pt") as f:
                self.files.update(dict.fromkeys(f.keys(), path))

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def export_final(replica, directory: Path,
                 shard_bytes: int = DEFAULT_SHARD_BYTES) -> ExportedWeights | None:
    """The trained policy as an HF checkpoint directory (collective; global rank 0 writes and
    returns the exported tensors as an ``ExportedWeights`` mapping, the other ranks None)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        replica.resharder.sync(None)   # the gathers and broadcasts need every rank
        return None
    buckets = replica.resharder.buckets()
    directory = Path(directory)
    staging = directory.with_name(directory.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write_shards(buckets, staging, shard_bytes)
    copy_side_files(Path(replica.model_path), staging)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(staging, directory)
    return ExportedWeights(directory)
