"""Scaled logits + keys + positions + noise bounds -> C++ scan -> each row's candidate tokens + words.

The integer part of ``sampling.keyed`` (the row words and the token word h of its docstring) in C++,
fused with the pruning scan of ``sampling.keyed_draw``: one pass over each row, built on first use
with ``torch.utils.cpp_extension.load_inline`` into ``cache_dir("kernels", ...)`` (a directory
per source, torch version and CPU, so a shared cache never serves another CPU's build). No float
noise is computed here: the caller turns the returned words into u and g with the torch operations
every other draw uses; the scan only reads a table of bounds on g per bucket of words.

The scan, per row (OpenMP over rows through ``at::parallel_for``), in blocks of 256 tokens:

* a block whose largest scaled logit x plus the largest bound cannot reach the bar is skipped,
  and so is a block of -inf only;
* otherwise h is computed for its tokens, and with the bucket ``b = h >> shift`` the upper bound
  ``up = x + bounds[1, b]`` (the caller's table must hold ``bounds[0, b] <= g <= bounds[1, b]``
  for every word of bucket b, as computed in the logits' dtype). A token whose up reaches the bar
  is kept, and its ``lo = x + bounds[0, b]`` raises the bar (the largest lo so far);
* at the end, the kept tokens whose up is below the final bar are dropped.

Every token whose exact score reaches the row's best lo is kept (float addition is monotone), the
argmax among them included, with every token tied with it. A row of -inf only returns token 0
(``torch.argmax``'s choice); a row holding a NaN is flagged and returns nothing.

``backend()`` says which path the draw takes: ``"c++"``, or ``"torch"`` with the reason the build
failed (no compiler, no ninja, ...), after which the draw runs on the torch operations.
"""

from __future__ import annotations

import hashlib
import platform
import warnings
from pathlib import Path

import torch

from megatron_bubblespec.cache import cache_dir

BLOCK = 256

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kBlock = BLOCK_SIZE;
constexpr int kLanes = 8;

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

struct Kept {
  std::vector<int64_t> ids;
  std::vector<int64_t> words;
  bool nan = false;
};

template <typename T>
void scan_row(const T* x, int64_t width, uint32_t r1, uint32_t r2, const T* lo_bound,
              const T* up_bound, int shift, T g_max, Kept& out) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  T bar = neg_inf;
  std::vector<T> ups;
  uint32_t h[kBlock];
  T up[kBlock];
  for (int64_t start = 0; start < width; start += kBlock) {
    const int64_t n = std::min(kBlock, width - start);
    const T* xb = x + start;
    // The block's largest x and whether it holds a NaN, in kLanes independent lanes (vectorised).
    T lane[kLanes];
    bool bad[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      lane[l] = neg_inf;
      bad[l] = false;
    }
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const T v = xb[j + l];
        lane[l] = v > lane[l] ? v : lane[l];
        bad[l] |= v != v;
      }
    }
    T top = neg_inf;
    bool nan = false;
    for (; j < n; ++j) {
      top = xb[j] > top ? xb[j] : top;
      nan |= xb[j] != xb[j];
    }
    for (int l = 0; l < kLanes; ++l) {
      top = lane[l] > top ? lane[l] : top;
      nan |= bad[l];
    }
    if (nan) {
      out.ids.clear();
      out.words.clear();
      out.nan = true;
      return;
    }
    if (top == neg_inf || top + g_max < bar) continue;
    for (int64_t i = 0; i < n; ++i) {
      h[i] = mix32(mix32(static_cast<uint32_t>(start + i) ^ r1) + r2);
    }
    for (int64_t i = 0; i < n; ++i) up[i] = xb[i] + up_bound[h[i] >> shift];
    for (int64_t i = 0; i < n; ++i) {
      if (up[i] >= bar) {   // lo <= up: only such a token can raise the bar
        const T lo = xb[i] + lo_bound[h[i] >> shift];
        bar = lo > bar ? lo : bar;
        out.ids.push_back(start + i);
        out.words.push_back(h[i]);
        ups.push_back(up[i]);
      }
    }
  }
  if (bar == neg_inf) {   // -inf only: every score is -inf, torch.argmax takes token 0
    out.ids.assign(1, 0);
    out.words.assign(1, mix32(mix32(r1) + r2));
    return;
  }
  size_t kept = 0;
  for (size_t i = 0; i < ups.size(); ++i) {
    if (ups[i] >= bar) {
      out.ids[kept] = out.ids[i];
      out.words[kept] = out.words[i];
      ++kept;
    }
  }
  out.ids.resize(kept);
  out.words.resize(kept);
}

}  // namespace

std::vector<torch::Tensor> keyed_scan(torch::Tensor scores, torch::Tensor keys,
                                      torch::Tensor positions, torch::Tensor bounds,
                                      int64_t shift, double g_max) {
  TORCH_CHECK(scores.dim() == 2 && scores.is_contiguous() && scores.device().is_cpu(),
              "scores: a contiguous CPU [N, V] tensor");
  TORCH_CHECK(bounds.scalar_type() == scores.scalar_type() && bounds.is_contiguous() &&
              bounds.dim() == 2 && bounds.size(0) == 2 &&
              bounds.size(1) == (int64_t(1) << (32 - shift)),
              "bounds: [2, 2**(32 - shift)] in the scores' dtype");
  const int64_t rows = scores.size(0), width = scores.size(1);
  TORCH_CHECK(keys.numel() == rows && positions.numel() == rows, "one key and position per row");
  auto k = keys.to(torch::kInt64).contiguous();
  auto p = positions.to(torch::kInt64).contiguous();
  const int64_t* kp = k.data_ptr<int64_t>();
  const int64_t* pp = p.data_ptr<int64_t>();
  std::vector<Kept> kept(rows);
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "keyed_scan", [&] {
    const scalar_t* x = scores.data_ptr<scalar_t>();
    const scalar_t* lo = bounds.data_ptr<scalar_t>();
    const scalar_t* up = lo + bounds.size(1);
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const uint64_t key = static_cast<uint64_t>(kp[r]);
        const uint32_t k_lo = static_cast<uint32_t>(key), k_hi = static_cast<uint32_t>(key >> 32);
        const uint32_t a = mix32(k_lo ^ mix32(k_hi ^ 0x9E3779B9u));
        const uint32_t r1 = mix32(a ^ mix32(static_cast<uint32_t>(pp[r]) ^ 0x85EBCA6Bu));
        const uint32_t r2 = mix32(r1 ^ 0xC2B2AE35u);
        scan_row<scalar_t>(x + r * width, width, r1, r2, lo, up, static_cast<int>(shift),
                           static_cast<scalar_t>(g_max), kept[r]);
      }
    });
  });
  int64_t total = 0;
  for (const auto& row : kept) total += static_cast<int64_t>(row.ids.size());
  auto opts = torch::TensorOptions().dtype(torch::kInt64);
  auto out_rows = torch::empty({total}, opts), out_ids = torch::empty({total}, opts);
  auto out_words = torch::empty({total}, opts);
  auto nan_rows = torch::zeros({rows}, torch::TensorOptions().dtype(torch::kBool));
  int64_t* orow = out_rows.data_ptr<int64_t>();
  int64_t* oid = out_ids.data_ptr<int64_t>();
  int64_t* oword = out_words.data_ptr<int64_t>();
  bool* onan = nan_rows.data_ptr<bool>();
  int64_t at = 0;
  for (int64_t r = 0; r < rows; ++r) {
    onan[r] = kept[r].nan;
    std::fill(orow + at, orow + at + kept[r].ids.size(), r);
    std::copy(kept[r].ids.begin(), kept[r].ids.end(), oid + at);
    std::copy(kept[r].words.begin(), kept[r].words.end(), oword + at);
    at += static_cast<int64_t>(kept[r].ids.size());
  }
  return {out_rows, out_ids, out_words, nan_rows};
}
""".replace("BLOCK_SIZE", str(BLOCK))

_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build():
    from torch.utils.cpp_extension import load_inline

    tag = hashlib.sha256("\n".join([_SOURCE, torch.__version__, platform.python_version(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    name = f"bubblespec_keyed_scan_{tag}"
    return load_inline(name=name, cpp_sources=[_SOURCE], functions=["keyed_scan"],
                       extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], build_directory=str(cache_dir("kernels", name)),
                       verbose=False)


def load():
    """The built extension, or None when it cannot be built (the reason is in ``backend()``)."""
    if "module" not in _state:
        try:
            _state["module"] = _build()
            _state["backend"] = "c++"
        except Exception as error:   # no compiler / ninja / headers: the torch path serves
            last = (str(error).strip().splitlines() or [""])[-1]
            _state["module"] = None
            _state["backend"] = f"torch (C++ scan not built: {type(error).__name__}: {last})"
            warnings.warn(f"keyed draw on torch operations: {_state['backend']}", RuntimeWarning,
                          stacklevel=2)
    return _state["module"]


def backend() -> str:
    """``"c++"`` or ``"torch (<why>)"``: the path the keyed draw takes on CPU tensors."""
    load()
    return str(_state["backend"])


def scan(scores: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, bounds: torch.Tensor,
         shift: int, g_max: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, ids, words, nan_rows): the kept tokens of each row (row-major, ids ascending), their
    hash words h, and the rows holding a NaN (which return nothing). Needs ``load()`` not None."""
    module = load()
    if module is None:
        raise RuntimeError(backend())
    rows, ids, words, nan_rows = module.keyed_scan(scores.contiguous(), keys, positions,
                                                   bounds, shift, g_max)
    return rows, ids, words, nan_rows
