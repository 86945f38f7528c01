"""``python -m tessera.run [torchrun arguments] train.py ...``: torchrun whose failure ends with tessera's line.

When train.py fails cleanly under torchrun, every rank prints one ``error: ...`` line and exits 1, and then
torchrun prints some 30 lines of its own: two log lines and its ``ChildFailedError`` traceback. torchrun has no
quiet flag, so this runs torchrun in this process (``torch.distributed.run.main``, taking exactly its arguments)
and decides once it knows how the workers ended:

- the first failure is one tessera reported in full (its error file is marked ``tessera.error_file.REPORTED``)
  and every other failed rank either reported too or was stopped by torchrun's SIGTERM: torchrun's log lines and
  traceback are left out, one line says which rank failed first, and the exit code is that rank's;
- anything else (an uncaught exception, a segfault, an OOM kill, a worker that is not train.py): torchrun's
  full report, unchanged, and its exit code.

Success, SIGINT/SIGTERM (torchrun's ``SignalException``) and bad torchrun arguments are torchrun's own too.
The warnings and errors torchrun logs about its workers' ends are held back while it runs, so that they can be
left out at the end; each is let out before any later record and when torchrun restarts the workers
(``--max-restarts``), so nothing is reordered and an earlier attempt's failure always shows.
"""

from __future__ import annotations

import functools
import logging
import signal
import sys
from collections.abc import Callable, Mapping
from typing import Any

from tessera.error_file import is_reported

__all__ = ["main", "reported_failure"]

# the layer that starts, stops and reads the workers: how they ended ("failed (exitcode: 1)", "Sending process N
# closing signal SIGTERM", "no error file defined for parent"), all of which torchrun's report repeats
WORKERS_LOGGER = "torch.distributed.elastic.multiprocessing"
# the agent: "Worker group FAILED. 1/3 attempts left; will restart worker group" (info) ends an attempt
AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"
NAME = "tessera-run"


def reported_failure(failures: Mapping[int, Any]) -> tuple[int, int] | None:
    """``(rank, exit code)`` of the first failure when the failed ranks need no more than what tessera printed
    (see the module docstring), else None. ``failures``: ``ChildFailedError.failures`` (rank -> ProcessFailure)."""
    if not failures:
        return None
    rank = min(failures, key=lambda r: failures[r].timestamp)  # torchrun's "Root Cause", ties included
    first = failures[rank]
    if not is_reported(first.error_file_data):
        return None
    stopped = -signal.SIGTERM  # how a rank ends that torchrun stopped once another had failed
    if not all(is_reported(f.error_file_data) or f.exitcode == stopped for f in failures.values()):
        return None
    return rank, first.exitcode if first.exitcode > 0 else 1


class _HeldRecords:
    """Gates on the handlers of torchrun's loggers: hold back the workers layer's warnings and errors until a
    later record passes or an attempt ends in a restart (then let them out first, in order), or until ``release``
    / ``drop`` at the end. The agent's info records, which torchrun does not show by default, are asked for only
    to see where an attempt ends; the gates keep out those torchrun would not have shown."""

    def __init__(self) -> None:
        self.held: list[tuple[logging.Handler, logging.LogRecord]] = []
        self.gates: list[tuple[logging.Handler, Callable[[logging.LogRecord], bool]]] = []
        self.letting_out = False
        self.agent = logging.getLogger(AGENT_LOGGER)
        self.agent_level = self.agent.level
        self.agent_shows = self.agent.getEffectiveLevel()  # what torchrun shows of the agent

    def install(self) -> None:
        """A gate on each handler a torchrun record reaches (none when logging is not set up: nothing to hold)."""
        logger: logging.Logger | None = logging.getLogger(WORKERS_LOGGER)
        while logger is not None:
            for handler in logger.handlers:
                gate = functools.partial(self._gate, handler)
                handler.addFilter(gate)
                self.gates.append((handler, gate))
            logger = logger.parent if logger.propagate else None
        if self.gates and self.agent_shows > logging.INFO:
            self.agent.setLevel(logging.INFO)

    def uninstall(self) -> None:
        for handler, gate in self.gates:
            handler.removeFilter(gate)
        self.agent.setLevel(self.agent_level)

    def _gate(self, handler: logging.Handler, record: logging.LogRecord) -> bool:
        if self.letting_out:
            return True
        if record.name.startswith(WORKERS_LOGGER) and record.levelno >= logging.WARNING:
            self.held.append((handler, record))
            return False
        self.release()
        return not (record.name == AGENT_LOGGER and record.levelno < self.agent_shows)

    def release(self) -> None:
        held, self.held = self.held, []
        self.letting_out = True
        try:
            for handler, record in held:
                handler.handle(record)
        finally:
            self.letting_out = False

    def drop(self) -> None:
        self.held = []


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default: this command line); 0 on success, the failed rank's exit code when
    tessera reported the failure. Any other failure raises torchrun's exception, as ``torchrun`` does."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    held = _HeldRecords()
    held.install()
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except ChildFailedError as e:
        found = reported_failure(e.failures)
        if found is None:
            held.release()
            raise
        held.drop()
        rank, code = found
        print(f"{NAME}: rank {rank} failed first (exit code {code}); its error is above", file=sys.stderr, flush=True)
        return code
    except BaseException:
        held.release()
        raise
    finally:
        held.uninstall()
    held.release()
    return 0


def cli() -> None:
    """The ``tessera-run`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
