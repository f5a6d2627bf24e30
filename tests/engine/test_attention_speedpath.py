"""The blocked prefill attention equals sdpa's: GQA, bottom-right causal mask, per-head valid mask, fp32 and bf16."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

import kvsieve
import kvsieve.engine.attention as attention
from kvsieve.engine.attention import blocked_causal_attention, bottom_right_causal_mask, sieve_attention


def _inputs(b=1, hq=6, h=2, q_len=70, k_len=70, d=16, offset=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(b, hq, q_len, d, generator=g)
    key = torch.randn(b, h, k_len, d, generator=g) + offset  # a shared key offset gives large logits
    value = torch.randn(b, h, k_len, d, generator=g)
    return query, key, value


def _valid(b, h, k_len, q_len, seed=1):
    g = torch.Generator().manual_seed(seed)
    valid = torch.rand(b, h, k_len, generator=g) > 0.3
    valid[..., k_len - q_len:] = True  # the new tokens are always valid (SieveLayer.update appends True)
    valid[..., 0] = True
    return valid


def _sdpa(query, key, value, valid=None):
    """Reference in float32 through torch's sdpa with an explicit bottom-right mask: (b, q, hq, d)."""
    q_len, k_len = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    mask = bottom_right_causal_mask(q_len, k_len, query.device)[None, None]
    if valid is not None:
        mask = mask & valid.repeat_interleave(groups, dim=1)[:, :, None, :]
    out = F.scaled_dot_product_attention(query.float(), key.float().repeat_interleave(groups, 1),
                                         value.float().repeat_interleave(groups, 1), attn_mask=mask)
    return out.transpose(1, 2)


def _rel(x, ref):
    return ((x.float() - ref).norm() / ref.norm()).item()


CASES = [
    dict(q_len=70, k_len=70),  # prefill, q_len == k_len, not a multiple of the block
    dict(q_len=23, k_len=90),  # a chunk after a cache: bottom-right mask
    dict(q_len=5, k_len=200, b=2),  # a short question over a long cache, batch of 2
    dict(q_len=130, k_len=130, hq=4, h=4),  # no grouping
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("with_valid", [False, True])
def test_float32_equals_sdpa(case, with_valid):
    query, key, value = _inputs(**case)
    valid = _valid(key.shape[0], key.shape[1], key.shape[2], query.shape[2]) if with_valid else None
    out = blocked_causal_attention(query, key, value, scaling=0.25, valid=valid, block=32)
    assert out.shape == (query.shape[0], query.shape[2], query.shape[1], query.shape[3]) and out.is_contiguous()
    torch.testing.assert_close(out, _sdpa(query, key, value, valid), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("with_valid", [False, True])
@pytest.mark.parametrize("offset", [0.0, 6.0])
def test_bfloat16_is_as_close_to_float32_as_sdpa(case, with_valid, offset):
    query, key, value = _inputs(**case, offset=offset)
    valid = _valid(key.shape[0], key.shape[1], key.shape[2], query.shape[2]) if with_valid else None
    truth = _sdpa(query, key, value, valid)  # float32 inputs
    q16, k16, v16 = query.bfloat16(), key.bfloat16(), value.bfloat16()
    out = blocked_causal_attention(q16, k16, v16, scaling=0.25, valid=valid, block=32)
    assert out.dtype == torch.bfloat16
    # what bf16 sdpa achieves on the same rounded inputs (its kernel keeps float32 logits)
    groups = query.shape[1] // key.shape[1]
    mask = bottom_right_causal_mask(query.shape[2], key.shape[2], query.device)[None, None]
    if valid is not None:
        mask = mask & valid.repeat_interleave(groups, dim=1)[:, :, None, :]
    kernel = F.scaled_dot_product_attention(q16, k16.repeat_interleave(groups, 1), v16.repeat_interleave(groups, 1),
                                            attn_mask=mask, scale=0.25).transpose(1, 2)
    assert _rel(out, truth) < 1.5 * _rel(kernel, truth) + 2e-3
    torch.testing.assert_close(out.float(), truth, atol=0.05, rtol=0.02)


def test_large_logits_keep_bf16_precision():
    # keys with a large shared component (Qwen2.5's first layer reaches logits of several hundred): the
    # shift by the first key's logit keeps the rounding of the logits near the top of each row small
    query, key, value = _inputs(q_len=96, k_len=96, d=64, offset=0.0)
    key = key + 40.0 * torch.randn(1, 2, 1, 64, generator=torch.Generator().manual_seed(3))
    query, key, value = query.bfloat16(), key.bfloat16(), value.bfloat16()
    truth = _sdpa(query, key, value)  # float32 attention of the rounded inputs: only the logits' rounding differs
    out = blocked_causal_attention(query, key, value, scaling=0.125)
    logits = (query * 0.125).reshape(1, 2, 3, 96, 64) @ key[:, :, None].transpose(-1, -2)
    logits = logits.masked_fill(~bottom_right_causal_mask(96, 96, "cpu"), float("-inf"))  # rounded to bf16, no shift
    plain = (torch.softmax(logits, dim=-1) @ value[:, :, None]).reshape(1, 6, 96, 64).transpose(1, 2)
    assert _rel(out, truth) < 0.5 * _rel(plain, truth)


class _Attention(torch.nn.Module):
    def __init__(self, sliding_window=None, is_causal=True):
        super().__init__()
        self.layer_idx, self.num_key_value_groups = 0, 3
        self.sliding_window, self.is_causal = sliding_window, is_causal


@pytest.fixture
def calls(monkeypatch):
    seen = []

    def counting(*args, **kwargs):
        seen.append(args[0].shape[2])
        return blocked_causal_attention(*args, **kwargs)

    monkeypatch.setattr(attention, "blocked_causal_attention", counting)
    monkeypatch.setattr(attention, "BLOCKED_PREFILL", "1")
    return seen


@pytest.mark.parametrize("dtype,q_len,expected", [(torch.bfloat16, 40, True), (torch.bfloat16, 1, False),
                                                  (torch.float32, 40, False)])
def test_dispatch(calls, dtype, q_len, expected):
    query, key, value = (t.to(dtype) for t in _inputs(q_len=q_len, k_len=60))
    out, weights = sieve_attention(_Attention(), query, key, value, None, scaling=0.25)
    assert bool(calls) == expected and weights is None
    assert out.shape == (1, q_len, 6, 16) and out.dtype == dtype
    torch.testing.assert_close(out.float(), _sdpa(query, key, value), atol=0.05, rtol=0.02)


def test_sliding_window_and_non_causal_modules_keep_sdpa(calls):
    query, key, value = (t.bfloat16() for t in _inputs(q_len=40, k_len=60))
    sieve_attention(_Attention(sliding_window=16), query, key, value, None, scaling=0.25)
    sieve_attention(_Attention(is_causal=False), query, key, value, None, scaling=0.25)
    assert calls == []


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_prefill_under_attach_matches_the_sdpa_kernel(arch, prompt_ids, monkeypatch):
    model = tiny_model(arch).to(torch.bfloat16)

    def run():
        with kvsieve.attach(model, kvsieve.policies.get("full"), ratio=0.0):
            return model(input_ids=prompt_ids, use_cache=True).logits.float()

    monkeypatch.setattr(attention, "BLOCKED_PREFILL", "1")
    blocked = run()
    monkeypatch.setattr(attention, "BLOCKED_PREFILL", "0")
    kernel = run()
    truth = model.float()
    with kvsieve.attach(truth, kvsieve.policies.get("full"), ratio=0.0):
        reference = truth(input_ids=prompt_ids, use_cache=True).logits
    assert _rel(blocked, reference) < 1.5 * _rel(kernel, reference) + 1e-3
    assert (blocked.argmax(-1) == kernel.argmax(-1)).float().mean() > 0.95


@pytest.mark.parametrize("switch,spins,threads,expected", [
    ("auto", False, 2, True),  # the default with OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep
    ("auto", True, 2, False),  # libgomp's default spinning: the kernel
    ("auto", True, 1, True),  # one thread: nothing spins
    ("1", True, 2, True),
    ("0", False, 1, False),
])
def test_auto_takes_the_blocked_path_where_threads_do_not_spin(monkeypatch, switch, spins, threads, expected):
    monkeypatch.setattr(attention, "BLOCKED_PREFILL", switch)
    monkeypatch.setattr(attention, "_OMP_SPINS", spins)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert attention.use_blocked_prefill(torch.bfloat16) == expected
    assert not attention.use_blocked_prefill(torch.float32)


def test_environment_sets_the_switch_and_the_wait_policy():
    import os
    import subprocess
    import sys

    code = "import kvsieve.engine.attention as a; print(a.BLOCKED_PREFILL, a._OMP_SPINS)"
    cases = (({"KVSIEVE_BLOCKED_PREFILL": "0"}, "0 True"), ({"OMP_WAIT_POLICY": "PASSIVE"}, "auto False"),
             ({"GOMP_SPINCOUNT": "0"}, "auto False"), ({}, "auto True"))
    for extra, expected in cases:
        env = {k: v for k, v in os.environ.items()
               if k not in ("KVSIEVE_BLOCKED_PREFILL", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                             check=True)
        assert out.stdout.strip() == expected


def test_workers_give_the_serial_result_and_leave_the_thread_count(monkeypatch):
    query, key, value = (t.bfloat16() for t in _inputs(q_len=200, k_len=230))
    valid = _valid(1, 2, 230, 200)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        serial = blocked_causal_attention(query, key, value, valid=valid, block=32)
    finally:
        torch.set_num_threads(threads)
    torch.set_num_threads(3)
    try:
        with torch.inference_mode():
            threaded = blocked_causal_attention(query, key, value, valid=valid, block=32)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, threaded)
    assert attention._workers(3).submit(torch.get_num_threads).result() == 1
