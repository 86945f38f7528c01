"""Warmup + cosine LR: values against the closed form written here, and resume from a step number."""

import math

import pytest

from tessera.train.lr_scheduler import WarmupCosineLR


def expected(step, base=1e-3, total=100, warmup=10, eta_min=1e-5):
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (total - warmup))
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * progress)) / 2


def test_schedule_values_and_group_updates():
    groups = [{"lr": 0.0}, {"lr": 0.0}]
    sched = WarmupCosineLR(groups, base_lr=1e-3, total_steps=100, warmup_ratio=0.1, eta_min=1e-5)
    seen = []
    for step in range(120):
        assert all(g["lr"] == pytest.approx(expected(step), rel=1e-12) for g in groups), step
        seen.append(groups[0]["lr"])
        sched.step()
    assert seen[9] == pytest.approx(1e-3) and seen[0] == pytest.approx(1e-4)
    assert seen[100] == pytest.approx(1e-5) and seen[119] == pytest.approx(1e-5)  # flat after the end
    assert max(seen) == pytest.approx(1e-3)


def test_resume_from_state_dict_continues_the_same_schedule():
    a_groups, b_groups = [{"lr": 0.0}], [{"lr": 0.0}]
    a = WarmupCosineLR(a_groups, 1e-3, 50, 0.2, 0.0)
    for _ in range(17):
        a.step()
    b = WarmupCosineLR(b_groups, 1e-3, 50, 0.2, 0.0)
    b.load_state_dict(a.state_dict())
    for _ in range(10):
        assert a_groups[0]["lr"] == b_groups[0]["lr"] == a.current_lr
        a.step()
        b.step()


def test_no_warmup_starts_at_base_lr():
    groups = [{"lr": 0.0}]
    WarmupCosineLR(groups, 2e-3, 10, warmup_ratio=0.0, eta_min=0.0)
    assert groups[0]["lr"] == pytest.approx(2e-3)
