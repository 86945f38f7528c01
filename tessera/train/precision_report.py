"""Precision report: per-module storage/compute dtype, and training memory per parameter, measured.

Why measured: the closed form (``2 + 4 + (4 + 8)/d`` bytes per bf16 parameter, ``tessera.memory.persistent``)
is what the design promises; the report builds the real NaiveAMPModel + HybridZeroOptimizer, runs one step and
sums the bytes of the tensors that are actually allocated, so a regression (an extra fp32 copy, unsharded
states, a leaked ``.grad``) shows up as a gap between the two columns.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.core.naive_amp import NaiveAMPModel, fp32_module_names, unwrap_model
from tessera.memory.persistent import ROLES, closed_form_bytes
from tessera.optim.hybrid_zero import HybridZeroOptimizer
from tessera.optim.params import build_param_groups
from tessera.precision.plan import PrecisionPlan

__all__ = ["ModuleRow", "PrecisionReport", "precision_report", "POLICIES", "policy_table"]

# the optimizer precision policies (hybrid_zero_optimizer keys), as the report names them
POLICIES: dict[str, dict[str, str]] = {
    "fp32 masters (default)": {},
    "bf16 masters": {"master_dtype": "bf16"},
    "bf16 masters + Kahan": {"master_dtype": "bf16", "master_compensation": "kahan"},
    "bf16 masters + stochastic": {"master_dtype": "bf16", "master_compensation": "stochastic"},
    "bf16 Adam moments": {"optimizer_state_dtype": "bf16"},
    "bf16 masters + Kahan + bf16 moments": {"master_dtype": "bf16", "master_compensation": "kahan",
                                            "optimizer_state_dtype": "bf16"},
}


@dataclass
class ModuleRow:
    name: str
    kind: str  # class name
    params: int  # parameters owned directly by this module
    param_dtype: str
    compute_dtype: str
    fp32: bool  # marked (itself or through an ancestor)


@dataclass
class PrecisionReport:
    precision: str
    zero1_size: int
    reduce_dtype: str
    num_params: int  # on this rank (TP-local)
    fp32_params: int  # of which kept fp32 by marking (or all, for fp32/tf32)
    rows: list[ModuleRow] = field(default_factory=list)
    measured: dict[str, float] = field(default_factory=dict)  # bytes / parameter, from allocated tensors
    closed_form: dict[str, float] = field(default_factory=dict)  # bytes / parameter, for this model's mix
    closed_form_uniform: dict[str, float] = field(default_factory=dict)  # every param in the model dtype

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format(self) -> str:
        """A human-readable table (what tools/precision_report.py prints)."""
        lines = [f"precision {self.precision}, ZeRO-1 over {self.zero1_size}, gradient reduce dtype "
                 f"{self.reduce_dtype}; {self.num_params:,} parameters ({self.fp32_params:,} kept fp32)", ""]
        w = max([len(r.name) for r in self.rows] + [6])
        lines.append(f"{'module':<{w}}  {'class':<22} {'params':>10}  {'param dtype':<12} {'compute':<9} fp32-marked")
        for r in self.rows:
            lines.append(f"{r.name:<{w}}  {r.kind:<22} {r.params:>10,}  {r.param_dtype:<12} {r.compute_dtype:<9} "
                         f"{'yes' if r.fp32 else ''}")
        lines += ["", "persistent training memory, bytes per parameter (measured after one step vs closed form)",
                  f"{'':<18}{'measured':>10}{'closed form':>13}{'uniform':>10}"]
        for role in (*ROLES, "total"):
            lines.append(f"{role:<18}{self.measured.get(role, 0):>10.3f}{self.closed_form.get(role, 0):>13.3f}"
                         f"{self.closed_form_uniform.get(role, 0):>10.3f}")
        lines.append("uniform = every parameter in the model dtype: 2 + 4 + (4 + 8)/d for bf16/fp16 "
                     "(18 without ZeRO), 4 + 4 + 8/d for fp32/tf32")
        return "\n".join(lines)


def _default_loss(output: Any) -> torch.Tensor:
    """Any differentiable scalar will do: the report measures memory, not learning."""
    if isinstance(output, (tuple, list)):
        output = output[0]
    if isinstance(output, dict):
        output = next(iter(output.values()))
    return output.float().pow(2).mean()


def _rows(amp: NaiveAMPModel) -> list[ModuleRow]:
    fp32_names = fp32_module_names(amp)
    model_dtype = amp.model_dtype
    rows = []
    for name, module in unwrap_model(amp).named_modules():
        own = list(module.parameters(recurse=False))
        if not own and name not in fp32_names:
            continue
        if not own and any(name.startswith(f + ".") for f in fp32_names if f):
            continue  # a container inside a marked module adds nothing
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in own}) or ["-"]
        marked = name in fp32_names
        compute = "float32" if marked else ("tf32" if model_dtype.tf32 else model_dtype.name)
        rows.append(ModuleRow(name or "(root)", type(module).__name__, sum(p.numel() for p in own),
                              "/".join(dtypes), compute, marked))
    return rows


def _build_and_measure(
    model: nn.Module, dtype: Any, batch: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
    fp32_modules: Iterable[str], use_fp32_norm: bool, reduce_dtype: str, groups: dict[str, Any],
    policy: dict[str, str] | None = None,
) -> PrecisionReport:
    amp = NaiveAMPModel(model, dtype=dtype, sync_buffer=False, fp32_modules=list(fp32_modules),
                        use_fp32_norm=use_fp32_norm)
    inner = torch.optim.AdamW(build_param_groups(amp, 0.01), lr=1e-4)
    opt = HybridZeroOptimizer(inner, zero_cfg={**(policy or {}), "reduce_dtype": reduce_dtype}, dtype=dtype,
                              param_names=unwrap_model(amp), **groups)
    args = batch if isinstance(batch, tuple) else (batch,)
    opt.backward((loss_fn or _default_loss)(amp(*args)))
    opt.step()
    mem = opt.memory_bytes()
    n = mem["num_params"]
    measured = {role: mem[role] / n for role in ROLES}
    measured["total"] = sum(measured.values())
    params = list(amp.parameters())
    low = sum(p.numel() for p in params if p.dtype != torch.float32)
    fp32 = sum(p.numel() for p in params if p.dtype == torch.float32)
    run = PrecisionPlan(amp.model_dtype, optimizer=opt.optimizer_dtypes)  # what this optimizer resolved
    d = opt.zero1_size
    return PrecisionReport(
        precision=run.name, zero1_size=d, reduce_dtype=reduce_dtype,
        num_params=n, fp32_params=fp32, rows=_rows(amp), measured=measured,
        closed_form=closed_form_bytes(run, d, low, fp32),
        closed_form_uniform=closed_form_bytes(run, d, low + fp32, 0)
        if run.model.is_low_precision else closed_form_bytes(run, d, 0, low + fp32),
    )


def precision_report(
    model: nn.Module,
    dtype: Any,
    zero1_size: int = 1,
    *,
    batch: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    fp32_modules: Iterable[str] = (),
    use_fp32_norm: bool = False,
    reduce_dtype: str = "fp32",
    policy: dict[str, str] | None = None,
) -> PrecisionReport:
    """Wrap ``model`` (an unwrapped fp32 module; it is cast in place), run one optimizer step on
    ``batch`` and report dtypes per module and measured vs closed-form bytes per parameter.
    ``policy``: the optimizer's precision keys (``master_dtype``, ``master_compensation``,
    ``optimizer_state_dtype``; see ``POLICIES``).

    ``zero1_size > 1`` runs in a job whose default process group has exactly that many ranks, ZeRO over
    that group (every rank calls it and gets its own rank's report): ``torchrun --nproc_per_node=N``,
    which ``tools/precision_report.py --zero1 N`` starts itself. The package starts no processes.
    """
    if isinstance(model, NaiveAMPModel):
        raise TypeError("precision_report: pass the unwrapped model; the report wraps it itself")
    if zero1_size < 1:
        raise ValueError(f"zero1_size must be >= 1, got {zero1_size}")
    fp32_modules = list(fp32_modules)
    if zero1_size == 1:
        return _build_and_measure(model, dtype, batch, loss_fn, fp32_modules, use_fp32_norm, reduce_dtype, {},
                                  policy)
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"precision_report: zero1_size={zero1_size} needs a job of {zero1_size} processes "
                         f"(torchrun --nproc_per_node={zero1_size}, or tools/precision_report.py --zero1 "
                         f"{zero1_size}, which starts one)")
    if dist.get_world_size() != zero1_size:
        raise ValueError(f"precision_report: zero1_size={zero1_size} but the default process group has "
                         f"{dist.get_world_size()} ranks")
    group = dist.group.WORLD
    return _build_and_measure(model, dtype, batch, loss_fn, fp32_modules, use_fp32_norm, reduce_dtype,
                              {"dp_group": group, "zero1_group": group, "global_group": group}, policy)


_BUFFERS = (  # role -> (what it is, its dtype under a policy)
    ("weights", "weights", lambda pol, model: model),
    ("main_grads", "main grads", lambda pol, model: "float32"),
    ("masters", "masters", lambda pol, model: "= weights (shared)" if pol.get("master_dtype") == "bf16" else "float32"),
    ("compensation", "Kahan compensation", lambda pol, model: "bfloat16"
     if pol.get("master_compensation") == "kahan" else "-"),
    ("optimizer_states", "Adam moments", lambda pol, model: "bfloat16"
     if pol.get("optimizer_state_dtype") == "bf16" else "float32"),
)


def policy_table(model_factory: Callable[[], nn.Module], zero1_size: int, *, batch: Any,
                 policies: dict[str, dict[str, str]] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """Every persistent buffer of each optimizer precision policy (bf16 model): dtype and bytes per
    parameter, measured and closed form, without ZeRO and with ZeRO over ``zero1_size`` ranks (in a job
    of that many processes, as ``precision_report``).

    ``model_factory()`` builds a fresh unwrapped fp32 model (each measurement casts one). Returns the
    table as text and the rows as dicts (for JSON)."""
    rows: list[dict[str, Any]] = []
    lines = []
    for name, pol in (policies or POLICIES).items():
        reports = {d: precision_report(model_factory(), "bf16", d, batch=batch, policy=pol)
                   for d in sorted({1, zero1_size})}
        lines += ["", f"{name}  {pol or '(defaults)'}",
                  f"  {'buffer':<20}{'dtype':<20}" + "".join(f"{f'ZeRO {d}: measured':>20}{'closed form':>13}"
                                                            for d in reports)]
        for role, label, dtype_of in (*_BUFFERS, ("total", "total", lambda pol, model: "")):
            cells = "".join(f"{r.measured.get(role, 0):>20.3f}{r.closed_form.get(role, 0):>13.3f}"
                            for r in reports.values())
            lines.append(f"  {label:<20}{dtype_of(pol, 'bfloat16'):<20}{cells}")
            rows.append({"policy": name, "keys": pol, "buffer": role, "dtype": dtype_of(pol, "bfloat16"),
                         **{f"zero{d}": {"measured": r.measured.get(role, 0), "closed_form": r.closed_form.get(role, 0)}
                            for d, r in reports.items()}})
    head = ("persistent training memory per parameter by optimizer precision policy (bf16 model, fp32 main "
            "grads); measured from the allocated tensors after one step, closed form beside it")
    return "\n".join([head, *lines]), rows
