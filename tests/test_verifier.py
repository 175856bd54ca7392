"""Draft verification.

* Keyed verification reproduces plain keyed decoding token for token, whatever the proposals
  (random, the truth, a perturbed drafter, EOS-laden, empty), alone or batched with padding.
* Edge cases of ``verify_keyed`` (accepted EOS, no draft, bonus token, padding, bad shapes).
* The residual rule is exact in distribution; SPEC-RL's lenient rule measurably is not.
* Negative controls: deliberately wrong verifiers fail the same property checks.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from scipy.stats import binomtest, chisquare

from megatron_bubblespec.sampling.requests import settle_eos
from megatron_bubblespec.sampling import SamplingParams, keyed_sample, sample_key
from megatron_bubblespec.speculative.rules import RULES as REGISTERED
from megatron_bubblespec.speculative import (
    Verdict,
    verify_keyed,
    verify_lenient,
    verify_residual,
)

V = 12          # toy vocabulary
EOS = 0
MAX_NEW = 20    # response budget of the decoding tests
NO_TOKEN = -1

PARAMS = [SamplingParams(0.0), SamplingParams(0.7), SamplingParams(1.0),
          SamplingParams(0.8, top_k=5, top_p=0.9)]
PARAM_IDS = ["greedy", "T0.7", "T1", "T0.8-k5-p0.9"]

PROPERTY = settings(max_examples=25, deadline=None, derandomize=True, database=None)


# ------------------------------------------------------------------------------ toy policies

class ToyPolicy:
    """Deterministic prefix -> logits [V]: a seeded random table indexed by the last two tokens.

    ``noise`` > 0 adds a second seeded table: a perturbed copy of the policy, used as a drafter.
    """

    def __init__(self, seed: int = 0, noise: float = 0.0, noise_seed: int = 1):
        table = 1.5 * torch.randn(V + 1, V + 1, V, generator=torch.Generator().manual_seed(seed))
        if noise:
            gen = torch.Generator().manual_seed(noise_seed)
            table = table + noise * torch.randn(table.shape, generator=gen)
        self.table = table

    def __call__(self, prefix) -> torch.Tensor:
        a, b = ([V, V] + list(prefix))[-2:]   # V = "nothing there yet"
        return self.table[a, b]


POLICY = ToyPolicy(0)
DRAFTER = ToyPolicy(0, noise=0.1, noise_seed=1)


def plain_decode(policy, prompt, key, params, max_new, eos=EOS, start=0) -> list[int]:
    """Plain keyed decoding: one keyed draw per response position start, start+1, ...; stops
    after EOS or ``max_new`` tokens."""
    out: list[int] = []
    while len(out) < max_new and (not out or out[-1] != eos):
        logits = policy(list(prompt) + out)[None]
        pos = torch.tensor([start + len(out)])
        out.append(int(keyed_sample(logits, torch.tensor([key]), pos, params)[0]))
    return out


def check_invariants(res: Verdict, draft: torch.Tensor, lens: torch.Tensor, eos=EOS):
    """What any Verdict must satisfy, independent of the rule."""
    for row, n, acc, nxt, fin in zip(draft.tolist(), lens.tolist(), res.accepted.tolist(),
                                     res.next_token.tolist(), res.finished.tolist()):
        assert 0 <= acc <= n
        kept = row[:acc]
        assert eos not in kept[:-1]
        ended = bool(kept) and kept[-1] == eos
        assert (nxt == NO_TOKEN) == ended
        assert ended or 0 <= nxt < V
        assert fin == (ended or nxt == eos)


@dataclass
class SpecRun:
    tokens: list[int]
    calls: int       # verify calls this sample took part in
    accepted: int    # draft tokens accepted over the run


def speculative_decode_batch(policy, prompts, keys, params, max_new, eos, proposers,
                             verify=verify_keyed, pad_seed=None) -> list[SpecRun]:
    """Speculative decoding of several samples, verified together (one call per round).

    Each round, ``proposers[i](response_so_far)`` gives any draft (truncated to the budget left);
    the target logits at index j come from ``policy(prompt + response + draft[:j])``. Drafts are
    right-padded; with ``pad_seed`` the padded part (tokens and logits) is filled with garbage.
    """
    rng = random.Random(pad_seed)
    n = len(prompts)
    resps: list[list[int]] = [[] for _ in range(n)]
    calls, accepted, done = [0] * n, [0] * n, [False] * n
    while not all(done):
        active = [i for i in range(n) if not done[i]]
        drafts = [[int(t) for t in proposers[i](list(resps[i]))][:max_new - len(resps[i])]
                  for i in active]
        width = max(len(d) for d in drafts)
        logits = torch.zeros(len(active), width + 1, V)
        draft = torch.zeros(len(active), width, dtype=torch.int64)
        for r, (i, d) in enumerate(zip(active, drafts)):
            prefix = list(prompts[i]) + resps[i]
            for j in range(width + 1):
                if j <= len(d):
                    logits[r, j] = policy(prefix + d[:j])
                elif pad_seed is not None:
                    logits[r, j] = torch.tensor([rng.gauss(0.0, 30.0) for _ in range(V)])
            pad = [rng.choice([NO_TOKEN, eos, V + 7, rng.randrange(V)]) if pad_seed is not None
                   else 0 for _ in range(width - len(d))]
            draft[r] = torch.tensor(d + pad, dtype=torch.int64)
        lens = torch.tensor([len(d) for d in drafts])
        res = verify(logits, draft, lens, torch.tensor([keys[i] for i in active]),
                     torch.tensor([len(resps[i]) for i in active]), params, (eos,))
        check_invariants(res, draft, lens, eos)
        for r, i in enumerate(active):
            n_acc, nxt = int(res.accepted[r]), int(res.next_token[r])
            calls[i] += 1
            accepted[i] += n_acc
            resps[i] += drafts[r][:n_acc]
            if nxt != NO_TOKEN and len(resps[i]) < max_new:
                resps[i].append(nxt)
            done[i] = bool(res.finished[r]) or len(resps[i]) >= max_new
    return [SpecRun(resps[i], calls[i], accepted[i]) for i in range(n)]


def speculative_decode(policy, prompt, key, params, max_new, eos, propose,
                       verify=verify_keyed) -> SpecRun:
    """Speculative decoding of one sample (batch size 1 at every verify call)."""
    return speculative_decode_batch(policy, [prompt], [key], params, max_new, eos, [propose],
                                    verify)[0]


def assert_same(run: SpecRun, truth: list[int]):
    assert run.tokens == truth, f"speculative {run.tokens} differs from plain {truth}"


# --------------------------------------------------------------------------- strategies

prompts = st.lists(st.integers(1, V - 1), min_size=1, max_size=4)
sample_keys = st.builds(sample_key, st.integers(0, 2**32), st.integers(0, 10**6),
                        st.integers(0, 10**9), st.integers(0, 15))
drafts = st.lists(st.integers(0, V - 1), max_size=8)


def truth_chunk(truth, chunk):
    """The proposer that drafts the next ``chunk`` tokens of the plain decode."""
    return lambda resp: truth[len(resp):len(resp) + chunk]


def drafter_proposer(drafter, prompt, key, params, k):
    """The drafter's own keyed decoding from the current prefix, same key, absolute positions."""
    return lambda resp: plain_decode(drafter, list(prompt) + resp, key, params, k, start=len(resp))


# ------------------------------------------------------------ keyed == plain, any proposal

def _check_random_drafts(params, prompt, key, data, verify=verify_keyed):
    truth = plain_decode(POLICY, prompt, key, params, MAX_NEW)
    run = speculative_decode(POLICY, prompt, key, params, MAX_NEW, EOS,
                             lambda resp: data.draw(drafts), verify)
    assert_same(run, truth)


@pytest.mark.parametrize("params", PARAMS, ids=PARAM_IDS)
@PROPERTY
@given(prompt=prompts, key=sample_keys, data=st.data())
def test_random_drafts_match_plain_decoding(params, prompt, key, data):
    _check_random_drafts(params, prompt, key, data)


@pytest.mark.parametrize("params", PARAMS, ids=PARAM_IDS)
@PROPERTY
@given(prompt=prompts, key=sample_keys, chunk=st.integers(1, MAX_NEW))
def test_true_drafts_are_accepted_in_few_calls(params, prompt, key, chunk):
    truth = plain_decode(POLICY, prompt, key, params, MAX_NEW)
    run = speculative_decode(POLICY, prompt, key, params, MAX_NEW, EOS, truth_chunk(truth, chunk))
    assert_same(run, truth)
    # Every call keeps its whole draft plus the bonus token: chunk + 1 tokens per call.
    assert run.calls == math.ceil(len(truth) / (chunk + 1))
    if len(truth) >= 2:
        assert run.calls < len(truth)


@pytest.mark.parametrize("params", PARAMS, ids=PARAM_IDS)
@PROPERTY
@given(prompt=prompts, key=sample_keys, k=st.integers(1, 8))
def test_perturbed_drafter_sharing_the_key_matches_and_is_accepted(params, prompt, key, k):
    truth = plain_decode(POLICY, prompt, key, params, MAX_NEW)
    run = speculative_decode(POLICY, prompt, key, params, MAX_NEW, EOS,
                             drafter_proposer(DRAFTER, prompt, key, params, k))
    assert_same(run, truth)
    assert run.accepted > 0


@pytest.mark.parametrize("params", PARAMS, ids=PARAM_IDS)
@PROPERTY
@given(prompt=prompts, key=sample_keys, data=st.data())
def test_drafts_with_inserted_eos_match_plain_decoding(params, prompt, key, data):
    truth = plain_decode(POLICY, prompt, key, params, MAX_NEW)

    def propose(resp):
        if data.draw(st.booleans(), label="true base"):
            base = truth[len(resp):len(resp) + data.draw(st.integers(0, 8), label="base len")]
        else:
            base = data.draw(drafts, label="random base")
        for _ in range(data.draw(st.integers(1, 2), label="EOS count")):
            base.insert(data.draw(st.integers(0, len(base)), label="EOS at"), EOS)
        return base

    assert_same(speculative_decode(POLICY, prompt, key, params, MAX_NEW, EOS, propose), truth)


@pytest.mark.parametrize("params", PARAMS, ids=PARAM_IDS)
@PROPERTY
@given(prompt=prompts, key=sample_keys)
def test_empty_drafts_are_plain_decoding(params, prompt, key):
    truth = plain_decode(POLICY, prompt, key, params, MAX_NEW)
    run = speculative_decode(POLICY, prompt, key, params, MAX_NEW, EOS, lambda resp: [])
    assert_same(run, truth)
    assert run.calls == len(truth) and run.accepted == 0


@pytest.mark.parametrize("params", PARAMS, ids=PARAM_IDS)
@settings(max_examples=15, deadline=None, derandomize=True, database=None)
@given(data=st.data(), batch=st.integers(2, 5))
def test_batched_ragged_verification_matches_plain_decoding(params, data, batch):
    """Samples with different prompts, keys and kinds of proposals verified in one call per
    round, with garbage tokens and logits in the padding."""
    prompt_list = [data.draw(prompts, label="prompt") for _ in range(batch)]
    key_list = [data.draw(sample_keys, label="key") for _ in range(batch)]
    truths = [plain_decode(POLICY, p, k, params, MAX_NEW) for p, k in zip(prompt_list, key_list)]
    proposers = []
    for p, k, truth in zip(prompt_list, key_list, truths):
        kind = data.draw(st.sampled_from(["random", "truth", "drafter", "empty"]), label="kind")
        size = data.draw(st.integers(1, 8), label="size")
        proposers.append({"random": lambda resp: data.draw(drafts, label="draft"),
                          "truth": truth_chunk(truth, size),
                          "drafter": drafter_proposer(DRAFTER, p, k, params, size),
                          "empty": lambda resp: []}[kind])
    runs = speculative_decode_batch(POLICY, prompt_list, key_list, params, MAX_NEW, EOS,
                                    proposers, pad_seed=data.draw(st.integers(0, 2**16)))
    for run, truth in zip(runs, truths):
        assert_same(run, truth)


@pytest.mark.parametrize("params", PARAMS[1:], ids=PARAM_IDS[1:])
def test_shared_key_drafter_acceptance_is_high_and_needs_the_key(params):
    """A slightly perturbed drafter sharing the sample's key gets most of its tokens accepted;
    the same drafter with another key does much worse when sampling."""
    shared = other = produced = 0
    for i in range(25):
        prompt, key = [1 + i % (V - 1), 1 + (7 * i) % (V - 1)], sample_key(5, 1, i, 0)
        truth = plain_decode(POLICY, prompt, key, params, MAX_NEW)
        run = speculative_decode(POLICY, prompt, key, params, MAX_NEW, EOS,
                                 drafter_proposer(DRAFTER, prompt, key, params, 4))
        bad = speculative_decode(POLICY, prompt, key, params, MAX_NEW, EOS,
                                 drafter_proposer(DRAFTER, prompt, key ^ 1, params, 4))
        assert_same(run, truth)
        assert_same(bad, truth)
        shared, other, produced = shared + run.accepted, other + bad.accepted, produced + len(truth)
    assert shared > 0.7 * produced    # a perfect 4-token drafter reaches ~4/5 (the rest are bonus)
    assert other < 0.7 * shared


# ------------------------------------------------------------------ negative controls

def accept_all(target_logits, draft, draft_lens, keys, start_positions, params, eos_token_ids=()):
    """WRONG: keeps every draft token (up to an EOS), then the target's draw after them."""
    eos = set(eos_token_ids)
    acc, nxt, fin = [], [], []
    for r, (row, n) in enumerate(zip(draft.tolist(), draft_lens.tolist())):
        a = next((i + 1 for i, t in enumerate(row[:n]) if t in eos), n)
        t = NO_TOKEN if a and row[a - 1] in eos else int(keyed_sample(
            target_logits[r, a][None], keys[r:r + 1], start_positions[r:r + 1] + a, params)[0])
        acc.append(a)
        nxt.append(t)
        fin.append(t == NO_TOKEN or t in eos)
    return Verdict(torch.tensor(acc), torch.tensor(nxt), torch.tensor(fin))


def shifted_positions(target_logits, draft, draft_lens, keys, start_positions, *args):
    """WRONG: verifies with the noise of the next position (an off-by-one in positions)."""
    return verify_keyed(target_logits, draft, draft_lens, keys, start_positions + 1, *args)


@pytest.mark.parametrize("wrong", [accept_all, shifted_positions])
def test_wrong_verifiers_fail_the_random_draft_property(wrong):
    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              phases=[Phase.generate], report_multiple_bugs=False)
    @given(prompt=prompts, key=sample_keys, data=st.data())
    def prop(prompt, key, data):
        _check_random_drafts(SamplingParams(1.0), prompt, key, data, wrong)

    with pytest.raises(AssertionError, match="differs from plain"):
        prop()


# ---------------------------------------------------------- verify_keyed edge cases

T1 = SamplingParams(1.0)


def _rows(logits, keys, starts, params=T1):
    """The plain keyed draw at every index j of logits [B, W, V]: position start + j."""
    b, w, v = logits.shape
    pos = starts.view(-1, 1) + torch.arange(w)
    return keyed_sample(logits.reshape(b * w, v), keys.repeat_interleave(w), pos.reshape(-1),
                        params).view(b, w)


def _problem(batch, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(batch, width + 1, V, generator=g)
    keys = torch.tensor([sample_key(seed, 3, i, 0) for i in range(batch)])
    starts = torch.randint(0, 40, (batch,), generator=g)
    return logits, keys, starts


@pytest.mark.parametrize("eos_id", [EOS, 7])
def test_accepted_eos_inside_the_draft_ends_the_response(eos_id):
    logits, keys, starts = _problem(1, 5)
    logits[0, :, eos_id] = -100.0
    logits[0, 2, eos_id] = 100.0                       # the target surely draws EOS at index 2
    truth = _rows(logits, keys, starts)[0]
    assert truth[2] == eos_id
    draft = truth[:5].clone().view(1, 5)               # ... and the draft goes on after it
    res = verify_keyed(logits, draft, torch.tensor([5]), keys, starts, T1, (EOS, 7))
    assert res.accepted.tolist() == [3]
    assert res.next_token.tolist() == [NO_TOKEN]
    assert res.finished.tolist() == [True]
    assert res.tokens(draft) == [truth[:3].tolist()]


def test_rejected_eos_is_corrected_and_emitted_eos_finishes():
    logits, keys, starts = _problem(2, 4)
    logits[:, :, EOS] = -100.0
    logits[1, 1, EOS] = 100.0                          # row 1: the target emits EOS at index 1
    truth = _rows(logits, keys, starts)
    draft = truth[:, :4].clone()
    draft[:, 1] = torch.tensor([EOS, (EOS + 1) % V])   # row 0: a drafted EOS the target rejects
    res = verify_keyed(logits, draft, torch.tensor([4, 4]), keys, starts, T1, (EOS,))
    assert res.accepted.tolist() == [1, 1]
    assert res.next_token.tolist() == [int(truth[0, 1]), EOS]
    assert res.finished.tolist() == [False, True]


@pytest.mark.parametrize("params", PARAMS, ids=PARAM_IDS)
@pytest.mark.parametrize("width", [0, 4])
def test_no_draft_is_one_plain_draw_at_the_start_position(params, width):
    logits, keys, starts = _problem(6, width, seed=1)
    garbage = torch.randint(-1, V + 5, (6, width))
    res = verify_keyed(logits, garbage, torch.zeros(6, dtype=torch.int64), keys, starts, params,
                       (EOS,))
    plain = keyed_sample(logits[:, 0], keys, starts, params)
    assert res.accepted.tolist() == [0] * 6
    assert torch.equal(res.next_token, plain)
    assert torch.equal(res.finished, plain == EOS)


@pytest.mark.parametrize("params", PARAMS, ids=PARAM_IDS)
def test_whole_draft_accepted_gives_the_plain_draw_after_it(params):
    logits, keys, starts = _problem(5, 6, seed=2)
    logits[:, :-1, EOS] = -100.0                       # no EOS inside the drafts
    truth = _rows(logits, keys, starts, params)
    lens = torch.tensor([6, 0, 3, 6, 1])
    draft = torch.where(torch.arange(6) < lens.view(-1, 1), truth[:, :6], V + 3)
    res = verify_keyed(logits, draft, lens, keys, starts, params, (EOS,))
    assert torch.equal(res.accepted, lens)
    bonus = truth.gather(1, lens.view(-1, 1)).squeeze(1)     # position start + len
    assert torch.equal(res.next_token, bonus)
    assert torch.equal(res.finished, bonus == EOS)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(data=st.data(), params=st.sampled_from(PARAMS), batch=st.integers(1, 6),
       width=st.integers(0, 6))
def test_padding_never_affects_the_result(data, params, batch, width):
    logits, keys, starts = _problem(batch, width, seed=data.draw(st.integers(0, 1000)))
    truth = _rows(logits, keys, starts, params)[:, :width]
    lens = torch.tensor(data.draw(st.lists(st.integers(0, width), min_size=batch,
                                           max_size=batch)))
    # Real parts: a true prefix, then (maybe) a wrong token, then anything.
    draft = truth.clone()
    for r in range(batch):
        cut = data.draw(st.integers(0, width))
        tail = st.lists(st.integers(0, V - 1), min_size=width - cut, max_size=width - cut)
        draft[r, cut:] = torch.tensor(data.draw(tail), dtype=torch.int64)
    eos_ids = data.draw(st.sampled_from([(), (EOS,), (EOS, 3)]))
    pad = torch.arange(width + 1) > lens.view(-1, 1)   # logits rows past each draft's end
    gen = torch.Generator().manual_seed(batch * 100 + width)

    def garbage():
        d = torch.where(torch.arange(width) >= lens.view(-1, 1),
                        torch.randint(-1, V + 9, draft.shape, generator=gen), draft)
        lg = torch.where(pad.unsqueeze(-1), 50.0 * torch.randn(logits.shape, generator=gen), logits)
        return lg, d

    results = [verify_keyed(*garbage(), lens, keys, starts, params, eos_ids) for _ in range(3)]
    for res in results[1:]:
        for field in ("accepted", "next_token", "finished"):
            assert torch.equal(getattr(res, field), getattr(results[0], field))
    for r in range(batch):                             # each row alone, unpadded
        n = int(lens[r])
        alone = verify_keyed(logits[r:r + 1, :n + 1], draft[r:r + 1, :n], lens[r:r + 1],
                             keys[r:r + 1], starts[r:r + 1], params, eos_ids)
        for field in ("accepted", "next_token", "finished"):
            assert getattr(alone, field)[0] == getattr(results[0], field)[r]


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=50, top_p=0.9)],
                         ids=["T1", "T0.8-k50-p0.9"])
@pytest.mark.parametrize("scale", [0.05, 8.0], ids=["flat", "peaked"])
def test_keyed_rule_at_a_real_vocabulary_matches_the_dense_draw(params, scale):
    """At SmolLM2's vocabulary (49,152) on flat and peaked rows, the keyed rule (which draws only
    the rows a draft reaches, scoring few tokens per row) settles exactly where the dense
    ``keyed_sample`` of every row says: drafts accepted whole, cut by a wrong token, and empty."""
    vocab, batch, width = 49152, 6, 9
    gen = torch.Generator().manual_seed(int(scale * 100))
    logits = scale * torch.randn(batch, width + 1, vocab, generator=gen)
    keys = torch.tensor([sample_key(7, 2, i, 1) for i in range(batch)])
    starts = torch.randint(0, 300, (batch,), generator=gen)
    dense = _rows(logits, keys, starts, params)
    lens = torch.tensor([0, 3, 9, 9, 5, 1])
    wrong_at = [None, None, None, 4, 0, 0]            # the first rejected index, if any
    draft = dense[:, :width].clone()
    for r, j in enumerate(wrong_at):
        if j is not None:
            draft[r, j] = (draft[r, j] + 1) % vocab
    res = verify_keyed(logits, draft, lens, keys, starts, params, ())
    expected = [int(lens[r]) if j is None else j for r, j in enumerate(wrong_at)]
    assert res.accepted.tolist() == expected
    assert res.next_token.tolist() == [int(dense[r, n]) for r, n in enumerate(expected)]


@pytest.mark.parametrize("rule", [verify_residual, verify_lenient])
def test_ratio_rules_ignore_padding(rule):
    """Padded draft ids (kept inside [-1, V)), draft probabilities and logits change nothing."""
    logits, keys, starts = _problem(4, 5, seed=3)
    gen = torch.Generator().manual_seed(4)
    q = torch.softmax(torch.randn(4, 5, V, generator=gen), -1)
    draft = torch.randint(0, V, (4, 5), generator=gen)
    lens = torch.tensor([5, 0, 2, 3])
    past = torch.arange(5) >= lens.view(-1, 1)          # padded draft slots
    results = []
    for _ in range(3):
        d = torch.where(past, torch.randint(-1, V, draft.shape, generator=gen), draft)
        junk_q = torch.softmax(torch.randn(q.shape, generator=gen), -1)
        qq = torch.where(past.unsqueeze(-1), junk_q, q)
        lg = logits.clone()
        for r, n in enumerate(lens.tolist()):
            lg[r, n + 1:] = 50.0 * torch.randn(5 - n, V, generator=gen)
        results.append(rule(lg, qq, d, lens, keys, starts, T1, (EOS,)))
    for res in results[1:]:
        for field in ("accepted", "next_token", "finished"):
            assert torch.equal(getattr(res, field), getattr(results[0], field))


def _bad_shapes():
    lg, d, n = torch.zeros(2, 4, V), torch.zeros(2, 3, dtype=torch.int64), torch.tensor([1, 3])
    return {
        "logits 2-d": (torch.zeros(4, V), d, n),
        "draft 1-d": (lg, torch.zeros(3, dtype=torch.int64), n),
        "draft too long": (lg, torch.zeros(2, 4, dtype=torch.int64), n),
        "draft batch": (lg, torch.zeros(3, 3, dtype=torch.int64), n),
        "lens shape": (lg, d, torch.tensor([1, 2, 3])),
        "lens 2-d": (lg, d, torch.tensor([[1, 3]])),
        "lens negative": (lg, d, torch.tensor([-1, 0])),
        "lens too big": (lg, d, torch.tensor([4, 0])),
    }


@pytest.mark.parametrize("case", list(_bad_shapes()))
def test_invalid_shapes_raise_value_error(case):
    logits, draft, lens = _bad_shapes()[case]
    keys, starts = torch.tensor([1, 2]), torch.tensor([0, 0])
    with pytest.raises(ValueError):
        verify_keyed(logits, draft, lens, keys, starts, T1)
    q = torch.full(tuple(draft.shape) + (V,), 1.0 / V)
    for rule in (verify_residual, verify_lenient):
        with pytest.raises(ValueError):
            rule(logits, q, draft, lens, keys, starts, T1)


def test_ratio_rules_refuse_bad_draft_probs_greedy_and_low_lenience():
    logits, keys, starts = _problem(2, 3)
    draft, lens = torch.zeros(2, 3, dtype=torch.int64), torch.tensor([3, 1])
    q = torch.full((2, 3, V), 1.0 / V)
    for rule in (verify_residual, verify_lenient):
        with pytest.raises(ValueError):
            rule(logits, q[:, :2], draft, lens, keys, starts, T1)
        with pytest.raises(ValueError):
            rule(logits, q, draft, lens, keys, starts, SamplingParams(0.0))
    with pytest.raises(ValueError):
        verify_lenient(logits, q, draft, lens, keys, starts, T1, lenience=0.5)


# ------------------------------------------------- exactness in distribution (one token)

N_DRAWS = 20000
P_LOGITS = torch.tensor([1.5, 1.0, 0.5, 0.0, -0.5, -1.0], dtype=torch.float64)
Q = torch.softmax(torch.tensor([-1.0, 0.0, 0.5, 0.5, 1.0, 1.5], dtype=torch.float64), -1)
P = torch.softmax(P_LOGITS, -1)


def _keyed_rule(target_logits, draft_probs, *args, **kwargs):
    return verify_keyed(target_logits, *args)


RULES = {"keyed": _keyed_rule, "residual": verify_residual, "lenient": verify_lenient}


@functools.lru_cache(maxsize=None)
def _keys(seed, uid):
    return torch.tensor([sample_key(seed, 4, uid, i) for i in range(N_DRAWS)])


def _one_token_experiment(rule, **kwargs):
    """Draft y ~ q by an independent keyed draw, verify it against p; -> (y, Verdict)."""
    n, v = N_DRAWS, P.numel()
    keys, draft_keys = _keys(11, "verify"), _keys(12, "draft")
    starts = torch.full((n,), 9)
    y = keyed_sample(Q.log().expand(n, v), draft_keys, starts, T1)
    res = RULES[rule](P_LOGITS.expand(n, 2, v), Q.expand(n, 1, v), y.view(n, 1),
                      torch.ones(n, dtype=torch.int64), keys, starts, T1, **kwargs)
    return y, res


def _pvalue(tokens, probs):
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0
    keep = probs > 0
    return chisquare(counts[keep].numpy(), (probs[keep] * counts.sum()).numpy()).pvalue


@pytest.mark.parametrize("rule,kwargs", [("keyed", {}), ("residual", {}),
                                         ("lenient", {"lenience": 3.0}),
                                         ("lenient", {"lenience": 1.0})],
                         ids=["keyed", "residual", "lenient-3", "lenient-1"])
def test_first_token_follows_p_exactly_for_the_exact_rules_only(rule, kwargs):
    y, res = _one_token_experiment(rule, **kwargs)
    assert _pvalue(y, Q) > 1e-3                        # the drafts really are q-distributed
    first = torch.where(res.accepted == 1, y, res.next_token)
    pvalue = _pvalue(first, P)
    if REGISTERED[rule].exact:
        assert pvalue > 1e-3
    else:
        assert pvalue < 1e-6


def test_residual_rejections_follow_the_residual_distribution():
    y, res = _one_token_experiment("residual")
    rejected = res.accepted == 0
    accept_prob = float(torch.minimum(P, Q).sum())
    assert binomtest(int(rejected.sum()), N_DRAWS, 1 - accept_prob).pvalue > 1e-3
    residual = (P - Q).clamp_min(0)
    assert _pvalue(res.next_token[rejected], residual / residual.sum()) > 1e-3


def test_every_labelled_rule_is_measured():
    """The exactness labels are checked against the draws above for every rule that has one."""
    assert set(REGISTERED) == set(RULES)


@pytest.mark.parametrize("rule", [verify_residual, verify_lenient])
def test_ratio_rules_accept_any_padding_value_and_skip_vocab_padding(rule):
    """Padding ids outside the vocabulary are ignored, and padded vocabulary columns never drawn."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 8, generator=g)
    logits[..., 6:] = 40.0  # two padded vocabulary columns with huge logits
    q = torch.softmax(torch.randn(2, 2, 8, generator=g), -1)
    draft = torch.tensor([[1, 2], [99, -5]])
    out = rule(logits, q, draft, torch.tensor([2, 0]), torch.tensor([5, 6]), torch.tensor([0, 0]),
               SamplingParams(1.0), vocab_size=6)
    assert int(out.accepted[1]) == 0 and 0 <= int(out.next_token[1]) < 6
    assert int(out.next_token[0]) < 6


def test_settle_eos_keeps_up_to_the_first_eos():
    assert settle_eos([4, 2, 7, 2], {2}) == (2, True)
    assert settle_eos([4, 2, 7], {3}) == (3, False)
    assert settle_eos([], {2}) == (0, False)
    assert settle_eos([9], {9, 1}) == (1, True)


# ------------------------------------------------------------------------------ the verify stage

def test_only_drafted_requests_are_verified_and_in_rollout_drafts_settle_from_the_responses():
    """``verify_drafts``: requests without a draft reach the engine unchanged (it draws the same
    first token a verifier would); a verifier's answer lands in its requests' places; drafts
    verified inside the rollout settle from the responses' common prefix with the draft."""
    from megatron_bubblespec.sampling.requests import RolloutRequest, RolloutResult
    from megatron_bubblespec.speculative.verifier import InRolloutVerifier, VerifiedDrafts, verify_drafts

    requests = [RolloutRequest(f"s0-{i}", [5, 6], i, 8, response_prefix=[9] * (i == 2))
                for i in range(4)]
    drafts = [(), (3, 4, 5), (), (7, 300)]   # 300 is outside the vocabulary: dropped

    class Recording:
        every_step = False

        def verify(self, reqs, given):
            self.seen = [r.request_id for r in reqs], given
            return VerifiedDrafts(list(reqs), [len(d) for d in given], [2, 0][:len(reqs)], 0.5)

    recording = Recording()
    out = verify_drafts(recording, requests, drafts)
    assert recording.seen == (["s0-1", "s0-3"], [[3, 4, 5], [7, 300]])
    assert out.drafted == [0, 3, 0, 2] and out.accepted == [0, 2, 0, 0] and out.seconds == 0.5
    assert out.requests[0] is requests[0] and out.requests[2] is requests[2]
    assert verify_drafts(None, requests, [()] * 4).requests == requests
    recording.seen = None
    assert verify_drafts(recording, requests, [()] * 4).drafted == [0] * 4
    assert recording.seen is None            # nothing to verify, and no peer waits for it
    recording.every_step = True              # a collective (expert parallelism): called anyway
    assert verify_drafts(recording, requests, [()] * 4).seconds == 0.5
    assert recording.seen == ([], [])

    with pytest.warns(RuntimeWarning, match="'s0-3'.*dropped"):
        inside = verify_drafts(InRolloutVerifier(vocab_size=100), requests, drafts)
    assert [r.draft for r in inside.requests] == [[], [3, 4, 5], [], []]
    assert inside.drafted == [0, 3, 0, 2] and inside.accepted == [0, None, 0, None]
    responses = [RolloutResult(r.request_id, tokens, [0.0] * len(tokens), len(tokens), "eos")
                 for r, tokens in zip(inside.requests, ([1], [3, 4, 6, 2], [9, 1], [7, 1]))]
    assert inside.settled(responses) == [0, 2, 0, 0]
