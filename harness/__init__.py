"""What tests and benchmarks run tessera in; not part of the installed package (setup.py installs
``tessera`` only).

    distributed.py     ``run_distributed``: a function on N spawned CPU processes (gloo), bounded by a
                       timeout, the failing rank's traceback raised; ``run_torchrun``; ``free_port``;
                       ``fake_process_group``: this process as rank 0 of a job on torch's fake backend
    failure.py         ``explain``, ``first_error``: what a test prints when a subprocess failed (its
                       first error, not its last warnings)
    fake_cuda.py       ``fake_cuda_mode``: CUDA tensors without a GPU (the NCCL-rule tests)
    mutation.py        ``python -m harness.mutation``: the mutation pass, run before a release (not in CI)
    mutants.py         its list: one broken promise each, the fast tests that must notice, equivalent mutants
    peak_rss.py        ``run_measured``: one script's peak resident memory, in a fresh process of its own
    state.py           ``HeldState``: a resumable component holding any state tree (checkpoint tests)
    tools.py           ``run_tool``: a tool of ``tools/`` run in this process, its stdout
    traced_aliases.py  ``recording``, ``installed``: the autograd.Function forwards whose traced outputs
                       share storage with an intermediate (what torch 2.11 gets wrong)

Importable wherever the repository root is on ``sys.path``: under pytest (``pythonpath = .`` in
pytest.ini) and under ``python -m benchmarks`` started from the root. Spawned workers inherit the
parent's ``sys.path``, so they import it too.
"""
