"""Every measurement of tessera, outside the installed package: ``python -m benchmarks`` from the
repository root.

``benchmarks.cli`` holds the command line (``python -m benchmarks --help`` lists the measurements),
``benchmarks.runner`` the measurements of BENCHMARKS.md sections 1-6, ``benchmarks.report`` their
markdown, ``benchmarks.plain`` the plain-PyTorch reference step, ``benchmarks.dp`` section 7,
``benchmarks.precision_study`` section 8 and ``benchmarks.activations`` section 9's table. Memory and
communication are counted with the plan's own tracker and collective counter (``tessera.plan.tracker``).
The measurement functions run in spawned worker processes (``harness.distributed``), which import
them by module path: spawned children start with the parent's ``sys.path``, where ``python -m`` put
the repository root.
"""
