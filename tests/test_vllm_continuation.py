"""Speculative continuation inside vLLM: proposals from a draft pool, verified in vLLM's spec step.

Whatever is proposed, the tokens must equal plain keyed decoding token for token and the raw
logprobs must stay within 1e-6 (CPU float32): true, corrupted, random, shifted and empty
proposals, an EOS inside accepted proposals, continuation from a verified prefix, T = 1, greedy and
T = 0.7 with top-p, and a batch where only some requests have a pool. The reference engine with
continuation on proposes the same tokens (the same ``speculative.pool.Continuation``), so it must
agree token for token and in its proposed / accepted counts. The same with every proposal source on
(the prompt's text and the sample's own text besides the drafts), counted per source. Also: the
version pin, the proposer's adaptive pause, the proposal index's sources, and that proposals really
do save engine steps (else the test would be vacuous).

One plain and one continuation engine per module on a tiny random Llama (vocab 256, head_dim 32).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("vllm")

from megatron_bubblespec.sampling.draw_words import Keying  # noqa: E402
from megatron_bubblespec.rollout.reference import ReferenceEngine  # noqa: E402
from megatron_bubblespec.rollout.vllm_engine import VLLMEngine  # noqa: E402
from megatron_bubblespec.sampling import SamplingParams, sample_key  # noqa: E402
from megatron_bubblespec.sampling.requests import Proposals, RolloutRequest  # noqa: E402
from megatron_bubblespec.speculative.continuation import ContinuationSettings  # noqa: E402
from megatron_bubblespec.speculative.pool import Continuation, DraftPool, PromptIndex, Siblings  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = 256
MAX_NEW = 48
SPEC_K = 4


def _settings(*overrides: str) -> ContinuationSettings:
    """These tests' engines: up to SPEC_K tokens a step, matches of 2 .. 8 tokens, proposing from
    the prompt's drafts only, always k tokens, drafts verified outside the engine; then
    ``overrides`` (config keys)."""
    return ContinuationSettings.of(f"spec.spec_k={SPEC_K}", "spec.min_match=2", "spec.max_match=8",
                                   "spec.proposal_sources=[bubble,realign]",
                                   "spec.proposal_token_cost=null", "spec.verifier=megatron",
                                   "ablation.reuse_draft_kv=false", *overrides)
LOGPROB_TOL = 1e-6
# T1-context2: draws keyed by their last 2 tokens (rollout.keying), so a draft's row j is keyed
# by the proposed tokens before it
PARAMS = {"T1": SamplingParams(1.0), "greedy": SamplingParams(0.0),
          "T0.7-p0.9": SamplingParams(0.7, top_p=0.9),
          "T1-context2": SamplingParams(1.0, keying=Keying.parse("context2"))}
PROMPT_LENGTHS = [3, 5, 8, 13, 21, 6]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama", seed=0, vocab_size=VOCAB, hidden_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def keys(prompts):
    return [sample_key(77, 1, i, 0) for i in range(len(prompts))]


@pytest.fixture(scope="module")
def plain_engine(checkpoint):
    return VLLMEngine(checkpoint, max_model_len=512, seed=0)


@pytest.fixture(scope="module")
def spec_engine(checkpoint):
    engine = VLLMEngine(checkpoint, max_model_len=512, seed=0, continuation=_settings())
    yield engine
    assert not engine.has_unfinished()


def _requests(tag, prompts, keys, pools=None, prefixes=None, eos=None, max_new=MAX_NEW):
    n = len(prompts)
    pools, prefixes, eos = pools or [[]] * n, prefixes or [[]] * n, eos or [()] * n
    return [RolloutRequest(f"{tag}-{i}", p, keys[i], max_new, response_prefix=list(prefixes[i]),
                           eos_token_ids=tuple(eos[i]), proposals=Proposals(pools[i]))
            for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def plain(plain_engine, prompts, keys):
    """Plain keyed decoding (an engine without any speculative config), per sampling setting."""
    return {name: plain_engine.generate(_requests(f"plain-{name}", prompts, keys), params)
            for name, params in PARAMS.items()}


def _corrupt(tokens, every, rng):
    return [rng.randrange(3, VOCAB) if j % every == every - 1 else t for j, t in enumerate(tokens)]


def _shift(tokens, rng):
    """Insertions and deletions: the draft's text, out of step with the response's positions."""
    out = []
    for j, t in enumerate(tokens):
        if j % 9 == 4:
            continue                           # deletion
        out.append(t)
        if j % 11 == 7:
            out.append(rng.randrange(3, VOCAB))  # insertion
    return out


def _pools(kind, responses, seed=0):
    rng = random.Random(seed)
    if kind == "true":
        return [[r] for r in responses]
    if kind == "corrupted":
        return [[_corrupt(r, 7, rng)] for r in responses]
    if kind == "random":   # random tokens after true bigrams, so that they are proposed at all
        return [[r[j:j + 2] + [rng.randrange(3, VOCAB) for _ in range(6)]
                 for j in range(0, len(r), 8)] for r in responses]
    if kind == "shifted":
        return [[_shift(r, rng)] for r in responses]
    if kind == "empty":
        return [[[]] for _ in responses]
    if kind == "siblings":   # only the other samples' texts, plus the own text shifted
        return [[_shift(r, rng)] + [o for j, o in enumerate(responses) if j != i]
                for i, r in enumerate(responses)]
    raise ValueError(kind)


def _assert_same(got, want, label, tol=LOGPROB_TOL):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, f"{label}: request {i} tokens differ"
        assert g.finish_reason == w.finish_reason, f"{label}: request {i}"
        assert len(g.logprobs) == len(w.logprobs)
        diff = max((abs(a - b) for a, b in zip(g.logprobs, w.logprobs)), default=0.0)
        assert diff <= tol, f"{label}: request {i} logprobs differ by {diff:.2e}"


@pytest.mark.parametrize("kind", ["true", "corrupted", "random", "shifted", "empty", "siblings"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_continuation_equals_plain_keyed_decoding(spec_engine, plain, prompts, keys, kind, name):
    want = plain[name]
    pools = _pools(kind, [r.token_ids for r in want])
    got = spec_engine.generate(_requests(f"{kind}-{name}", prompts, keys, pools), PARAMS[name])
    _assert_same(got, want, f"{kind}/{name}")
    proposed = sum(r.proposed_tokens for r in got)
    accepted = sum(r.accepted_tokens for r in got)
    steps = spec_engine.last_engine_steps
    assert all(r.accepted_tokens <= r.proposed_tokens for r in got)
    assert all(r.decode_steps <= w.decode_steps for r, w in zip(got, want))
    if kind == "empty":
        assert proposed == 0 and steps == MAX_NEW
    elif kind == "true":
        assert accepted > 0.8 * proposed
        # greedy text of a random model loops, and a loop's earliest n-gram match may be wrong
        bound = MAX_NEW // 2 if name == "greedy" else MAX_NEW // SPEC_K + 2
        assert steps <= bound, f"{steps} engine steps for true proposals"
    elif kind in ("corrupted", "shifted", "siblings"):
        assert 0 < accepted < proposed and steps < MAX_NEW
    if kind != "empty":
        assert proposed > 0


def test_eos_inside_accepted_proposals(spec_engine, plain, prompts, keys):
    want = plain["T1"]
    stops, eos = [], []
    for r in want:
        tokens = r.token_ids
        stop = next(j for j in range(10, len(tokens)) if tokens[j] not in tokens[:j])
        stops.append(stop)
        eos.append((tokens[stop],))
    pools = _pools("true", [r.token_ids for r in want])
    got = spec_engine.generate(_requests("eos", prompts, keys, pools, eos=eos), PARAMS["T1"])
    for i, (r, w, stop) in enumerate(zip(got, want, stops)):
        assert r.finish_reason == "eos", f"request {i}"
        assert r.token_ids == w.token_ids[:stop + 1]
        assert max(abs(a - b) for a, b in zip(r.logprobs, w.logprobs)) <= LOGPROB_TOL
        # the EOS itself was a proposal: accepted counts stop at it, never past the response
        assert 0 < r.accepted_tokens <= stop
    assert spec_engine.last_engine_steps < max(stops)


def test_continuation_from_a_verified_prefix(spec_engine, plain, prompts, keys):
    want = plain["T0.7-p0.9"]
    cuts = [0, 1, 5, 17, 30, MAX_NEW - 1]
    prefixes = [r.token_ids[:c] for r, c in zip(want, cuts)]
    pools = _pools("corrupted", [r.token_ids for r in want], seed=5)
    got = spec_engine.generate(_requests("prefix", prompts, keys, pools, prefixes),
                               PARAMS["T0.7-p0.9"])
    _assert_same(got, want, "prefix")
    for r, c in zip(got, cuts):
        assert r.decode_steps <= max(0, MAX_NEW - c - 1)
    assert sum(r.accepted_tokens for r in got) > 0


def test_mixed_batch_some_with_pools(spec_engine, plain, prompts, keys):
    want = plain["T1"]
    true = _pools("true", [r.token_ids for r in want])
    pools = [true[i] if i % 2 == 0 else [] for i in range(len(prompts))]
    got = spec_engine.generate(_requests("mix", prompts, keys, pools), PARAMS["T1"])
    _assert_same(got, want, "mix")
    for i, r in enumerate(got):
        if i % 2:
            assert r.proposed_tokens == 0 and r.decode_steps == MAX_NEW - 1
        else:
            assert r.accepted_tokens > 0 and r.decode_steps < MAX_NEW - 1
    # the requests without a pool set the pace: one engine step per token
    assert spec_engine.last_engine_steps == MAX_NEW


def test_aborted_requests_report_their_counts(spec_engine, plain, prompts, keys):
    want = plain["T1"]
    spec_engine.add(_requests("abort", prompts, keys, _pools("true", [r.token_ids for r in want])),
                    PARAMS["T1"])
    for _ in range(3):
        spec_engine.step()
    aborted = spec_engine.abort()
    assert len(aborted) == len(prompts)
    for r, w in zip(aborted, want):
        assert r.token_ids == w.token_ids[:len(r.token_ids)]
        assert len(r.token_ids) == 1 + 2 * (SPEC_K + 1)   # prefill, then two full spec steps
        assert r.accepted_tokens == 2 * SPEC_K
    assert not spec_engine.llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("name", ["T1", "T0.7-p0.9", "T1-context2"])
def test_reference_engine_agrees_with_continuation_on(checkpoint, spec_engine, plain, prompts, keys,
                                                      name):
    want = plain[name]
    pools = _pools("siblings", [r.token_ids for r in want], seed=11)
    prefixes = [r.token_ids[:c] for r, c in zip(want, [0, 3, 0, 9, 0, 1])]
    reference = ReferenceEngine(checkpoint, continuation=_settings())
    ref = reference.generate(_requests(f"ref-{name}", prompts, keys, pools, prefixes), PARAMS[name])
    got = spec_engine.generate(_requests(f"agree-{name}", prompts, keys, pools, prefixes),
                               PARAMS[name])
    for i, (r, v, w) in enumerate(zip(ref, got, want)):
        assert r.token_ids == v.token_ids == w.token_ids, f"request {i}"
        assert (r.proposed_tokens, r.accepted_tokens, r.decode_steps) == \
            (v.proposed_tokens, v.accepted_tokens, v.decode_steps), f"request {i}"
    assert reference.last_engine_steps == spec_engine.last_engine_steps
    assert sum(r.accepted_tokens for r in got) > 0


def test_continuation_pauses_after_misses():
    prompt, draft = [1, 2, 3], [10, 11, 12, 13, 14, 15, 16, 17]
    c = Continuation(DraftPool(prompt, [draft]), k=3)
    context = prompt + draft[:2]
    proposals = []
    for _ in range(12):
        proposal = c.propose(context, budget=10)
        proposals.append(len(proposal))
        c.record(proposal, 0)
    # two misses, a pause of 1; two misses, a pause of 2; two misses, a pause of 4 ...
    assert proposals == [3, 3, 0, 3, 3, 0, 0, 3, 3, 0, 0, 0]
    assert (c.proposed, c.accepted) == (18, 0)
    c = Continuation(DraftPool(prompt, [draft]), k=3)
    for accepted in (0, 2, 0):   # a hit between two misses: no pause
        proposal = c.propose(context, budget=10)
        assert proposal == [12, 13, 14]
        c.record(proposal, accepted)
    assert c.propose(context, budget=2) == [12, 13]   # the budget caps k
    assert c.propose(context, budget=0) == []
    assert (c.proposed, c.accepted) == (9, 2)


ALL_SOURCES = ("bubble", "realign", "prompt", "history", "self", "siblings")
SOURCES_OPTIONS = dict(
    continuation=_settings(f"spec.proposal_sources=[{','.join(ALL_SOURCES)}]"))
ADAPTIVE_OPTIONS = dict(continuation=_settings(
    f"spec.proposal_sources=[{','.join(ALL_SOURCES)}]", "spec.proposal_token_cost=0.4"))


# Every vLLM engine of this module lives until the module ends: an in-process engine's teardown
# takes vLLM's per-process distributed state with it, for the module's other engines too.
@pytest.fixture(scope="module")
def sources_engine(checkpoint):
    return VLLMEngine(checkpoint, max_model_len=512, seed=0, **SOURCES_OPTIONS)


@pytest.fixture(scope="module")
def adaptive_engine(checkpoint):
    return VLLMEngine(checkpoint, max_model_len=512, seed=0, **ADAPTIVE_OPTIONS)


def test_every_proposal_source_keeps_the_tokens_and_both_engines_agree(checkpoint, sources_engine,
                                                                      plain_engine, plain,
                                                                      prompts, keys):
    """Every source at once: the plain tokens, the same proposals and per-source counts in both
    engines, and each source's proposals both accepted and rejected over T = 1 and greedy.

    Three prompts, two samples each (other keys), so each sample has a sibling; the first of a
    pair starts from a fixed prefix, ahead of its sibling (one token of it off the greedy text, so
    greedy siblings differ). Each prompt quotes the text the model goes on to write (greedy text
    of a random model loops), so the prompt source has something to propose. The first pair has
    bubble drafts (each sample's own draft, shifted, is its ``realign`` source; the other's
    response its ``bubble`` source), the second a history (the start of its greedy response,
    with every fifth token wrong), the third neither: the static sources would otherwise win
    every tie."""
    engine = sources_engine
    reference = ReferenceEngine(checkpoint, **SOURCES_OPTIONS)
    quoted = [p + r.token_ids[:40] for p, r in zip(prompts, plain["greedy"])]
    pairs = [quoted[i // 2] for i in range(6)]
    greedy = plain_engine.generate(_requests("greedy", pairs, keys), PARAMS["greedy"])
    history = _corrupt(greedy[2].token_ids[:24], 5, random.Random(2))
    prefixes = [g.token_ids[:5] + [(g.token_ids[5] + 1) % VOCAB] + g.token_ids[6:12]
                if i % 2 == 0 else [] for i, g in enumerate(greedy)]
    totals = {source: [0, 0] for source in ALL_SOURCES}
    for name in ("T1", "greedy"):
        pools = _pools("siblings", [r.token_ids for r in plain[name]], seed=5)[:2] + [[]] * 4

        def requests(tag, with_sources=True):
            out = _requests(tag, pairs, keys, pools if with_sources else None, prefixes)
            for request in out[2:4] if with_sources else ():
                request.proposals.history = [history]
            for request in out[:2] if with_sources else ():
                request.proposals.own = 0   # the "siblings" pools: the own draft first
            return out

        base = plain_engine.generate(requests(f"base-{name}", False), PARAMS[name])
        got = engine.generate(requests(f"all-{name}"), PARAMS[name])
        ref = reference.generate(requests(f"ref-all-{name}"), PARAMS[name])
        for i, (v, r, b) in enumerate(zip(got, ref, base)):
            assert v.token_ids == r.token_ids == b.token_ids, f"{name}, request {i}"
            assert v.by_source == r.by_source, f"{name}, request {i}"
            assert (v.proposed_tokens, v.accepted_tokens) == (
                sum(p for p, _ in v.by_source.values()), sum(a for _, a in v.by_source.values()))
            for source, (proposed, accepted) in v.by_source.items():
                totals[source][0] += proposed
                totals[source][1] += accepted
        assert engine.last_engine_steps == reference.last_engine_steps, name
    assert all(0 < accepted < proposed for proposed, accepted in totals.values()), totals


def test_the_proposal_index_takes_the_longest_match_then_the_earlier_source():
    prompt = [1, 2, 3, 4, 5, 6]
    pool = DraftPool(prompt, [[7, 8, 9]], 2, 8, sources=ALL_SOURCES)
    # "5 6" follows the prompt in the draft (prompt + draft) and nowhere else: the draft proposes
    assert pool.propose(prompt, 3) == ([7, 8, 9], "bubble")
    # "2 3" is in the prompt and in prompt + draft: the prompt comes first
    assert pool.propose([9, 2, 3], 2) == ([4, 5], "prompt")
    drafts_only = DraftPool(prompt, [[7, 8, 9]], 2, 8, sources=("bubble",))
    assert drafts_only.propose([9, 2, 3], 2) == ([4, 5], "bubble")
    # "8 9 4 5" in the own text is longer than "4 5" in the prompt: the longest match wins
    longest = Continuation(DraftPool(prompt, [[7, 8, 9]], 2, 8, sources=ALL_SOURCES), k=3)
    assert longest.propose(prompt + [8, 9, 4, 5, 30, 8, 9, 4, 5], budget=10) == [30, 8, 9]
    assert longest.pool.propose(prompt + [8, 9, 4, 5, 30, 8, 9, 4, 5], 3)[1] == "self"
    own = DraftPool(prompt, [], 2, 8, sources=("self",))
    text = prompt + [20, 21, 22, 23, 20, 21]
    assert own.propose(text, 3) == ([], None)        # nothing observed yet
    c = Continuation(own, k=3)
    assert c.propose(text, budget=10) == [22, 23, 20]   # observed, then "20 21" -> "22 23 20"
    c.record([22, 23, 20], 2)
    assert c.counts == {"self": [3, 2]} and (c.proposed, c.accepted) == (3, 2)
    with pytest.raises(ValueError, match="unknown proposal sources"):
        DraftPool(prompt, [], sources=("elsewhere",))


def test_a_samples_own_draft_is_realign_and_the_others_drafts_are_bubble():
    """One index shared by two samples with a draft each: the own draft, met again after the
    response left it, proposes as ``realign``, the sibling's as ``bubble``; each can be switched
    off alone, and a sample without a draft of its own sees every draft as ``bubble``."""
    prompt = [1, 2, 3]
    drafts = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23]]
    registry = Siblings(2, 8, ("bubble", "realign", "siblings"))
    a = registry.pool("a", prompt, drafts, own_draft=0)
    b = registry.pool("b", prompt, drafts, own_draft=1)
    newcomer = registry.pool("c", prompt, drafts)
    assert a.index is b.index is newcomer.index
    diverged = prompt + [10, 11, 99, 12, 13]   # one token off the draft, then back on it
    assert a.propose(diverged, 2) == ([14, 15], "realign")
    assert b.propose(diverged, 2) == ([14, 15], "bubble")
    assert newcomer.propose(prompt + [5, 20, 21], 2) == ([22, 23], "bubble")
    assert b.propose(prompt + [5, 20, 21], 2) == ([22, 23], "realign")
    only_others = DraftPool(prompt, drafts, 2, 8, sources=("bubble",), member="a", own_draft=0)
    assert only_others.propose(diverged, 2) == ([], None)
    assert only_others.propose(prompt + [20, 21], 2) == ([22, 23], "bubble")
    only_own = DraftPool(prompt, drafts, 2, 8, sources=("realign",), member="a", own_draft=0)
    assert only_own.propose(diverged, 2) == ([14, 15], "realign")
    assert only_own.propose(prompt + [20, 21], 2) == ([], None)
    c = Continuation(only_own, k=2)
    c.record(c.propose(diverged, budget=10), 1)
    assert c.by_source() == {"realign": (2, 1)}


def test_a_prompts_samples_share_one_index_and_propose_from_each_other():
    """siblings: a sample proposes what its prompt's other samples wrote; its own text is
    ``self``; earlier responses are ``history``; each source can be switched off alone; the
    index goes when the prompt's last sample leaves. A member called like a source is still a
    member."""
    prompt = [1, 2, 3]
    registry = Siblings(2, 8, ALL_SOURCES)
    ahead = registry.pool("prompt", prompt, history=[[40, 41, 42, 43]])
    behind = registry.pool("b", prompt, history=[[40, 41, 42, 43]])
    assert ahead.index is behind.index and len(registry.indexes) == 1
    ahead.observe(prompt + [10, 11, 12, 13, 14])
    assert behind.propose(prompt + [10, 11], 2) == ([12, 13], "siblings")
    assert ahead.propose(prompt + [10, 11], 2) == ([12, 13], "self")
    assert behind.propose(prompt + [40, 41], 3) == ([42, 43], "history")
    alone = Siblings(2, 8, ("bubble", "self"))   # no siblings: every sample its own index
    a, b = alone.pool("a", prompt), alone.pool("b", prompt)
    a.observe(prompt + [10, 11, 12])
    assert a.index is not b.index and b.propose(prompt + [10, 11], 2) == ([], None)
    no_self = PromptIndex(prompt, sources=("siblings",))
    no_self.join("a")
    no_self.extend("a", [10, 11, 12])
    assert no_self.propose("a", prompt + [10, 11], 2) == ([], None)
    assert no_self.propose("b", prompt + [10, 11], 2) == ([12], "siblings")
    registry.leave("prompt")
    assert len(registry.indexes) == 1   # the sibling still decodes: the texts stay
    registry.leave("b")
    assert registry.indexes == {}


def test_patches_refuse_another_vllm_version(monkeypatch):
    import vllm

    from megatron_bubblespec.rollout import vllm_patches

    monkeypatch.setattr(vllm_patches, "_INSTALLED", False)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match="0.32.0 in process, but vLLM 0.33.0"):
        vllm_patches.install()


# ---------------------------------------------------------------- drafts verified in the rollout

def test_own_draft_is_proposed_whole_until_the_response_leaves_it():
    prompt, draft = [1, 2, 3], [10, 11, 12, 13, 14, 15]
    c = Continuation(DraftPool(prompt, [], sources=()), k=3, draft=draft)
    assert c.propose(prompt + [10], budget=10) == [11, 12, 13, 14, 15]   # after the prefill
    c.record([11, 12, 13, 14, 15], 2)
    assert c.draft_counts == [5, 2] and c.counts == {}   # apart from the pool's counts
    assert c.propose(prompt + [10, 11, 12, 99], budget=10) == []   # left it: the draft is over
    assert c.propose(prompt + [10, 11, 12, 99, 13], budget=10) == [] and c.draft is None
    capped = Continuation(DraftPool(prompt, [], sources=()), k=3, draft=draft, draft_k=2)
    assert capped.propose(prompt + [10], budget=10) == [11, 12]
    assert capped.propose(prompt + [10, 11, 12], budget=1) == [13]   # the budget caps it
    wrong_first = Continuation(DraftPool(prompt, [], sources=()), k=3, draft=draft)
    assert wrong_first.propose(prompt + [7], budget=10) == []
    # once the draft is over, the pool proposes (and only its proposals pause)
    after = Continuation(DraftPool(prompt, [[10, 11, 12, 13, 14, 15]]), k=2, draft=[10, 11])
    assert after.propose(prompt + [10], budget=10) == [11]
    after.record([11], 1)
    assert after.propose(prompt + [10, 11], budget=10) == [12, 13]
    after.record([12, 13], 2)
    assert after.by_source() == {"bubble": (2, 2)} and after.draft_counts == [1, 1]


@pytest.fixture(scope="module")
def verify_engine(checkpoint):
    """An engine that verifies requests' own drafts (spec.verifier: engine), no continuation."""
    engine = VLLMEngine(checkpoint, max_model_len=512, seed=0,
                        continuation=_settings("ablation.speculative_continuation=false",
                                               "spec.verifier=engine"))
    yield engine
    assert not engine.has_unfinished()


def _drafts(responses, rng):
    """Per request a draft kind: the whole response, a cut one, one wrong from position 9, a
    wrong first token, none, and the whole response with junk past its end."""
    kinds = [lambda r: list(r), lambda r: r[:20], lambda r: r[:9] + [(r[9] + 1) % VOCAB] + r[10:],
             lambda r: [(r[0] + 1) % VOCAB] + r[1:], lambda r: [],
             lambda r: list(r) + [rng.randrange(3, VOCAB) for _ in range(8)]]
    return [kinds[i % len(kinds)](list(r)) for i, r in enumerate(responses)]


@pytest.mark.parametrize("name", list(PARAMS))
def test_drafts_verified_inside_the_rollout_equal_plain_keyed_decoding(verify_engine, plain,
                                                                       prompts, keys, name):
    from megatron_bubblespec.speculative.verifier import InRolloutVerifier, accepted_in_rollout

    want = plain[name]
    drafts = _drafts([r.token_ids for r in want], random.Random(1))
    with pytest.warns(RuntimeWarning, match="truncated to 48 tokens"):   # the junk past the end
        checked = InRolloutVerifier(VOCAB).verify(_requests(f"own-{name}", prompts, keys), drafts)
    assert checked.accepted == [None] * len(prompts) and checked.seconds == 0.0
    got = verify_engine.generate(checked.requests, PARAMS[name])
    _assert_same(got, want, f"own drafts/{name}")
    accepted = [accepted_in_rollout(q, r.token_ids) for q, r in zip(checked.requests, got)]
    # the longest common prefix of draft and response (the junk past the budget was cut)
    assert accepted == [MAX_NEW, 20, 9, 0, 0, MAX_NEW]
    steps = [r.decode_steps for r in got]
    assert steps[0] == steps[5] == 1 and steps[1] == MAX_NEW - 20   # one verify step each
    assert steps[3] == steps[4] == MAX_NEW - 1                       # nothing to save
    assert verify_engine.last_engine_steps == MAX_NEW   # the undrafted requests set the pace
    assert sum(r.proposed_tokens for r in got) == 0     # no continuation counts


def test_in_rollout_verification_from_a_prefix_with_eos_and_a_malformed_draft(verify_engine,
                                                                              plain, prompts,
                                                                              keys):
    from megatron_bubblespec.speculative.verifier import InRolloutVerifier, accepted_in_rollout

    want = plain["T0.7-p0.9"]
    tokens = [r.token_ids for r in want]
    eos = [(t[30],) if i == 2 else () for i, t in enumerate(tokens)]
    stop = tokens[2].index(tokens[2][30])   # the response ends at the first such token
    prefixes = [[], tokens[1][:5], [], [], [], []]
    drafts = [t[len(p):] for t, p in zip(tokens, prefixes)]
    drafts[3] = drafts[3][:10] + [VOCAB + 7] + drafts[3][11:]   # an id outside the vocabulary
    requests = _requests("own-prefix", prompts, keys, prefixes=prefixes, eos=eos)
    with pytest.warns(RuntimeWarning, match="request 'own-prefix-3': draft token 263"):
        checked = InRolloutVerifier(VOCAB).verify(requests, drafts)
    assert checked.requests[3].draft == [] and checked.requests[1].draft == tokens[1]
    got = verify_engine.generate(checked.requests, PARAMS["T0.7-p0.9"])
    assert got[2].finish_reason == "eos" and got[2].token_ids == tokens[2][:stop + 1]
    _assert_same(got[:2] + got[3:], want[:2] + want[3:], "prefix/eos/malformed")
    accepted = [accepted_in_rollout(q, r.token_ids) for q, r in zip(checked.requests, got)]
    assert accepted == [MAX_NEW, MAX_NEW - 5, stop + 1, 0, MAX_NEW, MAX_NEW]


def test_a_draft_needs_an_engine_that_verifies_it(plain_engine, prompts, keys):
    request = _requests("no-verify", prompts[:1], keys)[0]
    request.draft = [5, 6, 7]
    with pytest.raises(ValueError, match="built without verify_drafts"):
        plain_engine.add([request], PARAMS["T1"])
    assert not plain_engine.has_unfinished()


def test_drafts_longer_than_the_rejection_samplers_limit_are_verified_in_pieces(
        verify_engine, plain_engine, prompts, keys):
    """vLLM verifies at most VLLM_MAX_SPEC_TOKENS proposed tokens per request and step: a longer
    draft is proposed that many tokens a step, with the same tokens as plain decoding."""
    from megatron_bubblespec.config.load import VLLM_MAX_SPEC_TOKENS
    from megatron_bubblespec.speculative.verifier import InRolloutVerifier, accepted_in_rollout

    long_new = 2 * VLLM_MAX_SPEC_TOKENS + 40
    want = plain_engine.generate(_requests("plain-long", prompts[:2], keys, max_new=long_new),
                                 PARAMS["T1"])
    drafts = [list(want[0].token_ids), want[1].token_ids[:200] + [(want[1].token_ids[200] + 1)
                                                                  % VOCAB]]
    checked = InRolloutVerifier(VOCAB).verify(
        _requests("own-long", prompts[:2], keys, max_new=long_new), drafts)
    got = verify_engine.generate(checked.requests, PARAMS["T1"])
    # a 128-token verify step is another attention shape than a one-token decode step: the raw
    # logprobs may differ in the last float32 bits (1.4e-6 seen), the tokens may not
    _assert_same(got, want, "long drafts", tol=1e-5)
    assert [accepted_in_rollout(q, r.token_ids) for q, r in zip(checked.requests, got)] == \
        [long_new, 200]
    # prefill, then ceil((long_new - 1) / limit) verify steps
    assert got[0].decode_steps == -(-(long_new - 1) // VLLM_MAX_SPEC_TOKENS)


def test_proposals_pay_at_their_acceptance_with_a_token_cost():
    """With a token cost, a sample proposes the width with the most expected tokens per step
    cost at its recent acceptance, none (a probe, then a pause) when nothing pays."""
    prompt, text = [1, 2, 3], [10, 11, 12, 13, 14, 15, 16, 17]
    fixed = Continuation(DraftPool(prompt, [text]), k=4)
    assert fixed.width() == 4 and fixed.acceptance == 0.5
    cheap = Continuation(DraftPool(prompt, [text]), k=4, token_cost=0.0)
    assert cheap.width() == 4   # free tokens: always all of k
    c = Continuation(DraftPool(prompt, [text]), k=4, token_cost=0.4)
    assert c.width() == 1       # a = 1/2: (1 + 1/2) / 1.4 beats a plain step, more does not
    for _ in range(4):          # every proposed token accepted: the acceptance climbs
        proposal = c.propose(prompt + text[:2], budget=10)
        c.record(proposal, len(proposal))
    # a = 0.85: 1 + a + a^2 + a^3 over 1 + 3 * 0.4 is the best ratio
    assert c.acceptance > 0.8 and c.width() == 3
    assert c.propose(prompt + text[:2], budget=10) == [12, 13, 14]
    c.record([12, 13, 14], 0)
    for _ in range(6):          # rejected at once, again and again: nothing pays
        c.record([12], 0)
    assert c.acceptance < 0.3 and c.width() == 0
    # from now on one-token probes (left unrecorded here), each followed by a longer pause
    widths = [len(c.propose(prompt + text[:2], budget=10)) for _ in range(60)]
    probes = [i for i, w in enumerate(widths) if w]
    assert set(widths) == {0, 1} and len(probes) >= 3
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert all(g2 > g1 or g2 == Continuation.MAX_PAUSE + 1 for g1, g2 in zip(gaps, gaps[1:]))
    with pytest.raises(ValueError, match="token_cost >= 0"):
        Continuation(DraftPool(prompt, [text]), k=4, token_cost=-1.0)


def test_adaptive_proposals_keep_the_tokens_and_both_engines_agree(checkpoint, adaptive_engine,
                                                                   plain, prompts, keys):
    """spec.proposal_token_cost: each sample's width follows its acceptance; both engines make
    the same choices (the same proposals and counts) and the tokens stay plain decoding's."""
    engine, reference = adaptive_engine, ReferenceEngine(checkpoint, **ADAPTIVE_OPTIONS)
    want = plain["T1"]
    pools = _pools("siblings", [r.token_ids for r in want], seed=5)
    got = engine.generate(_requests("adaptive", prompts, keys, pools), PARAMS["T1"])
    ref = reference.generate(_requests("ref-adaptive", prompts, keys, pools), PARAMS["T1"])
    _assert_same(got, want, "adaptive")
    for i, (v, r) in enumerate(zip(got, ref)):
        assert v.token_ids == r.token_ids and v.by_source == r.by_source, f"request {i}"
    proposed = sum(r.proposed_tokens for r in got)
    accepted = sum(r.accepted_tokens for r in got)
    assert 0 < accepted < proposed
    assert engine.last_engine_steps == reference.last_engine_steps


SUFFIX_OPTIONS = dict(continuation=_settings("spec.proposal_sources=[suffix]",
                                             "spec.suffix_k=24"))


@pytest.fixture(scope="module")
def suffix_engine(checkpoint):
    return VLLMEngine(checkpoint, max_model_len=512, seed=0, **SUFFIX_OPTIONS)


def test_suffix_proposals_run_past_spec_k_keep_the_tokens_and_both_engines_agree(
        checkpoint, suffix_engine, plain, prompts, keys):
    """The suffix source proposes as many tokens as its match is long (up to spec.suffix_k = 24,
    past spec_k = 4). Half the requests hold their true response as a sibling's draft: the match
    runs over the whole prompt, so proposals are long and accepted, and such a request takes
    fewer decode steps than spec_k-token proposals would allow; the other half hold a corrupted
    one, so proposals are also rejected. At T = 1, greedy and T = 0.7 with top-p the tokens stay
    plain decoding's, and the reference engine proposes the same."""
    reference = ReferenceEngine(checkpoint, **SUFFIX_OPTIONS)
    totals = [0, 0]
    for name, params in PARAMS.items():
        responses = [r.token_ids for r in plain[name]]
        pools = _pools("true", responses)[:3] + _pools("corrupted", responses, seed=4)[3:]
        got = suffix_engine.generate(_requests(f"suffix-{name}", prompts, keys, pools), params)
        ref = reference.generate(_requests(f"ref-suffix-{name}", prompts, keys, pools), params)
        _assert_same(got, plain[name], f"suffix, {name}")
        for i, (v, r) in enumerate(zip(got, ref)):
            assert (v.token_ids, v.by_source, v.decode_steps) == \
                (r.token_ids, r.by_source, r.decode_steps), f"{name}, request {i}"
            proposed, accepted = v.by_source.get("suffix", (0, 0))
            totals[0] += proposed
            totals[1] += accepted
        assert suffix_engine.last_engine_steps == reference.last_engine_steps, name
        # fewer decode steps than tokens / (spec_k + 1): some step accepted more than spec_k
        assert any(v.decode_steps < len(v.token_ids) / (SPEC_K + 1) for v in got[:3]), name
    assert 0 < totals[1] < totals[0], totals


@pytest.fixture(scope="module")
def measured_engine(checkpoint):
    from megatron_bubblespec.rollout.factory import build_engine

    return build_engine(checkpoint, kind="vllm", max_model_len=512, seed=0,
                        measure_cost_at_rows=4, **ADAPTIVE_OPTIONS)


def test_a_cost_measured_at_start_up_sets_the_widths_and_keeps_the_tokens(measured_engine, plain,
                                                                          plain_engine, prompts,
                                                                          keys):
    """ablation.measure_proposal_cost: the factory's engine times plain and verify steps at start-up
    and proposes by the measured cost from then on; the tokens stay plain decoding's."""
    engine = measured_engine
    measured = engine.spec_token_cost
    assert measured != ADAPTIVE_OPTIONS["continuation"].token_cost and 0.0 <= measured <= 10.0
    assert not engine.has_unfinished()
    assert engine.continuation.sources == ALL_SOURCES   # restored after the measurement
    want = plain["T1"]
    pools = _pools("siblings", [r.token_ids for r in want], seed=5)
    requests = _requests("measured", prompts, keys, pools)
    for request in requests:
        request.proposals.own = 0   # the "siblings" pools: the own draft first
    got = engine.generate(requests, PARAMS["T1"])
    _assert_same(got, want, "measured cost")
    # the measurement proposed from the drafts only; the rollouts after it use every source
    assert any(r.by_source.get("realign", (0, 0))[0] for r in got)
    with pytest.raises(ValueError, match="needs speculative continuation on"):
        plain_engine.measure_proposal_cost(4)


@pytest.mark.parametrize("engine_name", ["plain_engine", "verifying_engine"])
def test_a_drafting_request_asks_for_no_logprobs_and_keeps_the_tokens(request, engine_name, plain,
                                                                     prompts, keys):
    """Bubble drafts are tokens only: a drafting request extending a partial draft gets no
    logprobs (vLLM would run a full-vocabulary pass over every prefix position, and a spec-decode
    step two more copies of its logits), NaN in their place, and the same tokens; the same
    requests as rollouts get the plain logprobs."""
    engine = request.getfixturevalue(engine_name)
    want = plain["T1"]
    cuts = [0, 1, 5, 17, 30, MAX_NEW - 1]
    prefixes = [r.token_ids[:c] for r, c in zip(want, cuts)]
    drafts = _requests(f"drafting-{engine_name}", prompts, keys, prefixes=prefixes)
    for draft in drafts:
        draft.drafting = True
    got = engine.generate(drafts, PARAMS["T1"])
    for r, w in zip(got, want):
        assert r.token_ids == w.token_ids
        assert all(x != x for x in r.logprobs)   # NaN
    rollouts = engine.generate(_requests(f"rollout-{engine_name}", prompts, keys,
                                         prefixes=prefixes), PARAMS["T1"])
    for r, w in zip(rollouts, want):
        assert r.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(r.logprobs, w.logprobs)) <= LOGPROB_TOL


@pytest.fixture(scope="module")
def verifying_engine(checkpoint):
    engine = VLLMEngine(checkpoint, max_model_len=512, seed=0,
                        continuation=_settings("spec.verifier=engine"))
    yield engine
    assert not engine.has_unfinished()


@pytest.mark.parametrize("kind", ["true", "corrupted"])
def test_a_refreshed_draft_is_the_weights_own_keyed_decoding(verifying_engine, plain, prompts,
                                                            keys, kind):
    """A bubble's refresh (spec.refresh_drafts): a drafting request carrying a complete earlier
    draft, which the engine verifies and proposes from, gives exactly what these weights draw
    from scratch, in fewer decode steps where the earlier draft agrees."""
    want = plain["T1"]
    rng = random.Random(5)
    requests = _requests(f"refresh-{kind}", prompts, keys)
    for request, response in zip(requests, want):
        old = list(response.token_ids) if kind == "true" else _corrupt(response.token_ids, 7, rng)
        request.drafting, request.draft = True, old
        request.proposals = Proposals([old], own=0)
    got = verifying_engine.generate(requests, PARAMS["T1"])
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, f"{kind}: request {i} tokens differ"
    steps = sum(r.decode_steps for r in got)
    assert steps < sum(len(w.token_ids) for w in want) / (4 if kind == "true" else 1), steps


@pytest.mark.parametrize("close_after", [None, 4])
def test_a_bubble_refreshes_complete_drafts_of_older_weights(verifying_engine, plain, prompts,
                                                             keys, close_after):
    """The bubble drafter handed complete drafts (true and corrupted) as refresh requests, the
    barrier closing once they finish or after 4 engine steps: each returned draft is a prefix of
    these weights' keyed decoding and counts as refreshed; a refresh cut while it still agrees
    with the old draft is not returned (the old draft stays, longer)."""
    import torch.distributed as dist

    from megatron_bubblespec.speculative.bubble import BubbleDrafter
    from megatron_bubblespec.speculative.claims import ClaimPolicy

    from conftest import OtherEngineArrives

    want, rng = plain["T1"], random.Random(11)
    old = {(8, i): list(r.token_ids) if i % 2 else _corrupt(r.token_ids, 5, rng)
           for i, r in enumerate(want)}
    requests = dict(zip(old, _requests(f"bubble-refresh-{close_after}", prompts, keys)))
    for sample, request in requests.items():
        request.drafting, request.draft = True, old[sample]
        request.proposals = Proposals([old[sample]], own=0)
    store = dist.HashStore()
    drafter = BubbleDrafter(store, 2, OtherEngineArrives(verifying_engine, store, 7, close_after),
                            PARAMS["T1"], ClaimPolicy(chunk=2, in_flight=len(old)))
    drafts, stats = drafter.arrive_and_draft(7, list(old), requests.__getitem__, weight_version=7)
    assert stats.claimed_samples == len(old) and stats.refreshed == len(drafts)
    for d in drafts:
        full = want[d.sample_index].token_ids
        assert list(d.tokens) == full[:len(d.tokens)], d.sample_index
        assert d.weight_version == 7 and d.key == keys[d.sample_index]
    if close_after is None:   # every refresh finished: these weights' whole responses
        assert sorted(d.sample_index for d in drafts) == list(range(len(old)))
        assert all(len(d.tokens) == len(want[d.sample_index].token_ids) for d in drafts)
    else:   # cut: a refresh comes back finished or once it has left the old draft
        cut = [d for d in drafts if len(d.tokens) < len(want[d.sample_index].token_ids)]
        assert cut
        assert all(list(d.tokens) != old[8, d.sample_index][:len(d.tokens)] for d in cut)
    assert not verifying_engine.has_unfinished()


BUDGET = 40   # tokens an engine step of the budgeted engine


@pytest.fixture(scope="module")
def budgeted_engine(checkpoint):
    """The factory's verifying engine with a small token budget a step (rollout.
    max_num_batched_tokens): the six drafts of up to 48 tokens cannot be verified in one step."""
    from megatron_bubblespec.rollout.factory import build_engine

    engine = build_engine(checkpoint, kind="vllm", max_model_len=512, seed=0,
                          max_num_batched_tokens=BUDGET,
                          continuation=_settings("spec.verifier=engine"))
    yield engine
    assert not engine.has_unfinished()


@pytest.mark.parametrize("kind", ["true", "corrupted"])
def test_drafts_verified_under_a_token_budget_keep_the_tokens(budgeted_engine, verifying_engine,
                                                              plain, prompts, keys, kind):
    """A step that may compute only BUDGET tokens verifies the drafts a part at a time: the
    same tokens as plain keyed decoding, in more engine steps than without the budget."""
    assert budgeted_engine._engine.vllm_config.scheduler_config.max_num_batched_tokens == BUDGET
    want = plain["T1"]
    old = ([list(r.token_ids) for r in want] if kind == "true"
           else [_corrupt(r.token_ids, 7, random.Random(5)) for r in want])
    steps = {}
    for name, engine in (("budget", budgeted_engine), ("whole", verifying_engine)):
        requests = _requests(f"budget-{kind}-{name}", prompts, keys)
        for request, draft in zip(requests, old):
            request.drafting, request.draft = True, draft
            request.proposals = Proposals([draft], own=0)
        got = engine.generate(requests, PARAMS["T1"])
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.token_ids == w.token_ids, f"{kind}, {name}: request {i} tokens differ"
        steps[name] = engine.last_engine_steps
    assert steps["budget"] > steps["whole"], steps
