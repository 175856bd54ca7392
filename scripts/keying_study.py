"""Consecutive checkpoints of a run -> each sample drafted by W_t and rolled out by W_{t+1} under
each keying of the noise -> how much of W_{t+1}'s responses a W_t draft covers (the study behind
docs/results/keying-study.md).

Keyed by position (``rollout.keying: position``), a draw's noise is keyed by (sample key, response
position, token). A response that
leaves its draft and meets the draft's text again one token later draws with other noise from
then on, so the two stay apart even where the policies agree. Keyed instead by (sample key, the
last k tokens, how often that k-gram occurred earlier in the response, token) (``context<k>``,
``megatron_bubblespec.sampling.draw_words``), every draw of a
response still has a key of its own (a k-gram's occurrences are counted, so two positions never
share one: sampling stays exact), and a response that meets its draft's text again draws with
the draft's noise again. This script measures whether that matters on real consecutive policies.

For each pair (t, t + 1) of the run's weight versions (0 = the initial model, v = the
checkpoint after v steps) and each keying:

1. every sample of step t + 1 (and, with ``--prompts`` above the step's own, the prompts of the
   following steps under step t + 1's keys) is drafted with W_t and rolled out with W_{t+1},
   both by keyed sampling on the plain-torch model (``rollout.torch_llama``) at the run's
   temperature, top-p and budget;
2. a replay walks the rollout and counts what the draft would have saved: the accepted prefix,
   then, after a divergence, proposals from the draft wherever the rollout's last tokens occur
   in it again (the longest of ``max_match`` .. ``min_match`` tokens, the draft read forward),
   up to ``--cap`` tokens an engine step. The replay is the same for every keying; only the
   rollout (what W_{t+1} draws) differs.

It reports, per keying: the accepted prefix's share of the rollout's tokens, the share the draft
covers in all (prefix + realigned), and the engine steps a response takes with the draft as its
only proposal source, per token; over all responses and over each step's longest (the one that
sets the step's time). The weights of version v >= 1 are exported from the run's checkpoint
``step_v`` by resuming it for zero steps (``bubblespec train ... run.resume=<ckpt>
run.steps=v``), once, into ``--out``/weights.

    TORCHDYNAMO_DISABLE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python \\
        scripts/keying_study.py --run runs/keying-study/longtail-off --versions 0-6 \\
        --out runs/keying-study/study
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from megatron_bubblespec.config import load_config
from megatron_bubblespec.data.lookahead import LookaheadSampler
from megatron_bubblespec.sampling.draw_words import Keying
from megatron_bubblespec.loop.checkpoint import complete_checkpoints
from megatron_bubblespec.loop.replica import build_task, resolve_model
from megatron_bubblespec.machine import machine_info
from megatron_bubblespec.models.architecture import load_checkpoint
from megatron_bubblespec.rollout.torch_llama import TorchLlama
from megatron_bubblespec.sampling import SamplingParams
from megatron_bubblespec.sampling.keyed import perturbed_scores
from megatron_bubblespec.speculative.bubble import common_prefix
from megatron_bubblespec.speculative.samples import SampleBook
from megatron_bubblespec.tokens import pad_token_rows


# ------------------------------------------------------------------------------------- keyings

def keying_factory(name: str):
    """A keying by name (``rollout.keying``'s values) -> its per-response word state."""
    try:
        return Keying.parse(name).tracker
    except ValueError as error:
        raise SystemExit(str(error)) from None


# ---------------------------------------------------------------------------------- generation

PREFILL_TOKENS = 8192   # padded tokens a prefill forward takes at most (its logits: 1.6 GB here)


def prefill(model: TorchLlama, rows: list[list[int]], slots: torch.Tensor) -> torch.Tensor:
    """Every row's prompt into its cache slot -> each row's last logits [len(rows), V]; the rows
    go in as few forwards as ``PREFILL_TOKENS`` allows (a forward's logits cover every
    position)."""
    out, start = [], 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and (end + 1 - start) * max(map(len, rows[start:end + 1])) \
                <= PREFILL_TOKENS:
            end += 1
        tokens, lengths = pad_token_rows(rows[start:end])
        logits = model.forward(tokens, slots[start:end], torch.zeros_like(lengths), lengths)
        out.append(logits[torch.arange(end - start), lengths - 1])
        start = end
    return torch.cat(out) if out else torch.empty(0)


@torch.no_grad()
def generate(model: TorchLlama, prompts: list[list[int]], keys: list[int], eos: tuple[int, ...],
             params: SamplingParams, budget: int | list[int], keying,
             prefixes: list[list[int]] | None = None,
             runners_up: list[list[tuple[int, float]]] | None = None) -> list[list[int]]:
    """Keyed sampling of every prompt to EOS or ``budget`` response tokens (one for all, or one
    per row), in one batch whose finished rows leave it; each row's noise words come from its own
    ``keying`` state.

    ``prefixes``: response tokens each row starts from (returned as the response's first tokens);
    ``runners_up``: filled per row with (the second-best token, its score's gap to the drawn one)
    for every drawn token, the scores being the keyed draw's perturbed scores."""
    n = len(prompts)
    prefixes = prefixes or [[] for _ in range(n)]
    budgets = budget if isinstance(budget, list) else [budget] * n
    slots = torch.tensor([model.cache.acquire() for _ in range(n)])
    states = [keying(list(p), list(x)) for p, x in zip(prompts, prefixes)]
    responses: list[list[int]] = [list(x) for x in prefixes]
    active = [r for r in range(n) if len(responses[r]) < budgets[r]]
    last = prefill(model, [list(prompts[r]) + list(prefixes[r]) for r in active], slots[active])
    while active:
        words = [states[r].word() for r in active]
        scores = perturbed_scores(last, torch.tensor([keys[r] for r in active]),
                                  torch.tensor(words), params)
        drawn = torch.argmax(scores, dim=-1).tolist()
        if runners_up is not None:
            for r, row, token in zip(active, scores, drawn):
                best = torch.topk(row, 2)   # the drawn token and the runner-up, in either order
                second = int(best.indices[1] if int(best.indices[0]) == token else best.indices[0])
                runners_up[r].append((second, float(row[token] - row[second])))
        still = []
        for r, token in zip(active, drawn):
            responses[r].append(token)
            states[r].extend((token,))
            if token not in eos and len(responses[r]) < budgets[r]:   # the first EOS ends it
                still.append(r)
        active = still
        if not active:
            break
        rows = torch.tensor(active)
        starts = torch.tensor([len(prompts[r]) + len(responses[r]) - 1 for r in active])
        feed = torch.tensor([[responses[r][-1]] for r in active])
        last = model.forward(feed, slots[rows], starts, torch.ones(len(active),
                                                                   dtype=torch.int64))[:, 0]
    for slot in slots.tolist():
        model.cache.release(slot)
    return responses


# -------------------------------------------------------------------------------------- replay

def replay(draft: list[int], response: list[int], *, cap: int = 32, min_match: int = 3,
           max_match: int = 8, forks: list[list[int]] = (),
           divergences: list | None = None) -> dict:
    """Walk ``response`` as an engine would with ``draft`` as its only proposal source: an engine
    step proposes up to ``cap`` draft tokens and gains the accepted ones plus one drawn token.
    Aligned from the start; after a rejection the draft is searched for the response's last
    ``max_match`` .. ``min_match`` tokens (longest first; the first place after the last aligned
    one, else the first place) and proposes what follows there.

    ``forks``: more texts of the same response (a fork: a prefix of the draft, another token,
    and what followed it), searched after the draft alike. ``divergences``: filled with (text,
    place, drawn token) wherever the response, aligned with a text, drew another token than the
    text's at that place."""
    texts = [draft, *forks]
    index: dict[tuple, list[tuple[int, int]]] = {}
    for t, text in enumerate(texts):
        for m in range(min_match, max_match + 1):
            for end in range(m, len(text) + 1):
                index.setdefault(tuple(text[end - m:end]), []).append((t, end))
    prefix = common_prefix(draft, response)
    i, steps, steps_after, covered, covered_after = 0, 0, 0, 0, 0
    pointer, last_aligned = (0, 0), [0] * len(texts)
    while i < len(response):
        after = i > prefix          # past the first divergence and the token drawn there
        if pointer is None and i >= min_match:
            for m in range(min(max_match, i), min_match - 1, -1):
                places = index.get(tuple(response[i - m:i]))
                if places:
                    later = [(t, e) for t, e in places if e > last_aligned[t]]
                    pointer = later[0] if later else places[0]
                    break
        text = texts[pointer[0]] if pointer is not None else []
        proposal = text[pointer[1]:pointer[1] + cap] if pointer is not None else []
        accepted = common_prefix(proposal, response[i:])
        covered += accepted
        covered_after += accepted if after else 0
        steps += 1
        steps_after += after
        i += accepted
        drew = i < len(response)    # the step's own draw, unless the proposal ended the response
        i += drew
        if pointer is not None:
            t, nxt = pointer[0], pointer[1] + accepted
            # the drawn token continues the alignment only if the text has it next
            if drew and accepted == len(proposal) and nxt < len(text) \
                    and text[nxt] == response[i - 1]:
                pointer = (t, nxt + 1)
                last_aligned[t] = nxt + 1
            else:
                if divergences is not None and drew and nxt < len(text):
                    divergences.append((t, nxt, response[i - 1]))
                last_aligned[t] = max(last_aligned[t], nxt)
                pointer = None
    return {"tokens": len(response), "prefix": prefix, "covered": covered, "steps": steps,
            "covered_after": covered_after, "steps_after": steps_after}


def totals(rows: list[dict]) -> dict:
    """Shares of the rollouts' tokens: the accepted prefixes, all the drafts covered, and engine
    steps a token; and of the tokens after each response's first divergence (past its prefix's
    drawn token): what the drafts covered there again, and its engine steps a token."""
    tokens = sum(r["tokens"] for r in rows)
    prefix = sum(r["prefix"] for r in rows)
    after = sum(max(0, r["tokens"] - r["prefix"] - 1) for r in rows)
    return {"responses": len(rows), "tokens": tokens, "tokens_after": after,
            "prefix_share": prefix / tokens,
            "covered_share": sum(r["covered"] for r in rows) / tokens,
            "steps_per_token": sum(r["steps"] for r in rows) / tokens,
            "realigned_share": sum(r["covered_after"] for r in rows) / max(after, 1),
            "steps_per_token_after": sum(r["steps_after"] for r in rows) / max(after, 1)}


# ------------------------------------------------------------------------------------- weights

def version_dir(run: Path, out: Path, version: int, cfg) -> Path:
    """The HF directory of weight version ``version``: the initial model, or the run's checkpoint
    ``step_<version>`` exported by resuming it for zero steps (once; kept under ``out``)."""
    if version == 0:
        return resolve_model(cfg, 0)
    final = out / "weights" / f"v{version}" / "final"
    if (final / "config.json").is_file():
        return final
    checkpoints = dict(complete_checkpoints(run / "checkpoints"))
    if version not in checkpoints:
        raise SystemExit(f"{run}/checkpoints has no complete step_{version} (it has "
                         f"{sorted(checkpoints)}): train with run.checkpoint_every=1 and "
                         "run.keep_checkpoints at least the versions you study")
    command = [sys.executable, "-m", "megatron_bubblespec.cli", "train",
               "--config", str(run / "config.yaml"), f"run.resume={checkpoints[version]}",
               f"run.steps={version}", f"run.output_dir={out / 'weights'}", f"run.name=v{version}",
               "run.checkpoint_every=0", "logging.progress=false", "logging.plot=false",
               "logging.tensorboard=false"]
    print(f"exporting version {version}: {' '.join(command)}", flush=True)
    subprocess.run(command, check=True)
    return final


# ---------------------------------------------------------------------------------------- main

def sample_book(cfg, arch) -> SampleBook:
    """The run's samples: its task's prompts, dealt and keyed as the run dealt and keyed them."""
    task = build_task(cfg, arch)
    return SampleBook(task, LookaheadSampler(cfg.run.seed, task.size, cfg.rollout.prompts_per_step,
                                             cfg.parallel.data, cfg.rollout.samples_per_prompt),
                      cfg.run.seed)


def pair_samples(book: SampleBook, step: int, at_least: int = 0) -> list:
    """Step ``step``'s samples (W_{t+1} rolls out step t + 1: the bubble of step t drafted it with
    W_t), then the following steps' under their own keys until there are ``at_least`` (any key
    serves: draft and rollout share it)."""
    samples = [book.sample(step, g) for g in range(book.batch(step).num_samples)]
    extra = step + 1
    while len(samples) < at_least:
        samples += [book.sample(extra, g) for g in range(book.batch(extra).num_samples)]
        extra += 1
    return samples


def parse_versions(text: str) -> list[int]:
    if "-" in text:
        first, last = (int(x) for x in text.split("-"))
        return list(range(first, last + 1))
    return [int(x) for x in text.split(",")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, type=Path,
                        help="a run directory with config.yaml and checkpoints/step_<v>")
    parser.add_argument("--versions", default="0-6",
                        help="weight versions, consecutive pairs studied (0-6 or 0,1,2)")
    parser.add_argument("--keyings", default="position,context2,context4")
    parser.add_argument("--prompts", type=int, default=0,
                        help="prompts per pair (0: step t + 1's own)")
    parser.add_argument("--cap", type=int, default=32, help="draft tokens an engine step proposes")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--report", action="store_true",
                        help="print the table of the study already in --out, measure nothing")
    args = parser.parse_args(argv)

    results = args.out / "keying_study.json"
    if args.report:
        study = json.loads(results.read_text())
        print(report(study["pairs"], list(study["pairs"][0]["keyings"])))
        return 0
    cfg = load_config(args.run / "config.yaml")
    args.out.mkdir(parents=True, exist_ok=True)
    versions = parse_versions(args.versions)
    arch, _ = load_checkpoint(version_dir(args.run, args.out, 0, cfg))
    book = sample_book(cfg, arch)
    r = cfg.rollout
    params = SamplingParams(r.temperature, r.top_k, r.top_p)
    keyings = {name: keying_factory(name) for name in args.keyings.split(",")}
    dirs = {v: version_dir(args.run, args.out, v, cfg) for v in versions}
    started = time.time()
    # a study run again with the same --out keeps the pairs it has already measured
    done = {(p["before"], p["after"]): p for p in json.loads(results.read_text())["pairs"]
            if set(keyings) <= set(p["keyings"])} if results.is_file() else {}
    pairs = []
    for before, after in zip(versions, versions[1:]):
        if (before, after) in done:
            pairs.append(done[(before, after)])
            continue
        samples = pair_samples(book, after, args.prompts * r.samples_per_prompt)
        prompts = [list(s.prompt.token_ids) for s in samples]
        keys = [s.key for s in samples]
        eos = samples[0].eos_token_ids
        models = {v: TorchLlama(*load_checkpoint(dirs[v]), max_model_len=cfg.model.max_model_len)
                  for v in (before, after)}
        pair = {"before": before, "after": after, "samples": len(samples), "keyings": {}}
        for name, keying in keyings.items():
            t0 = time.time()
            drafts = generate(models[before], prompts, keys, eos, params, r.max_new_tokens, keying)
            rollouts = generate(models[after], prompts, keys, eos, params, r.max_new_tokens,
                                keying)
            rows = [replay(d, o, cap=args.cap, min_match=cfg.spec.min_match,
                           max_match=cfg.spec.max_match) for d, o in zip(drafts, rollouts)]
            group = r.prompts_per_step * r.samples_per_prompt
            longest = [max(rows[i:i + group], key=lambda x: x["tokens"])
                       for i in range(0, len(rows), group)]
            pair["keyings"][name] = {"all": totals(rows), "longest": totals(longest),
                                     "rows": rows, "longest_rows": longest,
                                     "drafts": drafts, "rollouts": rollouts,
                                     "seconds": round(time.time() - t0, 1)}
            a = pair["keyings"][name]["all"]
            print(f"pair {before}->{after} {name:9s}: prefix {a['prefix_share']:.3f} covered "
                  f"{a['covered_share']:.3f} steps/token {a['steps_per_token']:.3f} realigned "
                  f"after {a['realigned_share']:.3f} "
                  f"({a['tokens']} tokens, {time.time() - t0:.0f} s)", flush=True)
        pairs.append(pair)
        results.write_text(json.dumps(
            {"run": str(args.run), "versions": versions, "cap": args.cap,
             "sampling": {"temperature": r.temperature, "top_p": r.top_p,
                          "max_new_tokens": r.max_new_tokens},
             "pairs": pairs, "seconds": round(time.time() - started, 1),
             "machine": machine_info()}, indent=1))
    print(report(pairs, list(keyings)))
    return 0


def interval(rows: list[dict], statistic: str, draws: int = 2000, seed: int = 0):
    """The 5th and 95th percentiles of ``totals(rows)[statistic]`` over responses resampled with
    replacement (a bootstrap: the responses are the units, the tokens within one are not
    independent)."""
    rng = np.random.default_rng(seed)
    values = [totals([rows[i] for i in rng.integers(0, len(rows), len(rows))])[statistic]
              for _ in range(draws)]
    return tuple(float(v) for v in np.percentile(values, [5, 95]))


def report(pairs: list[dict], names: list[str]) -> str:
    """The markdown table over every pair: all responses, and each step's longest; the shares
    after divergence with their bootstrap 90 % intervals."""
    lines = ["| keying | responses (longest) | prefix share | covered share | engine steps / "
             "token | realigned after divergence | engine steps / token after divergence | "
             "longest: covered | longest: realigned after divergence | longest: engine steps / "
             "token after divergence |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def with_interval(rows, shares, statistic):
        low, high = interval(rows, statistic)
        return f"{shares[statistic]:.3f} ({low:.3f}-{high:.3f})"

    for name in names:
        rows = [row for p in pairs for row in p["keyings"][name]["rows"]]
        longest = [row for p in pairs for row in p["keyings"][name]["longest_rows"]]
        a, lt = totals(rows), totals(longest)
        lines.append(" | ".join([
            f"| {name}", f"{a['responses']} ({lt['responses']})", f"{a['prefix_share']:.3f}",
            f"{a['covered_share']:.3f}", f"{a['steps_per_token']:.3f}",
            with_interval(rows, a, "realigned_share"),
            with_interval(rows, a, "steps_per_token_after"), f"{lt['covered_share']:.3f}",
            with_interval(longest, lt, "realigned_share"),
            with_interval(longest, lt, "steps_per_token_after")]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
