"""Every measurement of tessera, outside the installed package: ``python -m benchmarks`` from the
repository root.

``benchmarks.harness`` is the one harness: interleaved rounds, paired ratios, the machine, the report
(JSON, markdown, a marked section of BENCHMARKS.md). ``benchmarks.cli`` maps each command to its module
(``python -m benchmarks --help`` lists them); each module measures one thing through the harness and
renders its section. Memory and communication are counted with the plan's own tracker and collective
counter (``tessera.plan.tracker``). Measurements that need several processes run in spawned workers
(``harness.distributed``), which import them by module path: spawned children start with the parent's
``sys.path``, where ``python -m`` put the repository root.
"""
