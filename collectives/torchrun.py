"""torchrun's main, run in the calling process (for the `helios-serve` wrapper): the only
place outside the process-group code that touches torch.distributed's launcher."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class TorchrunEnd:
    signal: int | None = None
    """The stop signal torchrun forwarded to its workers (then waited for them)."""
    failure: str | None = None
    """torchrun's summary of a worker that failed."""
    exit_code: int | None = None
    """The exit status of the first worker that failed."""


def run_torchrun(args: list[str]) -> TorchrunEnd:
    """torchrun's main with ``args``; how it ended. Its elastic loggers stay at ERROR
    unless LOGLEVEL says otherwise."""
    if "LOGLEVEL" not in os.environ:
        os.environ["LOGLEVEL"] = "ERROR"
        logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    if os.environ["LOGLEVEL"] == "ERROR":
        # its "failed (exitcode: N)" line too: the caller reports a failure (TorchrunEnd)
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(
            logging.CRITICAL)

    try:
        torchrun(args)
    except SignalException as exc:
        return TorchrunEnd(signal=int(exc.sigval))
    except ChildFailedError as exc:
        _, first = exc.get_first_failure()
        return TorchrunEnd(failure=exc.format_msg(), exit_code=first.exitcode)
    return TorchrunEnd()
