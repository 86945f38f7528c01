"""Loss scalers: hysteresis, growth, clamping, state round trip, construction from the config."""

import io

import pytest
import torch

from tessera.config import Config, ConfigError
from tessera.core.grad_scaler import ConstantGradScaler, DynamicGradScaler, build_grad_scaler


def _run(scaler, events):
    """Apply overflow events (True = inf found) and return the scale after each."""
    out = []
    for found_inf in events:
        scaler.update(found_inf)
        out.append(scaler.scale)
    return out


def test_hysteresis_backoff_and_growth():
    s = DynamicGradScaler(initial_scale=1024, min_scale=1, growth_factor=2, backoff_factor=0.5,
                          growth_interval=3, hysteresis=2, max_scale=2**20)
    # 1st overflow: counted, no backoff; 2nd: backoff; 3rd (no growth in between): backoff again
    assert _run(s, [True]) == [1024]
    assert _run(s, [True]) == [512]
    assert _run(s, [True]) == [256]
    # 3 clean steps grow once and reset both counters
    assert _run(s, [False, False, False]) == [256, 256, 512]
    # after the reset a single overflow is tolerated again
    assert _run(s, [True]) == [512]
    # an overflow resets the clean-step count: two clean, overflow (2nd -> backoff), then 3 more clean
    assert _run(s, [False, False, True]) == [512, 512, 256]
    assert _run(s, [False, False, False]) == [256, 256, 512]


def test_clamped_to_min_and_max():
    s = DynamicGradScaler(initial_scale=4, min_scale=2, growth_interval=1, hysteresis=1, max_scale=16)
    assert _run(s, [True, True, True]) == [2, 2, 2]
    assert _run(s, [False] * 5) == [4, 8, 16, 16, 16]


def test_state_dict_round_trip_mid_window():
    kw = dict(initial_scale=2**10, growth_interval=4, hysteresis=3)
    a = DynamicGradScaler(**kw)
    _run(a, [True, False, False, True])  # 2 hysteresis steps, 0 clean steps... then
    _run(a, [False, False])  # mid growth window: 2 of 4 clean steps, hysteresis count 2
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = DynamicGradScaler(**kw)
    b.load_state_dict(torch.load(buf, weights_only=True))
    tail = [False, False, True, True, True, False]
    # by the rule: 2 more clean steps complete the window (grow), then 3 overflows back off once
    expected = [2**10, 2**11, 2**11, 2**11, 2**10, 2**10]
    assert _run(b, tail) == expected
    assert _run(a, tail) == expected
    # restoring only the scale (counters lost) gives a different trajectory: the test can fail
    c = DynamicGradScaler(**kw)
    c.load_state_dict({"scale": 2**10})
    assert _run(c, tail) != expected


def test_constant_scaler():
    s = ConstantGradScaler()
    assert s.scale == 1.0
    assert _run(s, [True, True, False]) == [1.0, 1.0, 1.0]
    s2 = ConstantGradScaler(8.0)
    s2.load_state_dict(s.state_dict())
    assert s2.scale == 1.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="min_scale"):
        DynamicGradScaler(initial_scale=1, min_scale=2)
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicGradScaler(backoff_factor=1.5)


def test_build_from_config():
    cfg = Config.from_dict(dict(
        model=dict(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16),
        data=dict(type="synthetic"),
        grad_scaler=dict(fp16=dict(initial_scale=2**12, min_scale=4, growth_interval=7), hysteresis=3,
                         growth_factor=4.0, backoff_factor=0.25, max_scale=2**14),
    ))
    s = build_grad_scaler(cfg.grad_scaler, "torch.float16")
    assert isinstance(s, DynamicGradScaler)
    assert (s.scale, s.min_scale, s.growth_interval, s.hysteresis, s.growth_factor, s.backoff_factor, s.max_scale) == (
        2**12, 4, 7, 3, 4.0, 0.25, 2**14)
    for name in ("torch.bfloat16", "bf16", "torch.float32", "torch.tf32", torch.float32):
        c = build_grad_scaler(cfg.grad_scaler, name)
        assert isinstance(c, ConstantGradScaler) and c.scale == 1.0
    assert isinstance(build_grad_scaler(None, "fp16"), DynamicGradScaler)
    with pytest.raises(ConfigError, match="hysteris"):
        build_grad_scaler({"hysteris": 2}, "fp16")
