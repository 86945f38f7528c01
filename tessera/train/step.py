"""One optimizer step over ``micro_num`` micro-batches, and validation.

Kept separate from ``train.py`` so tests and benchmarks drive exactly the step that training runs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tessera.model.transformer import logits_are_vocab_sharded
from tessera.optim.hybrid_zero import HybridZeroOptimizer
from tessera.parallel import vocab_parallel_cross_entropy
from tessera.parallel.comm import to_host
from tessera.parallel.coordination import reduce_scalars
from tessera.parallel.loss import LossSpec
from tessera.train.batch import to_device
from tessera.train.precision_telemetry import PrecisionTelemetry


@dataclass
class StepResult:
    loss: float  # mean over micro-batches and DP ranks
    grad_norm: float
    success: bool  # False when the update was skipped (inf/NaN)
    tokens: int  # tokens processed by the whole job in this step
    step_time: float
    precision: dict[str, Any] | None = None  # the precision telemetry of a measured step (PrecisionTelemetry.finish)


def _all_reduce_sum(values: list[float], group: dist.ProcessGroup | None, device: torch.device) -> list[float]:
    """Sum host numbers over ``group`` in fp64 on the compute ``device`` (NCCL refuses CPU tensors)."""
    if group is None:
        return list(values)
    return reduce_scalars(values, group, device=device)


def _labelled_tokens(batch: Mapping[str, Any]) -> float:
    return float(to_host((batch["labels"] != -100).sum()))


class Trainer:
    """Forward/backward/step for a TP x DP model wrapped in NaiveAMPModel + HybridZeroOptimizer."""

    def __init__(self, model: torch.nn.Module, optimizer: HybridZeroOptimizer, *, tp_group: dist.ProcessGroup | None,
                 dp_group: dist.ProcessGroup | None, device: torch.device, label_smoothing: float = 0.0,
                 dp_size: int = 1, telemetry: PrecisionTelemetry | None = None, chunk_tokens: int = 1024,
                 compile_loss: bool = False):
        self.model = model
        self.optimizer = optimizer
        self.tp_group = tp_group
        # the loss reduces over TP only when each rank holds a vocab shard of the logits
        self.loss_group = tp_group if logits_are_vocab_sharded(model) else None
        self.dp_group = dp_group
        self.device = device
        self.label_smoothing = label_smoothing
        self.dp_size = dp_size
        self.telemetry = telemetry  # None unless metrics.precision_every > 0
        # loss.chunk_tokens: the head and the loss fused in chunks (the model returns the loss); 0 keeps the
        # logits whole. The telemetry does not change the path (measuring changes nothing): under the fused
        # head it sees no head output to measure
        self.chunk_tokens = chunk_tokens
        self.compile_loss = compile_loss  # the fused path's per-chunk math compiled (with model.compile)

    def _loss(self, batch: Mapping[str, Any], reduction: str = "mean",
              label_smoothing: float | None = None) -> torch.Tensor:
        # max_seqlen: set on the host with cu_seqlens (tessera.train.batch), so the model never reads it back
        packed = {"max_seqlen": batch["max_seqlen"]} if "max_seqlen" in batch else {}
        smoothing = self.label_smoothing if label_smoothing is None else label_smoothing
        if self.chunk_tokens:
            spec = LossSpec(ignore_index=-100, label_smoothing=smoothing, reduction=reduction,
                            chunk_tokens=self.chunk_tokens, compiled=self.compile_loss)
            return self.model(batch["input_ids"], cu_seqlens=batch.get("cu_seqlens"),
                              position_ids=batch.get("position_ids"), labels=batch["labels"], loss=spec, **packed)
        logits = self.model(batch["input_ids"], cu_seqlens=batch.get("cu_seqlens"),
                            position_ids=batch.get("position_ids"), **packed)
        return vocab_parallel_cross_entropy(logits, batch["labels"], self.loss_group, ignore_index=-100,
                                            label_smoothing=smoothing, reduction=reduction)

    def train_step(self, micro_batches: Sequence[Mapping[str, Any]], step: int | None = None) -> StepResult:
        """Accumulate gradients over the micro-batches, then one optimizer step (or a skip).

        The objective is the token-weighted mean over the whole global batch: each micro-batch's
        summed loss is divided by the global count of labelled tokens (one small all-reduce up front).
        Gradients and the logged loss are then the same however the batch is split over DP ranks and
        micro-batches, so resuming on another layout continues the same run. The optimizer averages
        gradients over DP, hence the ``dp_size`` factor. ``step`` (from 1): the optimizer step this is,
        which decides whether the precision telemetry measures it (its time counts in ``step_time``).
        """
        t0 = time.perf_counter()
        telemetry = self.telemetry if self.telemetry is not None and step is not None and self.telemetry.due(step) \
            else None
        if telemetry is None:
            result = self._train_step(micro_batches)
        else:
            telemetry.begin()
            try:
                result = self._train_step(micro_batches)
            finally:
                telemetry.detach()
            result.precision = telemetry.finish()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        result.step_time = time.perf_counter() - t0
        return result

    def _train_step(self, micro_batches: Sequence[Mapping[str, Any]]) -> StepResult:
        self.model.train()
        self.optimizer.zero_grad()
        local_tokens = sum(_labelled_tokens(b) for b in micro_batches)  # before the copy: no device sync
        batches = [to_device(b, self.device, f"micro-batch {i}") for i, b in enumerate(micro_batches)]
        global_tokens = max(_all_reduce_sum([local_tokens], self.dp_group, self.device)[0], 1.0)
        nats = []
        tokens = 0
        for i, batch in enumerate(batches):
            loss_sum = self._loss(batch, reduction="sum")
            # the last micro-batch's backward overlaps the DP gradient reduction, bucket by bucket
            self.optimizer.backward(loss_sum * (self.dp_size / global_tokens),
                                    overlap_reduction=i == len(batches) - 1)
            nats.append(loss_sum.detach().double())
            tokens += batch["input_ids"].numel()
        success, grad_norm = self.optimizer.step()
        total_nats = to_host(torch.stack(nats).sum())  # one device sync for all micro-batches
        mean_loss = _all_reduce_sum([total_nats], self.dp_group, self.device)[0] / global_tokens
        return StepResult(mean_loss, float(grad_norm), bool(success), tokens * self.dp_size, 0.0)

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Mapping[str, Any]]) -> dict[str, float]:
        """Loss, bits per token and (when byte counts are known) bits per byte over the batches.

        Sums of nats, tokens and bytes are reduced over DP before dividing, so the figure is the
        token-weighted mean over the whole validation set, independent of the DP size.
        """
        self.model.eval()
        nats = tokens = nbytes = 0.0
        for i, batch in enumerate(batches):
            tokens += _labelled_tokens(batch)
            if "num_bytes" in batch:
                nbytes += float(to_host(batch["num_bytes"].sum()))
            batch = to_device(batch, self.device, f"validation batch {i}")
            nats += to_host(self._loss(batch, reduction="sum", label_smoothing=0.0).double())
        self.model.train()
        nats, tokens, nbytes = _all_reduce_sum([nats, tokens, nbytes], self.dp_group, self.device)
        out = {"loss": nats / max(tokens, 1.0), "tokens": int(tokens)}
        out["bits_per_token"] = out["loss"] / math.log(2)
        if nbytes > 0:
            out["bits_per_byte"] = nats / nbytes / math.log(2)
        return out
