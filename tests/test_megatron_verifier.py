"""The Megatron verifier (TP=1, TP=2, TP=2 x PP=2 over gloo) returns exactly the reference engine's
verification, for drafts from a perturbed policy, the truth followed by junk, random tokens,
inserted EOS and no draft at all, greedy and T=1; malformed drafts warn and are cut or dropped."""

from __future__ import annotations

import random
import warnings
from collections import Counter

import pytest
import torch

from megatron_bubblespec.distributed import destroy_distributed, init_distributed, megatron_cpu_mode
from megatron_bubblespec.distributed.launch import launch_local
from megatron_bubblespec.models.architecture import (
    load_checkpoint,
    perturb_checkpoint,
)
from megatron_bubblespec.sampling.requests import RolloutRequest
from megatron_bubblespec.rollout.reference import ReferenceEngine
from megatron_bubblespec.sampling import SamplingParams, sample_key
from megatron_bubblespec.speculative.megatron_verifier import MegatronVerifier
from megatron_bubblespec.speculative.validate import verifiable_draft
from megatron_bubblespec.speculative.verify import NO_TOKEN, verify_keyed
from megatron_bubblespec.train.model import build_gpt_model
from megatron_bubblespec.train.sharding import load_hf_weights

pytestmark = pytest.mark.slow   # multi-process or real-model runs: minutes on 2 cores

VOCAB = 250          # Megatron pads it to 256 (x TP): ids 250..255 exist as logits but never as tokens
MAX_NEW = 12
PROMPTS = 8
KINDS = ("perturbed", "truth+junk", "eos-inserted", "random", "empty")
PARAMS = {"greedy": SamplingParams(0.0), "T1": SamplingParams(1.0)}
LAYOUTS = [(1, 1), (2, 1), (2, 2)]
MICRO_BATCH = 7      # 40 rows -> 6 micro-batches, the last one padded with 2 dummy rows


# ------------------------------------------------------------------------------ checkpoints

@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return tiny_checkpoint("llama", vocab_size=VOCAB, num_layers=4)


@pytest.fixture(scope="module")
def perturbed(target, tmp_path_factory):
    """The same model with small weight noise: the drafter (last step's policy)."""
    return perturb_checkpoint(target, tmp_path_factory.mktemp("perturbed"), 0.003)


# ------------------------------------------------------------------------------ cases

def _base_requests(kind: str, eos: tuple[int, ...]) -> list[RolloutRequest]:
    """PROMPTS requests; every third has no response prefix, the others 1-4 fixed tokens."""
    g = random.Random(3)
    requests = []
    for i in range(PROMPTS):
        prompt = [g.randrange(3, VOCAB) for _ in range(g.randrange(4, 21))]
        prefix = [] if i % 3 == 0 else [g.randrange(3, VOCAB) for _ in range(g.randrange(1, 5))]
        requests.append(RolloutRequest(f"{kind}-{i}", prompt, sample_key(5, 1, i, 0), MAX_NEW,
                                       response_prefix=prefix, eos_token_ids=eos))
    return requests


def _continuations(engine: ReferenceEngine, requests, params) -> list[list[int]]:
    results = engine.generate(requests, params)
    return [res.token_ids[len(req.response_prefix):] for req, res in zip(requests, results)]


def _make_case(target, perturbed, params: SamplingParams):
    """(requests, drafts) of every kind; EOS is the token the target draws most often, so that
    drafts which end in, or carry, an accepted EOS actually occur."""
    target_engine = ReferenceEngine(target, max_model_len=64)
    drafter = ReferenceEngine(perturbed, max_model_len=64)
    free = _continuations(target_engine, _base_requests("probe", ()), params)
    eos = (Counter(t for row in free for t in row).most_common(1)[0][0],)
    g = random.Random(11)
    requests, drafts = [], []
    for kind in KINDS:
        base = _base_requests(kind, eos)
        truth = _continuations(target_engine, base, params)
        proposals = _continuations(drafter, base, params)
        for req, true, proposal in zip(base, truth, proposals):
            budget = req.max_new_tokens - len(req.response_prefix)
            if kind == "perturbed":
                draft = proposal
            elif kind == "truth+junk":   # full acceptance (bonus token) or an accepted EOS + junk
                junk = [g.randrange(VOCAB) for _ in range(budget)]
                draft = (true + junk)[:g.randrange(1, budget + 1)]
            elif kind == "eos-inserted":
                draft = list(proposal) or [eos[0]]
                draft[g.randrange(len(draft))] = eos[0]
            elif kind == "random":
                draft = [g.randrange(VOCAB) for _ in range(g.randrange(1, budget + 1))]
            else:
                draft = []
            requests.append(req)
            drafts.append(draft)
    return requests, drafts


def _malformed_case():
    """Drafts that must be cut or dropped, next to well-formed ones (ids name the expectation)."""
    g = random.Random(5)
    rows = [  # (id, prefix length, draft)
        ("good", 2, [7, 8, 9]),
        ("too-long", 2, [g.randrange(3, VOCAB) for _ in range(15)]),
        ("budget-spent", MAX_NEW, [4, 5]),
        ("padding-id", 0, [5, 6, VOCAB]),        # a Megatron padding column, not a token
        ("negative-id", 1, [-1, 4]),
        ("float-id", 0, [3, 4.0]),
        ("tensor-ids-ok", 1, [torch.tensor(11), torch.tensor(12)]),
        ("empty", 3, []),
    ]
    requests, drafts = [], []
    for i, (name, prefix_len, draft) in enumerate(rows):
        prompt = [g.randrange(3, VOCAB) for _ in range(g.randrange(4, 12))]
        prefix = [g.randrange(3, VOCAB) for _ in range(prefix_len)]
        requests.append(RolloutRequest(name, prompt, sample_key(9, 2, i, 0), MAX_NEW,
                                       response_prefix=prefix, eos_token_ids=(2,)))
        drafts.append(draft)
    expected = {"good": [7, 8, 9], "too-long": drafts[1][:MAX_NEW - 2], "budget-spent": [],
                "padding-id": [], "negative-id": [], "float-id": [], "tensor-ids-ok": [11, 12],
                "empty": []}
    return requests, drafts, [expected[r.request_id] for r in requests]


@pytest.fixture(scope="module")
def cases(target, perturbed):
    return {name: _make_case(target, perturbed, params) for name, params in PARAMS.items()}


# ------------------------------------------------------------------------------ Megatron side

def _as_tuple(v):
    return v.accepted.tolist(), v.next_token.tolist(), v.finished.tolist()


def _as_verified(v):
    """A ``VerifiedDrafts`` as (response prefixes, drafted, accepted)."""
    return [list(r.response_prefix) for r in v.requests], v.drafted, v.accepted


def _verified_from(requests, drafts, verification):
    """What the engine continues from, by hand: prefix + accepted draft + the target's next token
    (none after an accepted EOS), cut to the budget."""
    accepted, next_token, _ = verification
    prefixes = []
    for r, d, n, token in zip(requests, drafts, accepted, next_token):
        tokens = list(d[:n]) + ([token] if token != NO_TOKEN else [])
        prefixes.append(list(r.response_prefix) + tokens[:r.max_new_tokens - len(r.response_prefix)])
    return prefixes, [len(d) for d in drafts], accepted


def _verifier_worker(path, tp, pp, cases):
    init_distributed(tp, pp, seed=0)
    arch, tensors = load_checkpoint(path)
    with megatron_cpu_mode():
        model = build_gpt_model(arch)
        load_hf_weights(model, arch, tensors)
    out = {"seconds": []}
    for name, (requests, drafts) in cases.items():
        whole = MegatronVerifier(model, arch, PARAMS[name])
        micro = MegatronVerifier(model, arch, PARAMS[name], micro_batch_size=MICRO_BATCH)
        out[name] = _as_tuple(whole.verification(requests, drafts))
        out[name + "/micro"] = _as_tuple(micro.verification(requests, drafts))
        verified = micro.verify(requests, drafts)   # the Verifier protocol: what the loop reads
        out[name + "/verified"] = _as_verified(verified)
        out["seconds"].append(verified.seconds)
    requests, drafts, _ = _malformed_case()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        malformed = MegatronVerifier(model, arch, PARAMS["greedy"], micro_batch_size=3)
        out["malformed"] = _as_tuple(malformed.verification(requests, drafts))
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    out["no-requests"] = _as_tuple(MegatronVerifier(model, arch, PARAMS["T1"]).verification([], []))
    out["no-requests/verified"] = _as_verified(MegatronVerifier(model, arch,
                                                                PARAMS["T1"]).verify([], []))
    destroy_distributed()
    return out


@pytest.fixture(scope="module")
def megatron_runs(target, cases):
    """(tp, pp) -> per-rank worker outputs; each layout is launched once per module."""
    runs = {}

    def run(tp, pp):
        if (tp, pp) not in runs:
            runs[tp, pp] = launch_local(_verifier_worker, tp * pp, target, tp, pp, cases)
        return runs[tp, pp]

    return run


# ------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
def test_megatron_verifier_equals_reference_engine(target, cases, megatron_runs, tp, pp):
    reference = ReferenceEngine(target, max_model_len=64)
    per_rank = megatron_runs(tp, pp)
    assert len(per_rank) == tp * pp
    accepted_total = accepted_eos = bonus = 0
    for name, (requests, drafts) in cases.items():
        want = _as_tuple(reference.verify(requests, drafts, PARAMS[name]))
        for rank, out in enumerate(per_rank):   # every rank of the replica returns the same result
            assert out[name] == want, (name, rank)
            assert out[name + "/micro"] == want, (name, rank)
            assert out[name + "/verified"] == _verified_from(requests, drafts, want), (name, rank)
        accepted, next_token, finished = want
        accepted_total += sum(accepted)
        accepted_eos += sum(t == NO_TOKEN for t in next_token)
        bonus += sum(n == len(d) > 0 for n, d in zip(accepted, drafts))
        assert all(0 <= t < VOCAB for t in next_token if t != NO_TOKEN)
    # the comparison covered long accepted prefixes, accepted EOS and fully accepted drafts
    assert accepted_total > 100, accepted_total
    assert accepted_eos >= 2 and bonus >= 4, (accepted_eos, bonus)
    assert all(s > 0 for out in per_rank for s in out["seconds"])
    assert all(out["no-requests"] == ([], [], []) for out in per_rank)
    assert all(out["no-requests/verified"] == ([], [], []) for out in per_rank)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)], ids=["tp1-pp1", "tp2-pp2"])
def test_malformed_drafts_warn_and_are_cut_or_dropped(target, megatron_runs, tp, pp):
    requests, _, sanitized = _malformed_case()
    reference = ReferenceEngine(target, max_model_len=64)
    want = _as_tuple(reference.verify(requests, sanitized, PARAMS["greedy"]))
    bad = {"too-long", "budget-spent", "padding-id", "negative-id", "float-id"}
    for out in megatron_runs(tp, pp):
        assert out["malformed"] == want
        named = [r.request_id for r in requests if any(repr(r.request_id) in m for m in out["warnings"])]
        assert set(named) == bad and len(out["warnings"]) == len(bad), out["warnings"]


def test_verifiable_draft_never_changes_a_token():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert verifiable_draft([0, VOCAB - 1, 4], VOCAB, 4, "request 'r'") == [0, VOCAB - 1, 4]
        assert verifiable_draft([], VOCAB, 4, "request 'r'") == []
    with pytest.warns(RuntimeWarning, match="'r'.*truncated to 4"):
        assert verifiable_draft([1, 2, 3, 4, 5, 6], VOCAB, 4, "request 'r'") == [1, 2, 3, 4]
    with pytest.warns(RuntimeWarning, match="'r'.*dropped"):
        assert verifiable_draft([1, VOCAB, 3], VOCAB, 4, "request 'r'") is None
    with pytest.warns(RuntimeWarning, match="'r'.*dropped"):
        assert verifiable_draft([1, True], VOCAB, 4, "request 'r'") is None


def test_eos_is_settled_with_each_requests_own_eos():
    """Greedy on one-hot logits: the target draws 5, 2, 7, 8 at every row, drafts match it."""
    logits = torch.full((4, 4, VOCAB), -10.0)
    for j, token in enumerate([5, 2, 7, 8]):
        logits[:, j, token] = 10.0
    draft = torch.tensor([[5, 2, 7]] * 4)
    lens = torch.tensor([3, 3, 1, 0])
    eos = [(2,), (3,), (2, 7), (5,)]
    result = verify_keyed(logits, draft, lens, torch.zeros(4, dtype=torch.int64),
                          torch.zeros(4, dtype=torch.int64), PARAMS["greedy"], eos)
    assert result.accepted.tolist() == [2, 3, 1, 0]
    assert result.next_token.tolist() == [NO_TOKEN, 8, 2, 5]
    assert result.finished.tolist() == [True, False, True, True]
