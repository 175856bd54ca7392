"""Megatron-core on CPU: megatron's CUDA calls -> CPU equivalents, in process, only when no GPU exists.

megatron-core assumes CUDA in a few dozen places. On a machine without a GPU we neutralise them
without touching megatron's files:

* ``torch.cuda.current_device()`` returns the CPU device (used for ~175 allocations);
* the CUDA RNG state of megatron's RNG tracker is the CPU generator's state (per-TP-rank dropout
  streams keep working);
* ``torch.cuda.synchronize``, ``Event`` and ``current_stream`` become no-op stand-ins;
* inside ``megatron_cpu_mode()`` a ``TorchFunctionMode`` rewrites ``device="cuda"`` and
  ``.cuda()`` to the CPU, and makes ``Tensor.type()`` report ``torch.cuda.*`` names (grad clipping
  and the optimizers check them). It costs a few ms per training step, so it is entered around
  Megatron calls only, never around rollout engines.

Without Transformer Engine (on CPU, or a GPU without it) ``apply_no_te_shims`` binds the one TE
name megatron's MoE router references unguarded, so the router computes with plain torch.

Build models with ``use_cpu_initialization=True`` and ``batch_p2p_sync=False`` (see
``device_config_overrides``); sequence parallelism needs apex/TE and stays off on CPU.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_PATCHED = False


def cuda_missing() -> bool:
    return not torch.cuda.is_available()


class _NoOpEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _NoOpStream:
    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _NoOpEvent()


def apply_cpu_patches() -> bool:
    """Install the process-wide stand-ins (idempotent). Returns True when they are active."""
    global _PATCHED
    if not cuda_missing():
        return False
    if _PATCHED:
        return True
    from megatron.core.tensor_parallel import random as mp_random

    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Event = _NoOpEvent
    torch.cuda.current_stream = lambda *a, **k: _NoOpStream()
    torch.cuda.default_stream = lambda *a, **k: _NoOpStream()
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    mp_random._get_cuda_rng_state = lambda *a, clone=False, **k: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state())
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _PATCHED = True
    return True


def apply_no_te_shims() -> None:
    """Without Transformer Engine, bind ``te_general_gemm`` to None in megatron's MoE utilities:
    its import fails there, leaving the name unbound although the router's gating checks it
    (``NameError``); None selects the plain torch path. Idempotent; nothing changes with TE."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA placements issued by megatron-core to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE_NAMES.get(args[0].dtype, func(*args))
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def megatron_cpu_mode():
    """Run Megatron code on CPU (a no-op context when CUDA is present)."""
    if not apply_cpu_patches():
        yield
        return
    with _CudaToCpu():
        yield


def device_config_overrides() -> dict:
    """TransformerConfig fields that megatron-core needs on this device."""
    if cuda_missing():
        return {"use_cpu_initialization": True, "batch_p2p_sync": False}
    return {}
