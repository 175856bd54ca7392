"""Pytest hooks and shared fixtures: ``gpu`` tests only where CUDA is; an unmarked test that
starts a process or a vLLM engine fails (it belongs to the ``slow`` tier); tiny checkpoints and the
tiny-config runs (BubbleSpec on and off), made once per session."""

import contextlib
import functools
import multiprocessing.process
import subprocess
import time
from pathlib import Path

import pytest
import torch

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
QUIET = ("logging.progress=false", "logging.plot=false", "logging.tensorboard=false")


class _SlowWork(RuntimeError):
    pass


def _forbid(what: str):
    def refuse(*_args, **_kwargs):
        raise _SlowWork(f"this test {what} but is not marked slow: mark it @pytest.mark.slow "
                        "(make test-fast runs only the tests that take seconds)")
    return refuse


# Programs that answer in milliseconds: a quick test may ask them about the machine.
CHEAP_PROGRAMS = {"lscpu", "nproc", "uname", "hostname", "getconf", "free", "scontrol", "git",
                  "nvidia-smi"}


def _popen_guard(original):
    def popen(self, args, *rest, **kwargs):
        argv = [args] if isinstance(args, (str, bytes, Path)) else list(args)
        program = Path(str(argv[0]).split()[0]).name if argv else ""
        if program not in CHEAP_PROGRAMS:
            _forbid(f"starts a process ({program})")()
        original(self, args, *rest, **kwargs)
    return popen


def _guarded():
    """(owner, attribute, replacement) for everything a quick test may not start."""
    from megatron_bubblespec.rollout import vllm_engine

    return [(multiprocessing.process.BaseProcess, "start",
             _forbid("starts a process (multiprocessing)")),
            (subprocess.Popen, "__init__", _popen_guard(subprocess.Popen.__init__)),
            (vllm_engine.VLLMEngine, "__init__", _forbid("starts a vLLM engine"))]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _fast_tier_rule(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _fast_tier_rule(item):
        yield


@contextlib.contextmanager
def _fast_tier_rule(item):
    """The quick tier's rule, checked rather than remembered: a test without the ``slow`` (or
    ``gpu``) mark may not start a process or a vLLM engine, in its body or in any fixture it sets
    up (session-scoped ones included)."""
    if item.get_closest_marker("slow") or item.get_closest_marker("gpu"):
        yield
        return
    guarded = _guarded()
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in guarded]
    for owner, name, replacement in guarded:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


class TinyRuns:
    """configs/tiny.yaml trained twice, BubbleSpec on and off (records, rollouts, final weights;
    run directories ``root/spec-on`` and ``root/spec-off``), and, when a test first asks for it,
    the off run with draws keyed by their last 2 tokens (``context_off``, ``root/context2-off``)."""

    def __init__(self, root: Path):
        self.root = root
        self.on = self.run("spec-on")
        self.off = self.run("spec-off", "spec.enabled=false")

    def run(self, name, *overrides):
        from megatron_bubblespec.config import load_config
        from megatron_bubblespec.loop.train import train

        cfg = load_config(TINY, [f"run.output_dir={self.root}", f"run.name={name}", *QUIET,
                                 *overrides])
        return train(cfg, return_weights=True)

    @functools.cached_property
    def context_off(self):
        return self.run("context2-off", "rollout.keying=context2", "spec.enabled=false")


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory):
    return TinyRuns(tmp_path_factory.mktemp("tiny-runs"))


def load_script(name: str):
    """``scripts/<name>.py`` as a module (scripts are not a package), for testing its functions."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A factory of tiny random HF checkpoints written by transformers, one per distinct
    (family, shape), shared by every test of the session: ``tiny_checkpoint("llama", vocab_size=64)``."""
    from megatron_bubblespec.models.architecture import make_tiny_checkpoint

    made: dict[tuple, Path] = {}

    def make(family: str = "llama", **shape) -> Path:
        key = (family, tuple(sorted(shape.items())))
        if key not in made:
            made[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{family}"), family,
                                             **shape)
        return made[key]

    return make


def assert_on_off_identical(on: dict, off: dict, label: str, steps: int,
                            rejected: bool = True) -> None:
    """Two ``train(..., return_weights=True)`` results, BubbleSpec on and off: drafts accepted
    (and, with ``rejected``, some rejected) in the on run, none in the off run, and the same
    tokens, and per step the learner's inputs, losses and weights (their fingerprints), and the
    same final weights."""
    drafted = sum(r["spec/drafted_tokens"] for r in on["records"])
    accepted = sum(r["spec/accepted_tokens"] for r in on["records"])
    assert 0 < accepted, f"{label}: no draft token was accepted ({drafted} drafted)"
    assert accepted < drafted or not rejected, \
        f"{label}: drafts must be both accepted and rejected ({accepted} of {drafted} accepted)"
    assert all(r["spec/drafted_tokens"] == 0 for r in off["records"])
    assert len(on["rollouts"]) == len(off["rollouts"]) == steps
    for step, (a, b) in enumerate(zip(on["rollouts"], off["rollouts"])):
        assert a == b, f"{label}, step {step}: rollout tokens differ between BubbleSpec on and off"
    for step, (a, b) in enumerate(zip(on["records"], off["records"])):
        for name in ("exact/batch_hash", "exact/state_hash", "train/loss"):
            assert a[name] == b[name], f"{label}, step {step}: {name} differs between on and off"
    assert set(on["weights"]) == set(off["weights"])
    for name, tensor in on["weights"].items():
        assert torch.equal(tensor, off["weights"][name]), f"{label}: final {name} differs"


class OtherEngineArrives:
    """A real engine inside a bubble, recording how many requests each engine step took on; the
    step's other engine arrives at the barrier (in the one store), last, and closes it: after
    ``steps`` engine steps, or (``steps=None``) once this engine has nothing left to run."""

    def __init__(self, engine, store, step: int, steps: int | None = None):
        self.engine, self.store, self.step_, self.steps = engine, store, step, steps
        self.added, self.per_step = 0, []

    def add(self, requests, params):
        requests = list(requests)
        self.added += len(requests)
        self.engine.add(requests, params)

    def step(self):
        self.per_step.append(self.added)
        self.added = 0
        finished = self.engine.step()
        if (len(self.per_step) == self.steps
                or self.steps is None and not self.engine.has_unfinished()):
            self.store.add(f"bubblespec/arrive/{self.step_}", 1)
            self.store.set(f"bubblespec/closed/{self.step_}", repr(time.time()))
        return finished

    def __getattr__(self, name):
        return getattr(self.engine, name)
