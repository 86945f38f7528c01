"""End to end: the tiny decoder trained 200 steps in bf16 and fp16 lands within 2% of the fp32 run."""

import pytest
import torch
import torch.nn.functional as F

from tessera.config import Config
from tessera.core.job import Job
from tessera.train.builder import build_training_stack

VOCAB, SEQ, STEPS = 64, 32, 200


def _markov(n: int, seed: int) -> torch.Tensor:
    """Sequences from a fixed Markov chain: a learnable task with an entropy floor (~1.1 nats)."""
    succ = torch.randint(0, VOCAB, (VOCAB, 4), generator=torch.Generator().manual_seed(123))
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05]).expand(n, 4)
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, SEQ + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(1, SEQ + 1):
        x[:, t] = succ[x[:, t - 1], torch.multinomial(probs, 1, generator=g).squeeze(1)]
    return x


def _loss(model, batch):
    logits = model(batch[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def _train(dtype: str):
    cfg = Config.from_dict(dict(
        model=dict(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=VOCAB, mlp_ratio=2.0,
                   multiple_of=16, dtype=dtype, use_flash_attn=False, use_fp32_norm=True),
        data=dict(type="synthetic", seq_len=SEQ, micro_bsz=2, micro_num=2),
        adam=dict(lr=1e-2, weight_decay=0.0),
        lr_scheduler=dict(warmup_ratio=0.0, eta_min=1e-2),  # a constant learning rate: no scheduler is stepped
        hybrid_zero_optimizer=dict(clip_grad_norm=1.0),
    ))
    stack = build_training_stack(cfg, Job.of(cfg, seed=0), sync_buffer=False)
    model, opt = stack.model, stack.optimizer
    data = _markov(STEPS * 4, seed=1)
    for step in range(STEPS):
        for micro in range(2):  # the trainer's pattern: loss / micro_num per micro-batch, one step
            i = step * 4 + micro * 2
            opt.backward(_loss(model, data[i : i + 2]) / 2)
        opt.step()
    with torch.no_grad():
        final = _loss(model, _markov(16, seed=999)).item()
    return final, opt


@pytest.fixture(scope="module")
def fp32_loss():
    loss, opt = _train("torch.float32")
    assert loss < 1.5  # it learned (uniform guessing is ln 64 = 4.16)
    assert opt.scale_history == [1.0] * STEPS
    return loss


@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
def test_low_precision_matches_fp32_final_loss(dtype, fp32_loss):
    loss, opt = _train(dtype)
    # not a rounding bound (tests/tolerances.py has none for this): after 200 steps the low-precision and fp32
    # trajectories have long decorrelated, and what is compared is where training lands on the task's floor
    # (an outcome, like a seed-to-seed spread), so 2% stays. Measured: bf16 4.9e-4, fp16 2.8e-4.
    assert loss == pytest.approx(fp32_loss, rel=0.02)
    history = opt.scale_history  # the loss scale used at every step, for the metrics log
    assert len(history) == STEPS
    if dtype == "torch.float16":
        assert history[0] == 2**16 and all(s >= 1 for s in history)
        assert opt.skipped_steps <= 10
    else:
        assert history == [1.0] * STEPS
