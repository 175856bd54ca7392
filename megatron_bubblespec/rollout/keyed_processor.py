"""vLLM's batch updates + logits -> each keyed row forced to its keyed draw (V1 logits processor).

``KeyedLogitsProcessor`` draws each tracked row's token with the project's keyed sampler
(``sampling.keyed_draw``; on CPU through the C++ scan of ``sampling.hash_kernel``, built when the
processor starts) at the row's absolute response position and sets every other logit to -inf, so
vLLM's own sampler, run greedy, merely picks the forced token. A request opts in with
``extra_args[EXTRA_ARGS_KEY]`` (``keyed_extra_args``). The processor has no request ids: it follows
rows through the batch update's removed / added / moved lists, and a row's position is
``offset + len(output token ids)`` (vLLM's live list; never count ``apply`` calls, chunked prefill
calls it on rows whose sample is dropped).

Importing this module imports vLLM (the processor derives from vLLM's base class): import it only
after ``vllm_engine.prepare_environment``, as ``VLLMEngine`` does when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from megatron_bubblespec.sampling import SamplingParams, hash_kernel
from megatron_bubblespec.sampling.keyed_draw import keyed_sample_sparse

EXTRA_ARGS_KEY = "bubblespec_keyed"


def keyed_extra_args(params: SamplingParams, key: int, offset: int) -> dict[str, Any]:
    """What a request carries in ``extra_args[EXTRA_ARGS_KEY]``: its sample key, the position of
    its first generated token in the response (the prefix length) and the sampling parameters."""
    return {"key": int(key), "offset": int(offset), "temperature": float(params.temperature),
            "top_k": int(params.top_k), "top_p": float(params.top_p)}


@dataclass
class _Row:
    key: int
    offset: int
    params: SamplingParams
    output_token_ids: list[int]   # vLLM's live list of this request's output tokens

    @property
    def position(self) -> int:
        """The response position of the row's next token."""
        return self.offset + len(self.output_token_ids)


class KeyedLogitsProcessor(LogitsProcessor):
    """Forces every tracked row's token to the keyed draw at its absolute response position."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        keyed = (sampling_params.extra_args or {}).get(EXTRA_ARGS_KEY)
        if keyed is None:
            return
        missing = {"key", "offset", "temperature", "top_k", "top_p"} - set(keyed)
        if missing:
            raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}] lacks {sorted(missing)}")
        SamplingParams(keyed["temperature"], keyed["top_k"], keyed["top_p"])  # validates

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        if torch.device(device).type == "cpu":
            hash_kernel.load()   # build (or load) the C++ scan now, not in the first step
        self.rows: dict[int, _Row] = {}
        # This spec step's proposed tokens per batch row while the rejection sampler samples
        # the bonus rows (set by ``vllm_patches``), else None.
        self.draft_counts: list[int] | None = None

    def is_argmax_invariant(self) -> bool:
        return False  # True would skip it for greedy requests, and every request here is greedy

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt, output_token_ids in batch_update.added:
            keyed = (params.extra_args or {}).get(EXTRA_ARGS_KEY) if params else None
            if keyed is None:
                self.rows.pop(index, None)
                continue
            self.rows[index] = _Row(
                keyed["key"], keyed["offset"],
                SamplingParams(keyed["temperature"], keyed["top_k"], keyed["top_p"]),
                output_token_ids)
        for src, dst, direction in batch_update.moved:
            row_src, row_dst = self.rows.pop(src, None), self.rows.pop(dst, None)
            if row_src is not None:
                self.rows[dst] = row_src
            if direction == MoveDirectionality.SWAP and row_dst is not None:
                self.rows[src] = row_dst

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """One row per batch request: its next token (a spec step's bonus row comes after
        the request's ``draft_counts[index]`` proposed tokens)."""
        drafts = self.draft_counts
        targets = []
        for index, row in self.rows.items():
            if index >= logits.shape[0]:
                raise RuntimeError(f"keyed row {index} outside the logits batch "
                                   f"{tuple(logits.shape)}: batch tracking is broken")
            targets.append((index, row, row.position + (drafts[index] if drafts else 0)))
        return self._force(logits, targets)

    def force_draft_rows(self, logits: torch.Tensor, num_draft_tokens: list[int]):
        """The rejection sampler's draft rows: request i's n_i rows are consecutive, in batch
        order, row j keyed at the request's next position + j."""
        targets, start = [], 0
        for index, n in enumerate(num_draft_tokens):
            row = self.rows.get(index)
            if row is None and n:
                raise RuntimeError(f"batch row {index} has {n} proposed tokens but no key")
            targets.extend((start + j, row, row.position + j) for j in range(n))
            start += n
        if start != logits.shape[0]:
            raise RuntimeError(f"{start} draft rows expected, logits have {logits.shape[0]}")
        return self._force(logits, targets)

    def _force(self, logits: torch.Tensor, targets) -> torch.Tensor:
        """Set each target row (logits row, request row, response position) to a one-hot of
        its keyed draw."""
        groups: dict[SamplingParams, list] = {}
        for target in targets:
            groups.setdefault(target[1].params, []).append(target)
        for params, group in groups.items():
            rows = [t[0] for t in group]
            keys = torch.tensor([t[1].key for t in group], dtype=torch.int64,
                                device=logits.device)
            positions = torch.tensor([t[2] for t in group], dtype=torch.int64,
                                     device=logits.device)
            if rows == list(range(logits.shape[0])):   # every row, in order: no copies
                tokens = keyed_sample_sparse(logits, keys, positions, params,
                                             vocab_size=self.vocab_size)
                logits.fill_(float("-inf")).scatter_(1, tokens.unsqueeze(1), 0.0)
                continue
            index_t = torch.tensor(rows, device=logits.device)
            tokens = keyed_sample_sparse(logits.index_select(0, index_t), keys, positions,
                                         params, vocab_size=self.vocab_size)
            logits.index_fill_(0, index_t, float("-inf"))
            logits[index_t, tokens] = 0.0
        return logits
