"""Find the autograd.Function forwards that, as Dynamo traces them, return a tensor sharing storage with another
tensor they made: what torch 2.11 gets wrong.

Dynamo traces a Function's forward as a subgraph and, besides its outputs, returns the tensors it made on
the way (the intermediates). Where an output is the same tensor as one of them -- written in place
(``y.mul_(w)`` then ``y``), filled by an ``out=`` op or a collective, or handed back by a no-op ``.to`` --
torch 2.11 attaches the output's gradient edge to the intermediate's slot, and the gradients of the
Function's inputs come back zero (pytorch/pytorch#180642; torch 2.12 filters such intermediates out). The
torch CI runs (2.13) computes the right gradients either way, so a compiled-vs-eager comparison there cannot
see the defect; this recorder sees its cause: it wraps Dynamo's collection of a forward's intermediates and
records every intermediate whose storage is an output's.

The hooks are Dynamo internals of the torch CI pins (``collect_intermediate_outputs`` and the two functions
around it); ``installed()`` says whether this torch has them. torch 2.11 lacks them; there the defect itself
shows, and ``tests/test_compile.py``'s comparisons of compiled and eager gradients fail on it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

_FORWARD = "autograd.Function"  # the description Dynamo gives a Function's forward subgraph
_HOOKS = ("speculate_subgraph_with_auto_output_flattening", "trace_hop_function_with_auto_output_flattening",
          "collect_intermediate_outputs")


@dataclass
class Finding:
    where: str  # the user code that called the Function (file:line in function)
    intermediate: str  # the FX node of the intermediate that is an output


@dataclass
class _Forward:
    where: str  # the caller, for the message
    filters: bool  # this torch filters aliased intermediates (2.12+), and collects them only on side effects
    traced: bool = False  # its body was traced (the subtracer's flag is set once, right after)
    own: bool = False  # the subtracer's side-effect flag as the body left it


@dataclass
class Recorder:
    findings: list[Finding] = field(default_factory=list)
    forwards: int = 0  # Function forwards traced
    _stack: list[_Forward] = field(default_factory=list)


def installed() -> bool:
    hops = _hops()
    if hops is None or not all(hasattr(hops, name) for name in _HOOKS):
        return False
    from torch._dynamo.output_graph import SubgraphTracer  # the intermediates it tracks (2.11 keeps none)

    return "tracked_proxyable_vt" in inspect.getsource(SubgraphTracer.__init__)


def _hops() -> Any:
    try:
        import torch._dynamo.variables.higher_order_ops as hops
    except ImportError:
        return None
    return hops


def _tensor(vt: Any) -> int | None:
    """The identity of the (fake) tensor a variable stands for: the same for an in-place op's result and its
    operand, an ``out=`` op's result and ``out``, and a no-op ``.to``; a view is a tensor of its own."""
    try:
        value = vt.as_proxy().node.meta.get("example_value")
    except Exception:  # noqa: BLE001 - a variable without a proxy (a constant, a symbolic int) is no tensor
        return None
    return id(value) if isinstance(value, torch.Tensor) else None


def _caller(tx: Any) -> str:
    try:
        frame = tx.frame_summary()
        return f"{frame.filename}:{frame.lineno} in {frame.name}"
    except Exception:  # noqa: BLE001 - only for the message
        return "?"


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """Record, while inside, every Function forward that Dynamo traces with an output aliasing an intermediate."""
    hops = _hops()
    assert installed(), "this torch's Dynamo lacks the hooks (see the module docstring)"
    recorder = Recorder()
    speculate, trace, collect = (getattr(hops, name) for name in _HOOKS)

    def speculate_spy(tx: Any, f: Any, sub_args: Any, sub_kwargs: Any, description: str, **kw: Any) -> Any:
        if not (description == _FORWARD and kw.get("allow_side_effects", False)):  # not a Function's forward
            return speculate(tx, f, sub_args, sub_kwargs, description, **kw)
        recorder.forwards += 1
        recorder._stack.append(_Forward(_caller(tx), "filter_aliased_intermediates" in kw))
        try:
            return speculate(tx, f, sub_args, sub_kwargs, description, **kw)
        finally:
            recorder._stack.pop()

    def trace_spy(*args: Any, **kw: Any) -> Any:
        out = trace(*args, **kw)
        if recorder._stack and not recorder._stack[-1].traced:
            # a Function's forward was traced: make Dynamo collect its intermediates, as torch 2.11 always does
            # (2.13 only where the body has side effects); collect_spy hands back none that this torch would not
            top, tracer = recorder._stack[-1], args[1].output.current_tracer
            top.traced, top.own = True, tracer.traced_with_externally_visible_side_effects
            tracer.traced_with_externally_visible_side_effects = True
        return out

    def collect_spy(tx: Any, subtracer: Any, graph_output_vts: list[Any], *args: Any, **kw: Any) -> Any:
        if not recorder._stack or not recorder._stack[-1].traced:
            return collect(tx, subtracer, graph_output_vts, *args, **kw)
        top = recorder._stack[-1]
        outputs = {t for t in map(_tensor, graph_output_vts) if t is not None}
        output_proxies = {vt.as_proxy() for vt in graph_output_vts}
        for vt in subtracer.tracked_proxyable_vt:
            try:
                proxy = vt.as_proxy()
            except Exception:  # noqa: BLE001 - not a tensor variable
                continue
            if proxy not in output_proxies and _tensor(vt) in outputs:
                recorder.findings.append(Finding(top.where, proxy.node.format_node()))
        if not top.filters or subtracer.side_effect_stack is not None or top.own:  # what this torch does unobserved
            return collect(tx, subtracer, graph_output_vts, *args, **kw)
        return []

    for name, spy in zip(_HOOKS, (speculate_spy, trace_spy, collect_spy)):
        setattr(hops, name, spy)
    try:
        yield recorder
    finally:
        for name, original in zip(_HOOKS, (speculate, trace, collect)):
            setattr(hops, name, original)
