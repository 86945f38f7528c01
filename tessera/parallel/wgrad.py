"""Weight gradients accumulated in fp32 inside the GEMM (gradient-accumulation fusion), its state on the parameter.

Without it, the backward of a bf16 linear writes a bf16 weight gradient (rounded once per micro-batch
and, in the chunked head, once per chunk), and the optimizer's hook then adds it into the fp32 main
gradient: one extra read and write of the weight's size, and a rounding the fp32 main gradient exists
to avoid. With it (Megatron-Core's names, where ``grep`` finds them):

- the optimizer's gradient buffers give each linear's weight its fp32 main-gradient view,
  ``param.main_grad`` (``attach_main_grad``; None takes it away);
- the linear's backward, on a GEMM route that can add into it (``tessera.parallel.gemm``), adds
  ``grad_output^T @ input`` straight into that view with fp32 output (``add_wgrad``), sets
  ``param.grad_added_to_main_grad`` and hands autograd an uninitialized placeholder of the weight's shape;
- the optimizer's hook reads and clears the flag (``take_added``) and drops the placeholder.

A copy of a model is not attached: ``Parameter.__deepcopy__`` copies the data and ``requires_grad`` only.

Which GEMM does the add, per (device type, operand dtype), decided on first use and logged once:

- fp32 operands (fp32 weights, or bf16/fp16 upcast on CPUs without native kernels): ``addmm_`` into
  the main gradient (beta = 1): the accumulation happens in the GEMM's epilogue;
- bf16/fp16 operands on CUDA: ``addmm`` with ``out_dtype=float32`` writing into the main gradient, when
  this torch has it and a probe against an fp32 reference agrees; else ``mm`` with an fp32 output
  followed by an add; else no fusion;
- bf16/fp16 operands on CPUs with native low-precision kernels: no fp32-output GEMM there, so no
  fusion (the hook adds the low-precision gradient, as without fusion).

Only the weights of the column/row-parallel linears are eligible (``mark_fusable``): a weight that also
receives a gradient elsewhere (a head tied to the embedding) must not be fused, because autograd would
add the other gradient to the placeholder. A weight with a gradient hook of its own (``register_hook``)
is not fused either, so the hook sees the gradient and may change it.

Inside ``torch.compile``'d code (the decoder blocks, compiled by default on CUDA) the attribute reads
above cannot be traced as run-time decisions, so the traced backward of an eligible weight calls one
opaque operator, ``tessera::weight_grad`` (defined here), which makes the decision when the compiled
backward runs. Compiled code hands its operators aliases of the parameters, not the parameter objects,
so the operator alone finds the parameter by its storage: ``attach_main_grad`` indexes each attached
parameter in a weak mapping owned by the operator (``_ATTACHED_BY_STORAGE``, read only by ``resolve``).
The decision is never baked into the graph, so a graph traced before the optimizer attached its buffers
stays right. The operator is tagged ``cudagraph_unsafe`` (its bookkeeping is Python, which a CUDA graph
replay would skip); a torch without that tag gets no fusion inside compiled code (``COMPILED_FUSION``).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

__all__ = ["COMPILED_FUSION", "add_wgrad", "attach_main_grad", "compiled_weight_grad", "fused_in_compiled_code",
           "fused_main_grad", "is_fusable", "mark_fusable", "placeholder", "resolve", "take_added"]

logger = logging.getLogger("tessera")

_FUSABLE = "_tessera_wgrad_fusable"
_LOW = (torch.bfloat16, torch.float16)
# fusion inside compiled code needs an operator CUDA graphs leave alone (see the module docstring)
COMPILED_FUSION = hasattr(torch, "Tag") and hasattr(torch.Tag, "cudagraph_unsafe")
_KERNELS: dict[tuple[str, torch.dtype], str] = {}  # (device type, operand dtype) -> "addmm_out" | "mm_add" | "none"


def mark_fusable(weight: torch.Tensor) -> None:
    """Tag a linear layer's own weight: its gradient comes from that layer's GEMM only."""
    setattr(weight, _FUSABLE, True)


def is_fusable(param: torch.Tensor) -> bool:
    return bool(getattr(param, _FUSABLE, False))


def attach_main_grad(param: torch.Tensor, main_grad: torch.Tensor | None) -> None:
    """Give ``param`` its fp32 main-gradient view to accumulate into, ``param.main_grad`` (None: take it away)."""
    if main_grad is None:
        if hasattr(param, "main_grad"):
            del param.main_grad
            del param.grad_added_to_main_grad  # type: ignore[attr-defined]
        return
    if main_grad.dtype != torch.float32 or main_grad.shape != param.shape:
        raise ValueError(f"attach_main_grad: an fp32 view of shape {tuple(param.shape)} is needed, got "
                         f"{main_grad.dtype} {tuple(main_grad.shape)}")
    param.main_grad = main_grad  # type: ignore[attr-defined]
    param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
    if param.data_ptr():  # meta tensors have no storage (and are never compiled)
        _ATTACHED_BY_STORAGE[_storage_key(param)] = param


def _kernel(device: torch.device, dtype: torch.dtype) -> str:
    key = (device.type, dtype)
    if key not in _KERNELS:
        if dtype not in _LOW:
            choice = "fp32"
        elif device.type == "meta":  # shape-only runs mirror the GPU's fused path
            choice = "addmm_out" if _meta_addmm_out() else "meta_in_place"
        elif device.type == "cpu":
            choice = "none"
        else:
            choice = _probe(device, dtype)
        _KERNELS[key] = choice
        how = {"fp32": "added into the fp32 main gradient by the GEMM (addmm_)",
               "addmm_out": "added into the fp32 main gradient by an fp32-output GEMM (addmm out_dtype)",
               "mm_add": "an fp32-output GEMM, then added into the fp32 main gradient",
               "meta_in_place": "added in place, shapes only (this torch's meta addmm takes no out_dtype; the "
                                "fused GEMM allocates nothing, nor does this)",
               "none": "computed in the operands' dtype and added by the optimizer's hook (no fp32-output "
                       "GEMM here)"}[choice]
        logger.info("weight gradients of %s linears on %s: %s", str(dtype).split(".")[-1], device.type, how)
    return _KERNELS[key]


def _meta_addmm_out() -> bool:
    """Whether this torch runs ``addmm(..., out_dtype=float32, out=)`` on meta tensors (torch 2.11's
    decomposition raises a TypeError there; CUDA's kernel takes it)."""
    a = torch.empty(4, 3, device="meta", dtype=torch.bfloat16)
    b, c = torch.empty(3, 5, device="meta", dtype=torch.bfloat16), torch.empty(4, 5, device="meta")
    try:
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _probe(device: torch.device, dtype: torch.dtype) -> str:
    """The fp32-output GEMM this torch offers for ``dtype`` operands on ``device``, checked on a small case."""
    a = torch.arange(12, device=device, dtype=torch.float32).reshape(4, 3).div_(7).to(dtype)
    b = torch.arange(15, device=device, dtype=torch.float32).reshape(3, 5).div_(11).to(dtype)
    want = torch.ones(4, 5, device=device) + a.float() @ b.float()
    attempts = {
        "addmm_out": lambda c: torch.addmm(c, a, b, out_dtype=torch.float32, out=c),
        "mm_add": lambda c: c.add_(torch.mm(a, b, out_dtype=torch.float32)),
    }
    for name, run in attempts.items():
        try:
            got = torch.ones(4, 5, device=device)
            run(got)
        except (RuntimeError, TypeError, NotImplementedError):
            continue
        if torch.allclose(got, want, rtol=1e-6, atol=1e-6):
            return name
    return "none"


def fused_main_grad(weight: torch.Tensor, operand_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``weight.main_grad`` when the backward of ``weight``'s GEMM should add into it, else None (not attached,
    not needed, inside compiled code, or no fp32-output GEMM for ``operand_dtype`` operands here)."""
    if torch.compiler.is_compiling():  # first: the tracer never sees the lookup below
        return None
    main = getattr(weight, "main_grad", None)
    if main is None or not weight.requires_grad:
        return None
    if weight._backward_hooks:  # a gradient hook (register_hook) must see, and may change, the gradient
        return None
    if _kernel(weight.device, operand_dtype or weight.dtype) == "none":
        return None
    return main


def add_wgrad(main: torch.Tensor, weight: torch.Tensor, grad_2d: torch.Tensor, input_2d: torch.Tensor) -> None:
    """``main += grad_2d^T @ input_2d`` with fp32 accumulation; sets ``weight.grad_added_to_main_grad`` so the
    hook skips its add."""
    kernel = _kernel(main.device, grad_2d.dtype)
    if kernel == "fp32":
        main.addmm_(grad_2d.t().float(), input_2d.float())
    elif kernel == "addmm_out":
        torch.addmm(main, grad_2d.t(), input_2d, out_dtype=torch.float32, out=main)
    elif kernel == "mm_add":
        main.add_(torch.mm(grad_2d.t(), input_2d, out_dtype=torch.float32))
    elif kernel == "meta_in_place":
        if main.shape != (grad_2d.shape[1], input_2d.shape[1]):
            raise RuntimeError(f"add_wgrad: main gradient {tuple(main.shape)} does not match grad^T @ input "
                               f"{(grad_2d.shape[1], input_2d.shape[1])}")
    else:
        raise RuntimeError(f"add_wgrad: no fp32-output GEMM for {grad_2d.dtype} on {main.device.type}")
    if getattr(weight, "main_grad", None) is not main:
        raise RuntimeError("add_wgrad: the weight's main gradient is not the one added into")
    weight.grad_added_to_main_grad = True  # type: ignore[attr-defined]


def placeholder(weight: torch.Tensor) -> torch.Tensor:
    """What the backward returns as the weight's gradient once it is in the main gradient: uninitialized,
    never read (the hook drops it), so autograd's accumulation costs an allocation and nothing else."""
    return torch.empty_like(weight)


def take_added(param: torch.Tensor) -> bool:
    """True once after a backward added ``param``'s gradient into its main gradient (the hook's question):
    reads and clears ``param.grad_added_to_main_grad``."""
    if not getattr(param, "grad_added_to_main_grad", False):
        return False
    param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
    return True


# ------------------------------------------------------------------ inside compiled code: tessera::weight_grad
def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.data_ptr()


# the attached parameters by storage, for the operator alone (compiled code passes it aliases); weak values,
# so an entry goes with its parameter
_ATTACHED_BY_STORAGE: weakref.WeakValueDictionary[tuple[str, int], torch.Tensor] = weakref.WeakValueDictionary()


def resolve(weight: torch.Tensor) -> torch.Tensor:
    """The attached parameter whose storage ``weight`` is, else ``weight`` itself: never attached, attached
    before its storage moved (``param.data = ...``), or a copy. Only the same storage, shape and dtype count."""
    key = _storage_key(weight)
    param = _ATTACHED_BY_STORAGE.get(key)
    if param is None or getattr(param, "main_grad", None) is None or param.shape != weight.shape \
            or param.dtype != weight.dtype or _storage_key(param) != key:
        return weight
    return param


def fused_in_compiled_code(weight: torch.Tensor) -> bool:
    """Whether traced code should route ``weight``'s gradient through ``tessera::weight_grad`` (which decides
    at run time); a constant of the trace, read from the weight's tag (no per-weight guard, no recompile)."""
    return COMPILED_FUSION and is_fusable(weight) and weight.requires_grad


def _weight_grad_op(weight: torch.Tensor, grad: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """``tessera::weight_grad``: ``grad^T @ input`` (the 2-D operands as the GEMM route prepared them) added into
    the parameter's main gradient when fusion applies now (the placeholder is returned), else returned in the
    weight's dtype, as the route's unfused weight-gradient GEMM computes it."""
    param = resolve(weight)
    main = fused_main_grad(param, grad.dtype)
    if main is not None:
        add_wgrad(main, param, grad, input)
        return placeholder(param).contiguous()
    return (grad.t() @ input).to(weight.dtype).contiguous()


def _weight_grad_shape(weight: torch.Tensor, grad: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(weight, memory_format=torch.contiguous_format)


compiled_weight_grad: Any = None  # the operator, where this torch can tag it (COMPILED_FUSION)
if COMPILED_FUSION:
    compiled_weight_grad = torch.library.custom_op("tessera::weight_grad", _weight_grad_op, mutates_args=(),
                                                   tags=(torch.Tag.cudagraph_unsafe,))
    compiled_weight_grad.register_fake(_weight_grad_shape)
