"""The rollout engine protocol: an engine implementing only the abstract methods generates, and the
optional members answer as documented (no-ops, or errors naming the engine and the fix); the
reference engine has no sleep mode and says so; a tensor-parallel engine's leader view mirrors
every state-changing call on its followers and refuses what each rank must do for itself."""

import pytest
import torch

from megatron_bubblespec.rollout.base import RolloutEngine
from megatron_bubblespec.rollout.reference import ReferenceEngine
from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.sampling.requests import RolloutRequest, RolloutResult
from megatron_bubblespec.speculative.continuation import ContinuationSettings

VOCAB = 11


class CountingEngine(RolloutEngine):
    """The abstract methods only: one token a step, ``(key + position) % VOCAB``."""

    def __init__(self):
        self.running: dict[str, tuple[RolloutRequest, list[int]]] = {}
        self.loaded: list[list[str]] = []

    def add(self, requests, params):
        for request in requests:
            self.running[request.request_id] = (request, list(request.response_prefix))

    def step(self):
        done = []
        for request_id, (request, tokens) in list(self.running.items()):
            tokens.append((request.key + len(tokens)) % VOCAB)
            if len(tokens) >= request.max_new_tokens:
                done.append(self._result(self.running.pop(request_id), "length"))
        return done

    def abort(self, request_ids=None):
        ids = list(self.running) if request_ids is None else list(request_ids)
        return [self._result(self.running.pop(i), "aborted") for i in ids if i in self.running]

    def has_unfinished(self):
        return bool(self.running)

    def update_weights(self, named_tensors, version=None):
        self.loaded.append([name for name, _ in named_tensors])
        self._loaded(version)

    @staticmethod
    def _result(entry, reason):
        request, tokens = entry
        return RolloutResult(request.request_id, tokens, [0.0] * len(tokens),
                             max(0, len(tokens) - len(request.response_prefix) - 1), reason)


def _requests():
    return [RolloutRequest("long", [1, 2], key=3, max_new_tokens=5),
            RolloutRequest("short", [4], key=7, max_new_tokens=2),
            RolloutRequest("prefixed", [5], key=1, max_new_tokens=4, response_prefix=[9, 9])]


def test_an_engine_with_only_the_abstract_methods_generates_in_request_order():
    engine = CountingEngine()
    results = engine.generate(_requests(), SamplingParams(1.0))
    assert [r.request_id for r in results] == ["long", "short", "prefixed"]
    assert results[0].token_ids == [(3 + i) % VOCAB for i in range(5)]
    assert results[1].token_ids == [7, 8]
    assert results[2].token_ids == [9, 9, 3, 4]   # keyed at response positions 2 and 3
    assert engine.last_engine_steps == 5          # the longest request's tokens, one a step
    assert not engine.has_unfinished()


def test_only_update_weights_moves_the_weight_version():
    engine = CountingEngine()
    assert engine.weight_version == 0
    engine.update_weights(iter([("w", torch.zeros(1))]))
    assert engine.weight_version == 1             # None: the next version
    engine.update_weights(iter([]), version=7)
    assert engine.weight_version == 7             # the caller's version (a resumed run's)
    assert engine.loaded == [["w"], []]


def test_a_subclass_missing_an_abstract_method_cannot_be_built():
    class NoAbort(RolloutEngine):
        add = CountingEngine.add
        step = CountingEngine.step
        has_unfinished = CountingEngine.has_unfinished
        update_weights = CountingEngine.update_weights

    with pytest.raises(TypeError, match="abort"):
        NoAbort()


def test_optional_members_default_to_no_ops_and_named_refusals():
    engine = CountingEngine()
    assert engine.spec_token_cost is None and engine.dtype is None
    assert engine.prefix_caching is None
    assert engine.release() is None and engine.shutdown() is None
    with pytest.raises(NotImplementedError, match=r"CountingEngine does not verify drafts .* "
                                                  r"spec.verifier=megatron"):
        engine.verify(_requests(), [[1]] * 3, SamplingParams(1.0))
    with pytest.raises(NotImplementedError, match=r"CountingEngine cannot measure .* "
                                                  r"spec.proposal_token_cost"):
        engine.measure_proposal_cost(4)
    for call in (lambda: engine.sleep(1), lambda: engine.wake_up(["weights"])):
        with pytest.raises(RuntimeError, match=r"CountingEngine has no sleep mode .* "
                                               r"rollout.sleep_during_train=false"):
            call()


def test_the_reference_engine_has_no_sleep_mode_and_says_so(tiny_checkpoint):
    engine = ReferenceEngine(tiny_checkpoint("llama"))
    assert engine.dtype == "float32" and engine.prefix_caching is None
    with pytest.raises(RuntimeError, match="ReferenceEngine has no sleep mode"):
        engine.sleep(1)
    with pytest.raises(RuntimeError, match="ReferenceEngine has no sleep mode"):
        engine.wake_up(["weights"])


# ------------------------------------------------------------------ tensor-parallel lockstep

def _lockstep_rank(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from megatron_bubblespec.loop.lockstep import LockstepEngine, follow

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    shard = CountingEngine()
    shard.continuation = ContinuationSettings.of("spec.proposal_token_cost=0.25")
    params = SamplingParams(1.0)
    try:
        if rank == 1:
            steps = follow(shard, 0, dist.group.WORLD)
            torch.save({"steps": steps, "running": sorted(shard.running)}, out)
            return
        engine = LockstepEngine(shard, dist.group.WORLD)
        results = engine.generate(_requests(), params)
        engine.add([RolloutRequest("cut", [1], key=0, max_new_tokens=9)], params)
        engine.step()
        [aborted] = engine.abort()
        refusals = {}
        for name, call in [("sleep", lambda: engine.sleep(1)),
                           ("wake_up", lambda: engine.wake_up()),
                           ("update_weights", lambda: engine.update_weights([])),
                           ("verify", lambda: engine.verify([], [], params)),
                           ("measure", lambda: engine.measure_proposal_cost(2))]:
            try:
                call()
            except (RuntimeError, NotImplementedError) as error:
                refusals[name] = str(error)
        engine.release()
        torch.save({"results": [(r.request_id, r.token_ids) for r in results],
                    "steps": engine.last_engine_steps + 1, "aborted": aborted.token_ids,
                    "cost": engine.spec_token_cost, "version": engine.weight_version,
                    "refusals": refusals}, out)
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow
def test_lockstep_mirrors_every_engine_call_and_refuses_per_rank_work(tmp_path):
    import torch.multiprocessing as mp

    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_run_rank, args=(init, [str(o) for o in outs]), nprocs=2, join=True)
    leader, follower = (torch.load(o) for o in outs)
    assert leader["results"] == [("long", [3, 4, 5, 6, 7]), ("short", [7, 8]),
                                 ("prefixed", [9, 9, 3, 4])]
    assert leader["aborted"] == [0]
    assert follower == {"steps": leader["steps"], "running": []}   # same calls, aborted too
    assert leader["cost"] == 0.25 and leader["version"] == 0        # the shard's
    refusals = leader["refusals"]
    assert set(refusals) == {"sleep", "wake_up", "update_weights", "verify", "measure"}
    assert "every rank's own engine shard" in refusals["sleep"]
    assert "spec.verifier=megatron" in refusals["verify"]


def _run_rank(rank: int, init: str, outs: list[str]) -> None:
    _lockstep_rank(rank, init, outs[rank])
