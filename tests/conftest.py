"""Pytest hooks: tests marked ``gpu`` run only where torch sees a CUDA device; the tiny-config
runs (BubbleSpec on and off) that several test files compare against, made once per session."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
QUIET = ("logging.progress=false", "logging.plot=false", "logging.tensorboard=false")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory):
    """configs/tiny.yaml trained twice, BubbleSpec on and off (records, rollouts, final weights);
    run directories ``root/spec-on`` and ``root/spec-off``."""
    from megatron_bubblespec.config import load_config
    from megatron_bubblespec.loop.train import train

    root = tmp_path_factory.mktemp("tiny-runs")

    def run(name, *overrides):
        cfg = load_config(TINY, [f"run.output_dir={root}", f"run.name={name}", *QUIET, *overrides])
        return train(cfg, return_weights=True)

    return SimpleNamespace(root=root, on=run("spec-on"), off=run("spec-off", "spec.enabled=false"))
