"""Training the KVzip surrogate (:mod:`kvsieve.policies.kvzap`): ``kvsieve train --objective kvzap``.

1. **Data.** ``samples`` generated RULER-style samples per task of ``tasks`` (sample seeds from ``seed``,
   5000 by default: disjoint from the evaluation grids' 0+ and the evolution dev sets' 1000+/2000+) and
   ``text_docs`` excerpts of the Python standard library's own sources (``.py`` files under
   ``sysconfig.get_paths()['stdlib']``, picked and cut by a seeded hash, so every machine with the same
   Python builds the same set), each about ``length`` tokens, chat-templated like an evaluation prompt.
2. **Targets.** Per sequence, KVzip's reconstruction scores of the whole context
   (:func:`kvsieve.learn.imitate.kvzip_reconstruction`, the collection the imitation objective uses):
   target = ``log(max(score, 1e-8))`` of every KV head at ``positions`` positions drawn (seeded) after
   the chat template's header, whose entries KVzip never scores (it always keeps them).
   Inputs at the same positions (``inputs``): ``"kv"``, :func:`~kvsieve.policies.kvzap.kvzap_inputs` (pre-RoPE keys
   and values, read off the cache), or ``"hidden"``, KVzap's own: the hidden state entering each layer's
   attention (:mod:`kvsieve.engine.hidden_states`). Each sequence is saved
   as it is collected (``out/kvzap-data/NNN.safetensors``), so an interrupted run resumes where it
   stopped, and a rerun of a finished one only refits.
3. **Fit.** The last ``holdout`` share of the sequences (RULER and text alike, interleaved) is held
   out. Per layer, inputs standardised on the training rows; ``linear``: ridge regression in closed
   form (``alpha = ridge``); ``mlp``: that linear map plus a residual of one hidden GELU layer of
   ``hidden`` units (output weights start at 0), full-batch AdamW (``weight_decay``) for ``steps`` steps
   at ``lr``. Held-out mean squared error (over layers, heads and positions) of both
   and of a constant predictor (each layer's and head's training mean) goes into the checkpoint's
   metadata and ``report.json``; the default variant is the lower one.

Outputs in ``out``: ``policy.safetensors`` (``kvzap(checkpoint=out)``), ``log.csv`` (MLP step, train
and held-out loss), ``report.json`` (mixture, losses, wall times).
"""

from __future__ import annotations

import csv
import hashlib
import json
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvsieve.engine.cache import sieve_layers
from kvsieve.engine.compress import layer_signals
from kvsieve.engine.query_hooks import rope_of
from kvsieve.engine.reconstruct import ReconstructionPrompt
from kvsieve.files import save_safetensors
from kvsieve.learn.imitate import kvzip_reconstruction
from kvsieve.learn.rollout import Episode
from kvsieve.models import dtype_name, load
from kvsieve.networks.kvzap_net import INPUTS, KVzapNet, KVzapNetConfig, kvzap_inputs, save_kvzap
from kvsieve.networks.model_shape import ModelShape
from kvsieve.prompt import build_prompt
from kvsieve.tasks import TASKS
from kvsieve.tasks.load import SampleSpec, load_samples

__all__ = ["KVzapTrainConfig", "KVzapResult", "train_kvzap", "kvzap_targets", "stdlib_texts", "collect_sequence",
           "collect_rows", "split_rows", "heldout_count", "fit"]

DEFAULT_TASKS = ["niah_multikey_2", "niah_multivalue", "niah_multiquery", "vt", "fwe", "qa_1"]
FLOOR = 1e-8  # KVzip scores are softmax weights in (0, 1]; the floor keeps log finite for the never-attended
LOG_FIELDS = ("step", "train_loss", "heldout_loss", "seconds")


@dataclass
class KVzapTrainConfig:
    model: str = "smollm2-135m-instruct"
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    length: int = 2048
    samples: int = 4  # per task
    text_docs: int = 24
    seed: int = 5000
    positions: int = 512  # per sequence
    hidden: int = 64
    steps: int = 400
    lr: float = 3e-3
    ridge: float = 1.0
    weight_decay: float = 0.1  # AdamW's, on the MLP residual
    holdout: float = 0.2
    out: str = "runs/kvzap"
    dtype: str = "float32"
    inputs: str = "kv"  # "kv" (pre-RoPE keys and values) or "hidden" (the hidden state entering the layer)

    def __post_init__(self) -> None:
        for name, minimum in (("length", 16), ("samples", 0), ("text_docs", 0), ("positions", 1), ("hidden", 1),
                              ("steps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if self.samples * len(self.tasks) + self.text_docs < 2:
            raise ValueError("kvzap training needs at least 2 sequences (one to hold out): raise samples or text_docs")
        if not 0 < self.holdout < 1:
            raise ValueError(f"holdout must be a fraction in (0, 1), got {self.holdout!r}")
        if not 0 < self.lr <= 1 or self.ridge < 0:
            raise ValueError(f"lr must be in (0, 1] and ridge >= 0, got lr={self.lr!r}, ridge={self.ridge!r}")
        if self.inputs not in INPUTS:
            raise ValueError(f"inputs {self.inputs!r} is not one of {', '.join(map(repr, INPUTS))}")
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; available: {', '.join(TASKS)}")

    @classmethod
    def from_train_config(cls, config) -> KVzapTrainConfig:
        """The fields of a :class:`~kvsieve.learn.train_config.TrainConfig` that mean the same here; as many text
        excerpts as generated samples."""
        return cls(model=config.model, tasks=list(config.tasks), length=config.length, samples=config.samples,
                   text_docs=config.samples * len(config.tasks), seed=config.seed, hidden=config.hidden,
                   steps=config.steps, lr=config.lr, out=config.out, inputs=config.kvzap_inputs,
                   dtype="float32" if config.dtype == "auto" else config.dtype)

    def data_key(self, dtype: str) -> dict:
        """What a collected sequence depends on (not the fit's settings): ``dtype`` is the one the model computes in
        (``dtype_name``), which a model passed in need not share with ``self.dtype``."""
        keep = ("model", "length", "seed", "positions")
        key = {**{k: getattr(self, k) for k in keep}, "dtype": dtype}
        return key if self.inputs == "kv" else {**key, "inputs": self.inputs}  # "kv" rows keep their old keys


@dataclass
class KVzapResult:
    out: Path
    policy: Path
    log: Path
    report: dict
    step: int
    history: list[dict]


def kvzap_targets(scores: torch.Tensor, header: int) -> torch.Tensor:
    """(b, h, n) KVzip scores -> (b, h, n - header) targets: ``log(max(score, 1e-8))`` after the header."""
    return torch.log(scores[..., header:].float().clamp_min(FLOOR))


def _hash(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little")


def stdlib_texts(count: int, chars: int, seed: int) -> list[tuple[str, str]]:
    """``count`` (name, text) excerpts of ``chars`` characters from the standard library's ``.py`` sources,
    files and offsets chosen by a hash of ``seed`` (test suites left out: they repeat themselves)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.relative_to(root).parts[0]
                   and "site-packages" not in p.parts and p.stat().st_size > 2 * chars)
    if count and not files:
        raise ValueError(f"no standard-library sources of more than {2 * chars} characters under {root}")
    files.sort(key=lambda p: _hash(seed, "file", p.relative_to(root)))
    out = []
    for i in range(count):
        path = files[i % len(files)]
        text = path.read_text(encoding="utf-8", errors="replace")
        start = _hash(seed, "offset", i) % max(1, len(text) - chars)
        start = text.rfind("\n", 0, start) + 1  # from the start of a line
        out.append((f"stdlib:{path.relative_to(root)}", text[start: start + chars]))
    return out


def _episodes(config: KVzapTrainConfig, tokenizer) -> list[tuple[str, Episode]]:
    """(kind, episode) of every training sequence, RULER samples and text excerpts interleaved."""
    ruler = []
    if config.samples:
        spec = SampleSpec(model=config.model, tasks=config.tasks, lengths=[config.length], samples=config.samples,
                          seed=config.seed)
        for sample in load_samples(spec, tokenizer):  # the context as an evaluation prompt holds it
            context = build_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix).context_ids
            ruler.append(("ruler", Episode(context, context[:, :0], sample.id)))
    texts = []
    for name, text in stdlib_texts(config.text_docs, 4 * config.length, config.seed):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        text = tokenizer.decode(ids[: config.length - 64])  # room for the template
        context = build_prompt(tokenizer, text, "").context_ids
        texts.append(("text", Episode(context, context[:, :0], name)))
    mixed = []
    for i in range(max(len(ruler), len(texts))):
        mixed.extend(x for x in (ruler[i] if i < len(ruler) else None, texts[i] if i < len(texts) else None) if x)
    return mixed


def rope_tables(model) -> tuple[list, list[float]]:
    """Per decoder layer: the rotary inverse frequencies (list, or None) and attention scaling its keys got."""
    rotary = next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    attentions = sorted((m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")),
                        key=lambda m: m.layer_idx)
    freqs, scales = [], []
    for attention in attentions:
        inv_freq, scale = rope_of(rotary, attention)
        freqs.append(None if inv_freq is None else [float(f) for f in inv_freq.float()])
        scales.append(scale)
    return freqs, scales


@torch.no_grad()
def collect_sequence(model, tokenizer, episode: Episode, rope: tuple[list, list[float]], positions: int,
                     seed: int, reads: str = "kv") -> dict[str, torch.Tensor]:
    """One sequence's rows: ``inputs`` (L, P, D) float16 (what the surrogate ``reads``: "kv" or "hidden"),
    ``targets`` (L, P, H), ``positions`` (P,)."""
    cache, rebuilt = kvzip_reconstruction(model, tokenizer, episode, window=1, hidden_states=reads == "hidden")
    layers = sieve_layers(cache)
    n, header = episode.context.shape[1], rebuilt.header
    if len(layers) != len(cache.layers):
        raise ValueError("kvzap is trained on models whose every layer is full attention")
    free = n - header
    take = min(positions, free)
    generator = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    picked = (torch.randperm(free, generator=generator)[:take] + header).sort().values
    inputs, targets = [], []
    for idx, layer in layers:
        signals = layer_signals(layer, idx, len(cache.layers), 0, 1)
        if reads == "hidden":
            x = signals.hidden_states[0, picked].float()  # (P, hidden)
        else:
            inv_freq = None if rope[0][idx] is None else torch.tensor(rope[0][idx])
            x = kvzap_inputs(signals, inv_freq, rope[1][idx])[0, picked]  # (P, 2 h d)
        y = kvzap_targets(rebuilt.scores[idx], header)[0].transpose(0, 1)[picked - header]  # (P, H)
        inputs.append(x.to(torch.float16))
        targets.append(y)
    return {"inputs": torch.stack(inputs), "targets": torch.stack(targets), "positions": picked,
            "header": torch.tensor(header), "tokens": torch.tensor(n), "seconds": torch.tensor(rebuilt.seconds)}


def collect_rows(config: KVzapTrainConfig, model, tokenizer, progress: bool = True,
                 episodes: list[tuple[str, Episode]] | None = None) -> tuple[list[dict], list[dict]]:
    """Every sequence's rows, read from ``out/kvzap-data`` where a sequence with the same key was saved."""
    from safetensors import safe_open
    from tqdm import tqdm

    folder = Path(config.out) / "kvzap-data"
    folder.mkdir(parents=True, exist_ok=True)
    episodes = _episodes(config, tokenizer) if episodes is None else episodes
    rope = rope_tables(model)
    data, info = [], []
    for i, (kind, episode) in enumerate(tqdm(episodes, desc="kvzip targets", unit="seq", disable=not progress)):
        key = json.dumps({**config.data_key(dtype_name(model)), "name": episode.name, "kind": kind,
                          "ids": hashlib.sha256(episode.context.numpy().tobytes()).hexdigest()}, sort_keys=True)
        path = folder / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"  # any subset reuses it
        rows = None
        if path.is_file():
            with safe_open(str(path), framework="pt") as handle:
                if (handle.metadata() or {}).get("key") == key:
                    rows = {name: handle.get_tensor(name) for name in handle.keys()}
        if rows is None:
            start = time.perf_counter()
            rows = collect_sequence(model, tokenizer, episode, rope, config.positions, _hash(config.seed, "pos", i),
                                    config.inputs)
            rows["wall"] = torch.tensor(time.perf_counter() - start)
            save_safetensors({k: v.contiguous() for k, v in rows.items()}, path, metadata={"key": key})
        data.append(rows)
        info.append({"kind": kind, "name": episode.name, "tokens": int(rows["tokens"]),
                     "wall": float(rows["wall"])})
    return data, info


def heldout_count(sequences: int, holdout: float) -> int:
    """How many of the (interleaved) sequences are held out: the last ``holdout`` share, at least one."""
    return max(1, round(sequences * holdout))


def split_rows(data: list[dict], holdout: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, y, x_held, y_held)``: (L, N, D) inputs and (L, N, H) targets of the training sequences and of the
    last :func:`heldout_count` ones."""
    held = heldout_count(len(data), holdout)

    def rows(part: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.cat([d["inputs"] for d in part], dim=1).float(),
                torch.cat([d["targets"] for d in part], dim=1).float())

    return (*rows(data[: len(data) - held]), *rows(data[len(data) - held:]))


def fit(net: KVzapNet, x: torch.Tensor, y: torch.Tensor, x_held: torch.Tensor, y_held: torch.Tensor, steps: int,
        lr: float, ridge: float, seed: int, weight_decay: float = 0.1) -> tuple[dict, list[dict]]:
    """Fit both variants of ``net`` in place on (L, N, D) inputs and (L, N, H) targets; held-out losses and
    the MLP's per-step log."""
    mean, std = x.mean(dim=1), x.std(dim=1).clamp_min(1e-6)
    net.mean.copy_(mean)
    net.std.copy_(std)
    z = (x - mean[:, None]) / std[:, None]
    # ridge in closed form, per layer: [z 1] w = y (the bias column not penalised)
    L, N, D = z.shape
    design = torch.cat([z, torch.ones(L, N, 1)], dim=-1).double()
    penalty = torch.eye(D + 1, dtype=torch.float64) * ridge
    penalty[D, D] = 0.0
    w = torch.linalg.solve(design.transpose(1, 2) @ design + penalty, design.transpose(1, 2) @ y.double())
    with torch.no_grad():
        net.linear_weight.copy_(w[:, :D].float())
        net.linear_bias.copy_(w[:, D].float())
    with torch.random.fork_rng():
        torch.manual_seed(seed & ((1 << 63) - 1))
        with torch.no_grad():
            net.mlp_w1.copy_(torch.randn_like(net.mlp_w1) / D ** 0.5)
            net.mlp_w2.zero_()  # the residual starts at 0: the MLP variant starts as the ridge fit
            net.mlp_b1.zero_()
            net.mlp_b2.zero_()
    params = [net.mlp_w1, net.mlp_b1, net.mlp_w2, net.mlp_b2]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    history, start = [], time.perf_counter()
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = ((net.forward_all(x, "mlp") - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        if step % 10 == 9 or step == steps - 1:
            with torch.no_grad():
                held = float(((net.forward_all(x_held, "mlp") - y_held) ** 2).mean())
            history.append({"step": step + 1, "train_loss": float(loss.detach()), "heldout_loss": held,
                            "seconds": time.perf_counter() - start})
    with torch.no_grad():
        constant = float(((y.mean(dim=1, keepdim=True) - y_held) ** 2).mean())
        losses = {"constant": constant, **{v: float(((net.forward_all(x_held, v) - y_held) ** 2).mean())
                                           for v in ("linear", "mlp")},
                  **{f"train_{v}": float(((net.forward_all(x, v) - y) ** 2).mean()) for v in ("linear", "mlp")}}
    return losses, history


def train_kvzap(config: KVzapTrainConfig, model=None, tokenizer=None, progress: bool = True,
                episodes: list[tuple[str, Episode]] | None = None) -> KVzapResult:
    """Collect (or reuse) the data, fit both variants, write ``out/policy.safetensors``; see the module docstring.

    ``episodes``: (kind, episode) sequences to train on instead of the config's RULER samples and texts."""
    start = time.perf_counter()
    if model is None:
        model, tokenizer = load(config.model, dtype=config.dtype)
    if tokenizer is None:
        raise ValueError("kvzap training needs the model's tokenizer (KVzip prompts the model to repeat the context)")
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = ModelShape.of(model, config.model)
    data, info = collect_rows(config, model, tokenizer, progress, episodes)
    collected = time.perf_counter() - start
    x, y, x_held, y_held = split_rows(data, config.holdout)
    net = KVzapNet(KVzapNetConfig(x.shape[0], y.shape[-1], x.shape[-1], config.hidden))
    losses, history = fit(net, x, y, x_held, y_held, config.steps, config.lr, config.ridge, _hash(config.seed, "init"),
                          config.weight_decay)
    variant = "mlp" if losses["mlp"] <= losses["linear"] else "linear"
    header = len(ReconstructionPrompt.from_tokenizer(tokenizer).header)
    kinds = sorted({r["kind"] for r in info})
    mixture = {kind: {"sequences": sum(r["kind"] == kind for r in info),
                      "tokens": sum(r["tokens"] for r in info if r["kind"] == kind)} for kind in kinds}
    report = {"config": asdict(config), "mixture": mixture,
              "heldout_sequences": heldout_count(len(data), config.holdout),
              "train_rows_per_layer": int(x.shape[1]), "heldout_rows_per_layer": int(x_held.shape[1]),
              "losses": losses, "variant": variant,
              "parameters": {v: net.num_parameters(v) for v in ("linear", "mlp")},
              "collection_seconds_this_run": collected, "collection_seconds_total": sum(r["wall"] for r in info),
              "fit_seconds": time.perf_counter() - start - collected}
    rope = rope_tables(model)
    meta = {"model": shape.to_dict(), "header": header, "rope": {"inv_freq": rope[0], "attention_scaling": rope[1]},
            "variant": variant, "inputs": config.inputs, "train": report, "kvsieve_train": "kvzap"}
    policy = save_kvzap(out / "policy.safetensors", net, meta)
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    log = out / "log.csv"
    with log.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=LOG_FIELDS)
        writer.writeheader()
        writer.writerows(history)
    return KVzapResult(out, policy, log, report, config.steps, history)
