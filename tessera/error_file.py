"""The error file a rank writes under torchrun (``TORCHELASTIC_ERROR_FILE``), and how to tell tessera's from others.

torchrun's failure summary quotes each failed rank's error file, so train.py writes its report there in the
format torch's own ``ErrorHandler`` uses. A report that is one ``error: ...`` line is complete: the user needs
nothing more than that line, which the rank has already printed. Such a file carries ``REPORTED`` in its
``extraInfo``, which is how ``python -m tessera.run`` knows torchrun's own traceback would only repeat it. A
traceback tessera printed for an uncaught exception is not marked: that is a bug, and torchrun's full report
(every rank, exit codes, hosts) belongs with it. Stdlib only: train.py writes it, the wrapper reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

__all__ = ["REPORTED", "is_reported", "write_error_file"]

# extraInfo key, true when the file's message is the rank's whole report and the rank printed it on stderr
REPORTED = "tessera_reported"


def write_error_file(report: str, complete: bool) -> None:
    """Under torchrun, ``report`` as this rank's error file; its first line is what torchrun's summary shows.
    ``complete``: the report is one ``error:`` line, already printed (marked ``REPORTED``). No-op elsewhere."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    first = report.splitlines()[0] if report else report
    extra: dict[str, Any] = {"py_callstack": report, "timestamp": str(int(time.time()))}
    if complete:
        extra[REPORTED] = True
    with contextlib.suppress(OSError):  # a courtesy to torchrun's summary: the report is on stderr already
        with open(path, "w") as f:
            json.dump({"message": {"message": first, "extraInfo": extra}}, f)


def is_reported(error_file_data: Any) -> bool:
    """Whether a failed rank's error file (as torch read it: ``ProcessFailure.error_file_data``) is tessera's
    complete one-line report."""
    message = error_file_data.get("message") if isinstance(error_file_data, dict) else None
    extra = message.get("extraInfo") if isinstance(message, dict) else None
    return isinstance(extra, dict) and extra.get(REPORTED) is True
