"""Stop signals on every rank (StopSignals), the one-line messages rank 0 prints (``say``) and
the process exit that skips interpreter finalization."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("launch")


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
ECHO_S = 2.0
"""Under torchrun a terminal's Ctrl-C reaches every rank twice: from the terminal and
forwarded by torchrun. A repeat within this many seconds of the first signal is that echo."""
START_GRACE_S = 5.0
"""A rank stopped while starting up exits (status ``StopSignals.status``) this long after the
signal even if its main thread is still blocked, e.g. in a store or collective wait for a rank
that has already left."""
STOP_GRACE_S = 15.0
"""A rank stopped while serving that is still running this long after the signal (a peer that
never got the coordinator's Shutdown, say) logs an error and exits with status 1."""


def say(text: str) -> None:
    """One ``helios: <text>`` line on stderr, in one write(2) call: safe in a signal handler,
    never interleaved with another line. On a terminal it first erases a progress line."""
    erase = "\r\033[K" if os.isatty(2) else ""
    try:
        os.write(2, f"{erase}helios: {text}\n".encode())
    except OSError:
        pass


def env_rank() -> int:
    """This process's rank as torchrun exports it (0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))


class Interrupted(BaseException):
    """A stop signal arrived while this rank was still starting up (see StopSignals)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP end this rank without a traceback; rank 0 announces the
    stop in one line, ``helios: shutting down (<reason>)``, and every other rank stays silent.

    Until ``serving()`` a signal raises Interrupted in the main thread, so a long load or
    start-up ends at once. From ``serving()`` on it only requests a stop: the ``on_stop``
    callbacks run (the coordinator's stops uvicorn, a peer's asks the coordinator to stop the
    job) and the process leaves through its normal cleanup. A repeat within ECHO_S of the
    first signal is ignored; a later one runs the ``on_force`` callbacks.

    Python runs signal handlers in the main thread only, and only between bytecodes: a main
    thread blocked in C++ (a store wait, a collective) would never see them. So the signals
    also go to a thread (``signal.set_wakeup_fd``) that requests the stop at once, and a
    deadline ends the process if its cleanup does not: START_GRACE_S after a signal during
    start-up (quietly, with ``status``), STOP_GRACE_S after one while serving (status 1).
    Handlers are installed even where SIGINT was ignored at start (a background job), as
    torchrun forwards SIGINT to its workers.
    """

    def __init__(self, rank: int, status: int = 0) -> None:
        self.rank = rank
        self.status = status
        self.reason: str | None = None
        self.signum: int | None = None
        self._raise = True
        self._raised = False
        self._at = 0.0
        self._lock = threading.RLock()  # re-entrant: the handler may interrupt its own thread
        self._on_stop: list[Callable[[], None]] = []
        self._on_force: list[Callable[[], None]] = []

    def install(self) -> StopSignals:
        """Install the handlers and the signal thread (from the main thread)."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        threading.Thread(target=self._watch, args=(read_fd,), name="stop-signals",
                         daemon=True).start()
        return self

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def serving(self) -> None:
        """From now on a signal requests a stop instead of raising Interrupted."""
        self._raise = False

    def on_stop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when a stop is requested (now, if it already was)."""
        with self._lock:
            self._on_stop.append(fn)
            now = self.requested
        if now:
            _call(fn)

    def on_force(self, fn: Callable[[], None]) -> None:
        self._on_force.append(fn)

    def request(self, reason: str, signum: int | None = None) -> bool:
        """Ask for a stop, from any thread; the first request wins and is the one announced.
        Returns whether this was the first."""
        with self._lock:
            if self.reason is not None:
                return False
            self.reason, self.signum, self._at = reason, signum, time.monotonic()
            callbacks = list(self._on_stop)
            starting = self._raise
        if self.rank == 0:
            say(f"shutting down ({reason})")
        grace = START_GRACE_S if starting else STOP_GRACE_S
        deadline = threading.Timer(grace, self._deadline, args=(grace, starting))
        deadline.daemon = True
        deadline.start()
        for fn in callbacks:
            _call(fn)
        return True

    def _handle(self, signum: int, frame: object) -> None:
        # The main thread, once it runs Python again; the signal thread has usually already
        # requested the stop (and counted any repeat).
        self.request(signal.Signals(signum).name, signum)
        if self._raise and not self._raised:
            self._raised = True
            raise Interrupted(signum)

    def _watch(self, fd: int) -> None:
        while True:
            for signum in os.read(fd, 64):  # one byte per signal that has a Python handler
                if signum not in STOP_SIGNALS:
                    continue
                first = self.request(signal.Signals(signum).name, signum)
                if not first and time.monotonic() - self._at > ECHO_S:
                    for fn in list(self._on_force):
                        _call(fn)

    def _deadline(self, grace: float, starting: bool) -> None:
        if starting:
            exit_process(self.status)
        log.error("rank %d: still running %.0f s after %s; exiting", self.rank, grace,
                  self.reason)
        exit_process(1)


def _call(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - a stop callback must not turn into a traceback
        log.warning("stop callback %r failed", fn, exc_info=True)


def exit_process(code: int) -> None:
    """End the process with ``code`` once our own cleanup is done.

    Interpreter finalization would then destroy the C++ side of the process group and the
    rank-0 TCPStore daemon in an unspecified order, which under load can abort the process
    ("terminate called without an active exception") after a clean shutdown. Everything
    this process owns is already flushed and closed, so it leaves without finalization.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
