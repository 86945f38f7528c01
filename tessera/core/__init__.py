"""What a run is, resolved once: the run description and everything that builds or reads it.

    job.py               Job: layout, process groups, tensor mode, device, seed and precision of a run
    layout.py            Layout: one rank's place in the TP x DP x ZeRO-1 grid; ParallelMode
    rendezvous.py        Rendezvous, LaunchError: meeting the other ranks, every failure one line
    launch.py            join_job: join a job, build its groups and Job, TP route, precision switches (no gpc)
    context.py           ParallelContext / gpc (InternEvo's getters, RNG streams) and the launchers that fill it:
                         launch, launch_from_torch, launch_from_slurm
    config.py            as_config: the config a launch takes (file, dict or Config), validated
    naive_amp.py         NaiveAMPModel (InternEvo's path), applying the precision plan's dtype and fp32 marks
    grad_scaler.py       InternEvo's path of the loss scalers (they live in tessera.precision.scaler)

The run's precision plan is its own package, ``tessera.precision``, below this one.

This package imports nothing of its own here: import the module you need.
"""
