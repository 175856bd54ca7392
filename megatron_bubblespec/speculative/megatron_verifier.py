"""Drafts -> one Megatron forward over prompt+prefix+draft (any TP/PP) -> vocab-parallel keyed rule -> results on all ranks.

Step 1 of the synchronous step ("verify"), run on the training ranks that already hold θ_t:

1. every draft is checked (``speculative.validate.verifiable_draft``): token ids outside [0,
vocab_size)
   drop the whole draft, a draft longer than the response budget left (``max_new_tokens -
   len(response_prefix)``) is cut to it; both with a warning naming the request, never an
   exception and never a changed token (a dropped draft is an empty one: one plain keyed draw);
2. ``prompt + response_prefix + draft`` of every request goes into one right-padded batch and
   through ONE forward-only pipeline pass (``train.forward.megatron_forward``), whose output layer
   computes logits only at the L + 1 positions of each draft;
3. on the last pipeline stage, per micro-batch, the L+1 logits rows starting at the last prefix
   position (they predict response positions ``len(prefix) ... len(prefix) + L``) go to
   ``speculative.verify.verify_keyed`` in its vocab-parallel form: each TP rank holds the global ids
   ``[tp_rank * V_local, (tp_rank + 1) * V_local)``, Megatron's vocabulary padding (ids >=
   ``arch.vocab_size``) is excluded, and the draw is settled by an all-reduce MAX then MIN over
   the TP group (NCCL on GPU, gloo on CPU);
4. EOS is settled per request (each request's own ``eos_token_ids``, inside ``verify_keyed``), and
   (accepted, next_token, finished) are broadcast from the last pipeline stage to every stage, so all ranks of the model
   replica return the same ``Verdict``.

All ranks of one model replica (its TP x PP ranks) must call ``verify`` with the same requests,
drafts and parameters; different data-parallel replicas verify different requests independently.
The result is token-identical to the reference engine's ``verify`` and to plain keyed decoding,
up to floating-point differences between the two forwards.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from megatron_bubblespec.distributed.world import expert_parallel_size
from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.sampling.requests import RolloutRequest
from megatron_bubblespec.speculative.validate import request_draft
from megatron_bubblespec.speculative.verifier import VerifiedDrafts
from megatron_bubblespec.speculative.verify import Verdict, draft_words, verify_keyed
from megatron_bubblespec.tokens import pad_token_rows
from megatron_bubblespec.train.forward import broadcast_from_last_stage, megatron_forward

PAD_ID = 0


class MegatronVerifier:
    """Exact keyed verification of drafts by the Megatron model of this rank's replica (a
    ``speculative.verifier.Verifier``).

    ``model`` is this rank's GPTModel piece (any TP/PP; wrapped modules work), ``arch`` its
    ``ModelSpec`` (``arch.vocab_size`` is the real vocabulary, without Megatron's padding),
    ``params`` the sampling parameters of the keyed draws, ``micro_batch_size`` the split of the
    batch for the pipeline schedule (the batch is padded with dummy rows to a multiple of it).
    """

    def __init__(self, model, arch, params: SamplingParams, micro_batch_size: int | None = None):
        from megatron.core import parallel_state as ps

        if ps.get_context_parallel_world_size() > 1:
            raise ValueError("MegatronVerifier does not support context parallelism (the logits "
                             "of a sequence would be split over ranks); use context_parallel=1 "
                             "on the verifying ranks")
        self.model, self.arch = model, arch
        self.params, self.micro_batch_size = params, micro_batch_size
        # Under expert parallelism the forward is collective over replicas (the MoE layers'
        # token gather), so a replica without drafts still runs its part.
        self.every_step = expert_parallel_size() > 1

    def verify(self, requests: Sequence[RolloutRequest],
               drafts: Sequence[Sequence[int]]) -> VerifiedDrafts:
        """The requests the engine continues from, with the verified tokens as their prefix."""
        start = time.perf_counter()
        drafts = [list(d) for d in drafts]
        return VerifiedDrafts.of(requests, drafts, self.verification(requests, drafts), start)

    def verification(self, requests: Sequence[RolloutRequest],
                     drafts: Sequence[Sequence[int]]) -> Verdict:
        """One forward over prompt + prefix + draft per request -> the keyed rule's
        ``Verdict`` (CPU int64 tensors, identical on every rank of the replica)."""
        requests, n = list(requests), len(requests)
        if n != len(drafts):
            raise ValueError(f"{n} requests but {len(drafts)} drafts; pass one draft "
                             "(possibly empty) per request")
        if n == 0:
            if self.every_step:
                megatron_forward(self.model, torch.zeros(0, 1, dtype=torch.int64),
                                 lambda logits, rows: None, self.micro_batch_size)
            empty = torch.zeros(0, dtype=torch.int64)
            return Verdict(empty, empty.clone(), torch.zeros(0, dtype=torch.bool))
        batch = _Batch(requests, [request_draft(r, d, self.arch.vocab_size)
                                  for r, d in zip(requests, drafts)])
        mbs = min(self.micro_batch_size or n, n)
        tokens = self._pack(batch.rows(), -(-n // mbs) * mbs)
        per_mb = megatron_forward(self.model, tokens, self._settle(batch), micro_batch_size=mbs,
                                  logit_positions=batch.positions(tokens.shape[1]))
        device = next(self.model.parameters()).device
        packed = None
        if per_mb is not None:   # last pipeline stage
            columns = [sum((list(mb[k]) for mb in per_mb), []) for k in range(3)]
            packed = torch.tensor(columns, dtype=torch.int64, device=device)
        packed = broadcast_from_last_stage(packed, (3, n), device, torch.int64).cpu()
        return Verdict(accepted=packed[0].clone(), next_token=packed[1].clone(),
                            finished=packed[2].bool())

    # ------------------------------------------------------------------ internals
    def _settle(self, batch: _Batch):
        """The last stage's logits of a micro-batch -> the vocab-parallel keyed rule's columns
        (accepted, next token, finished) of its real rows."""
        from megatron.core import parallel_state as ps

        tp_group = ps.get_tensor_model_parallel_group()
        tp_rank = ps.get_tensor_model_parallel_rank()

        def on_logits(logits: torch.Tensor, mb_rows: slice):
            real = batch.real(mb_rows)
            device, local_vocab = logits.device, logits.shape[-1]
            target = logits[:len(real)]   # [b, L + 1, V_local]: the draft's positions only
            draft = torch.zeros(len(real), target.shape[1] - 1, dtype=torch.int64, device=device)
            for row, i in enumerate(real):
                draft[row, :len(batch.drafts[i])] = torch.tensor(batch.drafts[i], dtype=torch.int64)
            requests = [batch.requests[i] for i in real]
            result = verify_keyed(
                target, draft, torch.tensor([len(batch.drafts[i]) for i in real], device=device),
                torch.tensor([r.key for r in requests], dtype=torch.int64, device=device),
                draft_words(self.params, requests, [batch.drafts[i] for i in real],
                            target.shape[1]).to(device),
                self.params, [r.eos_token_ids for r in requests],
                vocab_offset=tp_rank * local_vocab, vocab_size=self.arch.vocab_size,
                group=tp_group)
            return result.accepted.tolist(), result.next_token.tolist(), result.finished.tolist()

        return on_logits

    def _pack(self, rows: list[list[int]], batch: int) -> torch.Tensor:
        """Right-padded [batch, S] tokens; rows past ``len(rows)`` are dummies (all padding).
        S is a multiple of TP when sequence parallelism splits the sequence over the TP group."""
        from megatron.core import parallel_state as ps

        width = max(len(r) for r in rows)
        config = getattr(self.model, "config", None)
        if getattr(config, "sequence_parallel", False):
            tp = ps.get_tensor_model_parallel_world_size()
            width = -(-width // tp) * tp
        return pad_token_rows(rows, PAD_ID, width=width, batch=batch)[0]


class _Batch:
    """The verified requests with their checked drafts, as rows of one forward."""

    def __init__(self, requests: list[RolloutRequest], drafts: list[list[int]]):
        self.requests, self.drafts = requests, drafts

    def rows(self) -> list[list[int]]:
        return [list(r.prompt_token_ids) + list(r.response_prefix) + d
                for r, d in zip(self.requests, self.drafts)]

    def real(self, mb_rows: slice) -> range:
        """The real (not dummy) rows of a micro-batch."""
        return range(mb_rows.start, min(mb_rows.stop, len(self.requests)))

    def positions(self, length: int):
        """Per sequence of a micro-batch, the L + 1 positions whose logits its draft needs (L the
        micro-batch's longest draft; the rows past a draft's end are never read, and a dummy row
        reads position 0), from the last prefix position, clamped to the batch's ``length``."""
        starts = [len(r.prompt_token_ids) + len(r.response_prefix) - 1 for r in self.requests]

        def positions(mb_rows: slice) -> torch.Tensor:
            real = self.real(mb_rows)
            width = max(len(self.drafts[i]) for i in real) + 1
            first = torch.zeros(mb_rows.stop - mb_rows.start, 1, dtype=torch.int64)
            first[:len(real), 0] = torch.tensor([starts[i] for i in real])
            return (first + torch.arange(width)).clamp(max=length - 1)

        return positions
