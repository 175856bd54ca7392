"""vLLM's batch updates + logits -> each keyed row forced to its keyed draw (V1 logits processor).

``KeyedLogitsProcessor`` draws each tracked row's token with the project's keyed sampler
(``sampling.keyed_draw``; on CPU through the C++ scan of ``sampling.hash_kernel``, built when the
processor starts) at the row's draw word (``sampling.draw_words``: its absolute response
position, or its context) and sets every other logit to -inf, so vLLM's own sampler, run greedy,
merely picks the forced token. A request opts in with ``extra_args[EXTRA_ARGS_KEY]`` (``keyed_extra_args``). The
processor has no request ids: it follows rows through the batch update's removed / added / moved
lists, and a row's response is its prompt's last ``offset`` tokens followed by vLLM's live list of
its output token ids (never count ``apply`` calls, chunked prefill calls it on rows whose sample
is dropped). A spec-decode step's draft rows and bonus row are keyed after the proposed tokens
before them (``vllm_patches`` hands over the step's proposals).

Importing this module imports vLLM (the processor derives from vLLM's base class): import it only
after ``vllm_engine.prepare_environment``, as ``VLLMEngine`` does when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from megatron_bubblespec.sampling.draw_words import Keying, ResponseWords
from megatron_bubblespec.sampling import SamplingParams, hash_kernel
from megatron_bubblespec.sampling.keyed_draw import keyed_sample_sparse

EXTRA_ARGS_KEY = "bubblespec_keyed"


REQUIRED = ("key", "offset", "temperature", "top_k", "top_p", "keying")


def keyed_extra_args(params: SamplingParams, key: int, offset: int) -> dict[str, Any]:
    """What a request carries in ``extra_args[EXTRA_ARGS_KEY]``: its sample key, the position of
    its first generated token in the response (the prefix length, the prompt's last tokens) and
    the sampling parameters."""
    return {"key": int(key), "offset": int(offset), "temperature": float(params.temperature),
            "top_k": int(params.top_k), "top_p": float(params.top_p),
            "keying": params.keying.name}


@dataclass
class _Row:
    key: int
    offset: int                   # response tokens at the end of vLLM's prompt (the prefix)
    params: SamplingParams
    output_token_ids: list[int]   # vLLM's live list of this request's output tokens
    words: ResponseWords          # the draw words after prefix + the outputs it has seen

    def ahead(self, proposed: list[int]) -> list[int]:
        """The words of the next draw and of the draws after each of ``proposed``'s prefixes."""
        self.words.extend(self.output_token_ids[self.words.length - self.offset:])
        return self.words.ahead(proposed)


def _params(keyed: dict) -> SamplingParams:
    return SamplingParams(keyed["temperature"], keyed["top_k"], keyed["top_p"],
                          Keying.parse(keyed["keying"]))


class KeyedLogitsProcessor(LogitsProcessor):
    """Forces every tracked row's token to the keyed draw at its draw word."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        keyed = (sampling_params.extra_args or {}).get(EXTRA_ARGS_KEY)
        if keyed is None:
            return
        missing = set(REQUIRED) - set(keyed)
        if missing:
            raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}] lacks {sorted(missing)}")
        _params(keyed)  # validates

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        if torch.device(device).type == "cpu":
            hash_kernel.load()   # build (or load) the C++ scan now, not in the first step
        self.rows: dict[int, _Row] = {}
        # This spec step's proposed tokens per batch row while the rejection sampler runs (its
        # draft rows and bonus rows; set by ``vllm_patches``), else None.
        self.proposed: list[list[int]] | None = None

    def is_argmax_invariant(self) -> bool:
        return False  # True would skip it for greedy requests, and every request here is greedy

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, prompt, output_token_ids in batch_update.added:
            keyed = (params.extra_args or {}).get(EXTRA_ARGS_KEY) if params else None
            if keyed is None:
                self.rows.pop(index, None)
                continue
            sampling, offset = _params(keyed), keyed["offset"]
            if prompt is None and sampling.keying.context:
                raise ValueError(f"rollout.keying={sampling.keying.name} keys draws by the "
                                 "tokens before them: a keyed request needs prompt token ids")
            prompt = list(prompt) if prompt is not None else [0] * offset
            split = len(prompt) - offset
            self.rows[index] = _Row(keyed["key"], offset, sampling, output_token_ids,
                                    sampling.keying.tracker(prompt[:split], prompt[split:]))
        for src, dst, direction in batch_update.moved:
            row_src, row_dst = self.rows.pop(src, None), self.rows.pop(dst, None)
            if row_src is not None:
                self.rows[dst] = row_src
            if direction == MoveDirectionality.SWAP and row_dst is not None:
                self.rows[src] = row_dst

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """One row per batch request: its next token (a spec step's bonus row comes after
        the request's ``proposed[index]`` tokens)."""
        proposed = self.proposed
        targets = []
        for index, row in self.rows.items():
            if index >= logits.shape[0]:
                raise RuntimeError(f"keyed row {index} outside the logits batch "
                                   f"{tuple(logits.shape)}: batch tracking is broken")
            tokens = proposed[index] if proposed else []
            targets.append((index, row, row.ahead(tokens)[len(tokens)]))
        return self._force(logits, targets)

    def force_draft_rows(self, logits: torch.Tensor):
        """The rejection sampler's draft rows: request i's rows, one per token of
        ``proposed[i]``, are consecutive, in batch order; row j is keyed after the request's
        response and the proposed tokens before j."""
        if self.proposed is None:
            raise RuntimeError("draft rows outside a spec-decode step: vllm_patches sets this "
                               "step's proposed tokens in RejectionSampler.forward")
        targets, start = [], 0
        for index, tokens in enumerate(self.proposed):
            row = self.rows.get(index)
            if row is None and tokens:
                raise RuntimeError(f"batch row {index} has {len(tokens)} proposed tokens but "
                                   "no key")
            if tokens:
                words = row.ahead(tokens)
                targets.extend((start + j, row, words[j]) for j in range(len(tokens)))
            start += len(tokens)
        if start != logits.shape[0]:
            raise RuntimeError(f"{start} draft rows expected, logits have {logits.shape[0]}")
        return self._force(logits, targets)

    def _force(self, logits: torch.Tensor, targets) -> torch.Tensor:
        """Set each target row (logits row, request row, draw word) to a one-hot of its keyed
        draw."""
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
