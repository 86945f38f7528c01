"""What tests and benchmarks run tessera in; not part of the installed package (setup.py installs
``tessera`` only).

    distributed.py  ``run_distributed``: a function on N spawned CPU processes (gloo), bounded by a
                    timeout, the failing rank's traceback raised; ``run_torchrun``; ``free_port``
    fake_cuda.py    ``fake_cuda_mode``: CUDA tensors without a GPU (the NCCL-rule tests)
    mutation.py     ``python -m harness.mutation``: the mutation pass, run before a release (not in CI)
    mutants.py      its list: one broken promise each, the fast tests that must notice, equivalent mutants
    state.py        ``HeldState``: a resumable component holding any state tree (checkpoint tests)
    tools.py        ``run_tool``: a tool of ``tools/`` run in this process, its stdout

Importable wherever the repository root is on ``sys.path``: under pytest (``pythonpath = .`` in
pytest.ini) and under ``python -m benchmarks`` started from the root. Spawned workers inherit the
parent's ``sys.path``, so they import it too.
"""
