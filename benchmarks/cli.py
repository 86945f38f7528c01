"""``python -m benchmarks [flags]`` (sections 1-2) and ``python -m benchmarks <name> [flags]`` (the others).

Each benchmark is a module with a ``main(argv, prog)``; every one writes its own marked section of
BENCHMARKS.md through ``benchmarks.harness``. ``--section dp`` is kept as another name of ``dp``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# name -> (module, what it measures); the module is imported only when its command runs
COMMANDS = {
    "dp": ("benchmarks.dp", "section 7: DP=2 bytes per collective vs the closed form, overlap with backward"),
    "precision-study": ("benchmarks.precision_study", "section 8: the demo trained under each precision policy"),
    "activations": ("benchmarks.activations", "section 9: activation peak and step time per TP rank, mtp vs msp"),
    "roofline": ("benchmarks.roofline", "sections 10 and 13 (--policies): a step split into GEMMs, attention, "
                                      "optimizer, collectives, rest"),
    "compile": ("benchmarks.compile_step", "section 11: training step with compiled blocks vs eager"),
    "precision-telemetry": ("benchmarks.precision_overhead",
                            "section 14: the demo with metrics.precision_every 0 vs N, paired rounds"),
    "tensor-modes": ("benchmarks.tensor_modes", "section 15: the demo's step in mtp and msp against a base checkout"),
    "attention-kernels": ("benchmarks.attention_kernels", "section 16: CPU attention kernels per shape and dtype"),
    "gpu-peers": ("benchmarks.gpu_peers", "section 17: tessera against HF LlamaForCausalLM at the same dims, eager "
                                          "and compiled"),
    "emulation": ("benchmarks.emulation", "section 19: the emulated low-precision GEMMs per linear and per step, "
                                          "block quantizers eager vs compiled"),
    "text-data": ("benchmarks.text_data", "section 20: the demo on raw text (data.type='text') against its prepared "
                                          "folder, paired rounds"),
}


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--section" in argv:  # the old spelling of ``dp``
        i = argv.index("--section")
        if argv[i + 1:i + 2] == ["dp"]:
            argv = ["dp", *argv[:i], *argv[i + 2:]]
    if argv and argv[0] in COMMANDS:
        return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:], prog=f"{prog} {argv[0]}")
    from benchmarks import overhead

    epilog = "other benchmarks (each with its own --help):\n" + "\n".join(
        f"  {prog} {name:<20} {what}" for name, (_, what) in COMMANDS.items())
    return overhead.main(argv, prog, epilog)
