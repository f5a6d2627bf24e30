"""Shared fixtures: tiny randomly initialised models of every supported architecture, the character tokenizer,
the bundled SmolLM2 (loaded once per session, float32), and helpers several test folders use."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from kvsieve.engine.reconstruct import ReconstructionPrompt
from kvsieve.learn.kvzap_train import rope_tables
from kvsieve.learn.rollout import Episode
from kvsieve.learn.train import train
from kvsieve.learn.train_config import TrainConfig
from kvsieve.models import load
from kvsieve.networks.kvzap_net import KVzapNet, KVzapNetConfig, save_kvzap
from kvsieve.networks.model_shape import ModelShape

torch.set_flush_denormal(True)

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=0)


class CharTokenizer:
    """One id per ASCII character, with an optional toy chat template: enough for prompts and decoding."""

    eos_token_id = None

    def __init__(self, template: bool = True) -> None:
        self.chat_template = "toy" if template else None

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **_):
        return "\x02sys\x03" + messages[0]["content"] + "\x04" + ("\x05A:" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False, return_tensors=None):
        out = {"input_ids": [ord(c) for c in text]}
        if return_tensors == "pt":
            out["input_ids"] = torch.tensor([out["input_ids"]])
        if return_offsets_mapping:
            out["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
        return out

    def decode(self, ids, **_):
        return "".join(chr(i) for i in ids)


TOKENIZER = CharTokenizer()
HEADER = ReconstructionPrompt.from_tokenizer(TOKENIZER).header  # the toy template's header, as KVzip reads it


def header_ids(seed: int, n: int) -> torch.Tensor:
    """(1, len(HEADER) + n) ids: the chat header, then ``n`` random printable characters."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.tensor([HEADER]), torch.randint(32, 127, (1, n), generator=g)], dim=1)


def episode(seed: int, n: int, m: int, header: bool = False) -> Episode:
    """A training episode: ``n`` context ids (after the chat header when ``header``) and ``m`` continuation ids."""
    g = torch.Generator().manual_seed(seed)
    low, high = (32, 127) if header else (1, 128)  # printable characters after a header, any id otherwise
    context = torch.randint(low, high, (1, n), generator=g)
    if header:
        context = torch.cat([torch.tensor([HEADER]), context], dim=1)
    return Episode(context, torch.randint(low, high, (1, m), generator=g), f"ep{seed}")


def sharpened(model):
    """Random init gives near-uniform attention, under which a wrongly scaled query or a score that ignores the
    keys goes unseen: scale queries and keys up so attention is peaked."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(12.0)
            layer.self_attn.k_proj.weight.mul_(12.0)
    return model


def tiny_config(arch: str):
    if arch == "llama":
        return LlamaConfig(**COMMON)
    if arch == "qwen2":
        return Qwen2Config(**COMMON)
    if arch == "qwen3":
        return Qwen3Config(**COMMON, head_dim=16)
    if arch == "mistral":
        return MistralConfig(**COMMON, sliding_window=None)
    if arch == "gemma3":
        return Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    raise ValueError(arch)


def tiny_model(arch: str = "llama", seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa")
    return model.eval()


def random_kvzap(model, path, name: str = "tiny-llama", header: int = 3, seed: int = 0):
    """A kvzap checkpoint for ``model`` with random linear weights (for tests of what is done with the scores)."""
    g = torch.Generator().manual_seed(seed)
    config = model.config
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    net = KVzapNet(KVzapNetConfig(num_layers=config.num_hidden_layers, num_kv_heads=heads,
                                  input_dim=2 * heads * head_dim, hidden=8))
    with torch.no_grad():
        net.linear_weight.copy_(torch.randn(net.linear_weight.shape, generator=g) * 0.3)
        net.linear_bias.copy_(torch.randn(net.linear_bias.shape, generator=g))
        net.std.copy_(torch.rand(net.std.shape, generator=g) + 0.5)
    freqs, scales = rope_tables(model)
    meta = {"model": ModelShape.of(model, name).to_dict(), "header": header,
            "rope": {"inv_freq": freqs, "attention_scaling": scales}, "variant": "linear"}
    return save_kvzap(path, net, meta)


def whole_and_resumed(model, init, tmp_path, **settings):
    """REINFORCE on a kvzap checkpoint ``init``: three steps in one run (``whole``), and one step then resumed to
    three (``split``), from the same settings and three episodes; returns both runs' results."""
    common = dict(model="tiny-llama", network="kvzap", init=str(init), mode="prefill", temperature=0.5,
                  ratios=[0.75, 0.5], window=8, rollouts=2, save_every=1, **settings)
    episodes = [episode(i, 80, 12) for i in range(3)]
    whole = train(TrainConfig(steps=3, out=str(tmp_path / "whole"), **common), model=model, episodes=episodes,
                  progress=False)
    train(TrainConfig(steps=1, out=str(tmp_path / "split"), **common), model=model, episodes=episodes, progress=False)
    split = train(TrainConfig(steps=3, out=str(tmp_path / "split"), **common), model=model, episodes=episodes,
                  progress=False)
    return whole, split


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the bundled SmolLM2-135M-Instruct in float32, loaded once for the session."""
    return load("smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


@pytest.fixture
def prompt_ids():
    return torch.randint(1, 128, (1, 96), generator=torch.Generator().manual_seed(1))
