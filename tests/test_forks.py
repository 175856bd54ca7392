"""Forks at near ties: the keyed draw's runner-up and margin, the places a bubble forks a draft at,
the forks' transport and queue, and a rollout's own draft going on as the fork its response takes.
The engine path (vLLM's keyed processor keeping runner-ups, bubbles drafting forks, the on/off
identity with forks proposed) is ``test_identity.py``'s."""

import pytest
import torch

from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.sampling.keyed import perturbed_scores
from megatron_bubblespec.sampling.keyed_draw import MARGIN_CAP, keyed_sample_sparse
from megatron_bubblespec.sampling.requests import RolloutRequest, RolloutResult
from megatron_bubblespec.speculative.bubble import BubbleStats, _Forking, fork_places
from megatron_bubblespec.speculative.drafts import Draft, Fork, pack, select_drafts, unpack
from megatron_bubblespec.speculative.pool import Continuation, DraftPool
from megatron_bubblespec.speculative.queue import DraftQueue


@pytest.mark.parametrize("temperature,top_p,scale", [(0.7, 0.9, 3.0), (1.0, 1.0, 1.0),
                                                     (0.7, 1.0, 0.3)])
def test_the_runner_up_and_margin_are_the_dense_scores_second_within_the_cap(temperature, top_p,
                                                                             scale):
    torch.manual_seed(0)
    logits = torch.randn(300, 3000) * scale
    keys, positions = torch.arange(300) * 7 + 3, torch.arange(300)
    params = SamplingParams(temperature, top_p=top_p)
    winner, second, margin = keyed_sample_sparse(logits, keys, positions, params,
                                                 vocab_size=3000, backend="torch",
                                                 runners_up=True)
    assert torch.equal(winner, keyed_sample_sparse(logits, keys, positions, params,
                                                   vocab_size=3000, backend="torch"))
    top = torch.topk(perturbed_scores(logits, keys, positions, params), 2, dim=-1)
    true_margin = (top.values[:, 0] - top.values[:, 1]).double()
    near = true_margin < MARGIN_CAP
    assert torch.equal(torch.isfinite(margin), near) and int(near.sum()) > 50
    assert torch.equal(second[near], top.indices[near, 1]) and bool((second[~near] == -1).all())
    assert torch.allclose(margin[near], true_margin[near])


def test_fork_places_are_the_smallest_margins_with_a_usable_runner_up():
    tokens = (5, 6, 7, 8, 9, 2)
    runners_up = {0: (4, 0.5), 1: (3, 0.01), 2: (2, 0.001),   # 2: the runner-up ends the text
                  3: (8, 0.0),                                 # 3: not another token
                  4: (1, 0.2), 5: (7, float("inf")), 9: (1, 0.0)}  # 9: past the draft
    assert fork_places(tokens, runners_up, 2, eos_token_ids=(2,)) == [(1, 3), (4, 1)]
    assert fork_places(tokens, runners_up, 9, eos_token_ids=(2,)) == [(0, 4), (1, 3), (4, 1)]
    assert fork_places(tokens, {}, 4) == []


def _continuation(draft, forks):
    pool = DraftPool([1, 2, 3], sources=())
    return Continuation(pool, 4, draft, draft_k=3, forks=forks)


def test_a_response_that_takes_the_runner_up_goes_on_as_the_fork():
    prompt, draft = [1, 2, 3], [10, 11, 12, 13, 14, 15]
    c = _continuation(draft, {2: [20, 21, 22, 23], 4: [30, 31]})
    assert c.propose(prompt, 100) == [10, 11, 12]
    c.record([10, 11, 12], 2)                               # the response took 20 at place 2
    assert c.propose(prompt + [10, 11, 20], 100) == [21, 22, 23]
    c.record([21, 22, 23], 3)
    assert c.draft_counts == [3, 2] and c.by_source() == {"fork": (3, 3)}
    # the fork's text ends: nothing more, and the other fork was of the old text
    assert c.propose(prompt + [10, 11, 20, 21, 22, 23, 30], 100) == []


def test_a_response_that_takes_neither_ends_the_draft():
    prompt = [1, 2, 3]
    c = _continuation([10, 11, 12, 13], {2: [20, 21]})
    assert c.propose(prompt + [10, 11, 40], 100) == []
    assert c.draft is None and c.by_source() == {}
    # a fork whose place the response passed in agreement with the draft is never taken
    c = _continuation([10, 11, 12, 13, 14], {1: [20, 21]})
    assert c.propose(prompt + [10, 11, 12], 100) == [13, 14]
    assert c.propose(prompt + [10, 11, 12, 50], 100) == [] and c.draft is None


def test_drafts_carry_their_forks_through_packing_and_drop_malformed_ones():
    drafts = [Draft(3, 1, 77, 2, (5, 6, 7, 8), (Fork(1, (9, 9, 9)), Fork(3, (4,)))),
              Draft(3, 2, 78, 2, (5,))]
    assert unpack(pack(drafts)) == drafts
    flat = pack(drafts).tolist()
    flat[1 + 6 + 4] = -1                          # the first fork's place
    with pytest.warns(UserWarning, match="fork 0 of draft 0 has a bad header"):
        assert unpack(torch.tensor(flat)) == []
    keys = {(3, 1): 77}
    odd = Draft(3, 1, 77, 2, (5, 6, 7, 8), (Fork(1, (6, 1)), Fork(2, (1, 99)), Fork(9, (1,))))
    with pytest.warns(RuntimeWarning):
        kept = select_drafts([odd], keys, vocab_size=50, max_tokens=4)[(3, 1)]
    # place 1 does not fork (6 is the draft's own), 2 holds an id outside the vocabulary, 9 is
    # past the draft
    assert kept.forks == ()
    kept = select_drafts([drafts[0]], keys, vocab_size=50, max_tokens=3)[(3, 1)]
    assert kept.tokens == (5, 6, 7) and kept.forks == (Fork(1, (9, 9)),)   # cut to the budget


def test_the_queue_keeps_the_forks_a_newer_draft_still_has_and_checkpoints_them():
    queue = DraftQueue(budget=8, eos_token_ids=(2,), vocab_size=50)
    keys = {(4, 0): 11}
    queue.absorb([Draft(4, 0, 11, 1, (5, 6, 7), (Fork(1, (9, 9)), Fork(2, (8, 8))))], keys)
    # drafted again by a newer policy that took a third token at place 2: both old forks still
    # fork it, one that took the fork's token would not
    queue.absorb([Draft(4, 0, 11, 2, (5, 6, 3, 4), (Fork(3, (1, 1)),))], keys)
    assert queue.get(4, 0).forks == (Fork(1, (9, 9)), Fork(2, (8, 8)), Fork(3, (1, 1)))
    queue.absorb([Draft(4, 0, 11, 3, (5, 6, 8, 4))], keys)
    assert queue.get(4, 0).forks == (Fork(1, (9, 9)),)
    again = DraftQueue(budget=8, eos_token_ids=(2,), vocab_size=50)
    again.load_state_dict(queue.state_dict())
    assert again.get(4, 0) == queue.get(4, 0)
    again.load_state_dict({"4": [[0, 11, 2, [5, 6]]]})     # saved before drafts had forks
    assert again.get(4, 0) == Draft(4, 0, 11, 2, (5, 6))


def test_a_bubble_forks_its_longest_finished_drafts_first_and_attaches_the_forks():
    forking = _Forking(per_draft=2, max_tokens=3, nearest_step=5)
    short = RolloutRequest("draft5-0", [1, 2], 100, 16, eos_token_ids=(2,))
    long = RolloutRequest("draft5-1", [1, 2], 101, 16, eos_token_ids=(2,))
    later = RolloutRequest("draft6-0", [1, 2], 102, 16, eos_token_ids=(2,))
    for request in (short, long, later):
        forking.watch(request)
    assert short.runners_up and long.runners_up and later.runners_up

    def result(request, tokens, runners_up):
        return RolloutResult(request.request_id, list(tokens), [0.0] * len(tokens), 1, "eos",
                             runners_up=runners_up)

    forking.offer((6, 0), result(later, (7, 8, 9, 10, 11, 12, 2), {0: (9, 0.1)}))
    assert forking.waiting and not forking.urgent and forking.take(4, urgent_only=True) == []
    forking.offer((5, 0), result(short, (7, 8, 2), {0: (9, 0.1), 1: (9, 0.2)}))
    forking.offer((5, 1), result(long, (7, 8, 9, 10, 2), {1: (3, 0.05), 3: (4, 0.5),
                                                          2: (6, 1.5)}))
    assert forking.urgent
    taken = forking.take(9, urgent_only=True)   # the nearest step's, longest draft first
    assert [(r.request_id, r.response_prefix, r.max_new_tokens) for r in taken] == [
        ("fork-draft5-1-1", [7, 3], 5), ("fork-draft5-1-3", [7, 8, 9, 4], 7),
        ("fork-draft5-0-0", [9], 4), ("fork-draft5-0-1", [7, 9], 5)]
    assert taken[0].key == 101 and taken[0].drafting
    assert not forking.urgent and forking.waiting                         # step 6's is left
    assert forking.collect(result(taken[0], [7, 3, 5, 5, 2], {}))
    assert forking.collect(result(taken[1], [7, 8, 9, 4], {}))            # nothing past it
    assert not forking.collect(result(long, [7], {}))                     # not a fork's
    stats = BubbleStats()
    drafts = forking.attach([Draft(5, 1, 101, 3, (7, 8, 9, 10, 2)), Draft(5, 0, 100, 3, (7, 8, 2))],
                            stats)
    assert drafts[0].forks == (Fork(1, (3, 5, 5, 2)),) and drafts[1].forks == ()
    assert stats.forks == 1 and stats.fork_tokens == 4
