"""The golden curve: configs/tiny.py trained for 30 steps follows the losses kept in tests/fixtures/golden/tiny,
within a bound derived from rounding, so a change that moves the numerics of any module fails here even when
every unit test passes (the mutation pass's ``rmsnorm-eps-doubled`` has this test as its only killer).

The file is what ``train.py`` wrote (its ``metrics.jsonl``, train records: step, loss, lr), so
``python tools/compare_runs.py tests/fixtures/golden/tiny RUN`` reads it too. Rewrite it only for a change
that is meant to move the numerics, and say so in the commit::

    python -m tests.test_golden_curve --write
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import torch

from tessera.config import Config
from tessera.model import build_model
from tests.test_deterministic import TINY, train_tiny
from tests.tolerances import adam_window_gain, mean_loss_rtol, order_rtol, transformer_depth

ROOT = Path(__file__).resolve().parents[1]

GOLDEN = ROOT / "tests" / "fixtures" / "golden" / "tiny"
STEPS = 30
OVERRIDES = ("deterministic=True",)


def _records(folder: Path | str) -> list[dict]:
    with open(Path(folder) / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r.get("kind") == "train"]


def loss_rtols(lrs: list[float], losses: list[float]) -> list[float]:
    """Per step, the relative difference from the golden loss that rounding alone can explain on any CPU.

    Another machine sums in other orders (SIMD width, GEMM blocking), so its fp32 run rounds differently:

    - the forward pass: the logits carry ``order_rtol(fp32, n, depth)`` (``tests/tolerances.py``: two
      orders, ``n`` the longest reduction, ``depth`` the chained reductions to the logits), which moves a
      mean cross-entropy token by token (``mean_loss_rtol``, not shared);
    - the weights: each step's gradients differ by ``order_rtol`` over the backward depth; Adam turns that
      into a weight difference of ``lr / weight_rms * gain`` per step (``adam_rtol``), ``gain`` the window
      of elements within ``adam_eps`` of zero (``adam_window_gain``, with the gradient RMS bounded by the
      clipping norm over the tensor's size: the smallest matrix and the smallest vector bound it); the
      steps before step t add up, every parameter tensor's share adds in quadrature to the logits, and it
      moves the loss coherently over the tokens (``mean_loss_rtol``, shared);
    - the logits' size: by Cauchy-Schwarz ``|z| <= ||h|| * ||w_row||``, with the final norm's output of
      RMS <= 1 + sum(lr) and head rows of RMS <= init_std + sum(lr) (an Adam step moves an element by
      about lr at most), so ``z_rms <= hidden * (1 + sum lr) * (init_std + sum lr)``.

    At step 1 only the forward term is there (about 2e-7 relative here): any module whose forward numerics
    change is caught there; later the bound widens with the weights' possible drift (its window gain is a
    worst case: the measured gap between CPU capabilities stays below 1e-7 over the 30 steps).
    """
    cfg = Config.from_file(TINY, [f"data.total_steps={STEPS}", *OVERRIDES]).typed
    m, d, a = cfg.model, cfg.data, cfg.adam
    params = list(build_model(m, device="meta").parameters())
    ffn = max(p.shape[0] for p in params if p.dim() == 2 and p.shape[1] == m.hidden_size and
              p.shape[0] != m.vocab_size)
    n = max(m.vocab_size, m.hidden_size, ffn, d.seq_len * d.micro_bsz)  # longest sum: logsumexp, GEMMs, wgrad
    fwd = order_rtol(torch.float32, n, transformer_depth(m.num_layers))
    grad = order_rtol(torch.float32, n, transformer_depth(m.num_layers, backward=True))
    clip = cfg.hybrid_zero_optimizer.clip_grad_norm
    # weight difference per unit of lr and of gradient difference: gain / weight RMS (matrices: init_std;
    # norm weights: 1), the largest over the smallest tensor of each kind
    per_lr = max(adam_window_gain(clip / math.sqrt(min(p.numel() for p in params if p.dim() == dim)), a.adam_eps)
                 / rms for dim, rms in ((2, m.init_std), (1, 1.0)) if any(p.dim() == dim for p in params))
    tokens, vocab = d.seq_len * d.micro_bsz * d.micro_num, m.vocab_size
    out = []
    for t, loss in enumerate(losses):
        moved = sum(lrs[:t])
        z_rms = m.hidden_size * (1 + moved) * (m.init_std + moved)
        z_norm = z_rms * math.sqrt(tokens * vocab)
        weights = math.sqrt(len(params)) * moved * per_lr * grad
        out.append(mean_loss_rtol(fwd, logits_norm=z_norm, loss=loss, tokens=tokens, vocab=vocab)
                   + mean_loss_rtol(weights, logits_norm=z_norm, loss=loss, tokens=tokens, vocab=vocab, shared=True))
    return out


def test_the_tiny_curve_follows_the_golden_file(tmp_path):
    golden = _records(GOLDEN)
    assert [r["step"] for r in golden] == list(range(1, STEPS + 1))
    run = _records(Path(train_tiny(tmp_path, "run", *OVERRIDES, steps=STEPS)) / "tessera")
    assert [r["step"] for r in run] == [r["step"] for r in golden]
    assert [r["lr"] for r in run] == [r["lr"] for r in golden], "the LR schedule changed: not a numerics question"
    rtols = loss_rtols([r["lr"] for r in golden], [r["loss"] for r in golden])
    assert rtols[0] < 1e-6  # the bound at step 1 is tight enough to see a module's forward change
    for r, g, rtol in zip(run, golden, rtols, strict=True):
        gap = abs(r["loss"] - g["loss"]) / abs(g["loss"])
        assert gap <= rtol, (f"step {g['step']}: loss {r['loss']!r} against the golden {g['loss']!r} "
                             f"(relative {gap:.3g} > bound {rtol:.3g}): a module's numerics changed; if meant, "
                             "rewrite the file: python -m tests.test_golden_curve --write")


def _write() -> None:
    """Train the golden run and keep its train records (step, loss, lr) in tests/fixtures/golden/tiny."""
    with tempfile.TemporaryDirectory() as tmp:
        records = _records(Path(train_tiny(Path(tmp), "golden", *OVERRIDES, steps=STEPS)) / "tessera")
    GOLDEN.mkdir(parents=True, exist_ok=True)
    with open(GOLDEN / "metrics.jsonl", "w") as f:
        f.write("".join(json.dumps({"kind": "train", "step": r["step"], "loss": r["loss"], "lr": r["lr"]}) + "\n"
                        for r in records))
    print(f"wrote {len(records)} steps to {GOLDEN / 'metrics.jsonl'}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.test_golden_curve --write")
    _write()
