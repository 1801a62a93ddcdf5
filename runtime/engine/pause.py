"""Pausing the engine for a weight update (vLLM's pause_generation semantics).

``mode`` says what happens to the requests in flight when the pause is asked for (those
already submitted: ordinal <= ``upto``):

* ``abort``: each ends at once with finish reason "abort" (vLLM's default);
* ``wait``: they run to their end; the pause takes effect when none is left;
* ``keep``: they stay where they are (slots and KV cache kept) and go on after the resume.

Requests submitted after the pause wait, unscheduled, until the resume (vLLM blocks new
requests while paused). While paused the step thread runs only the calls handed to it
(``PausedCall``: a weight update), so nothing else touches the model meanwhile. Every method
runs under the engine's lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

PAUSE_MODES = ("abort", "wait", "keep")


@dataclass(frozen=True)
class PausedCall:
    """``fn()`` to run on the step thread between steps; its result or error goes to
    ``future``. ``needs_pause``: only while paused (a resume first fails it)."""

    fn: Callable[[], Any]
    needs_pause: bool = True
    future: Future = field(default_factory=Future)


class PauseState:
    def __init__(self) -> None:
        self.mode: str | None = None
        """None: serving."""
        self.upto = 0
        """The last ordinal submitted before the pause (the requests in flight)."""
        self.paused = False
        """The pause took effect (in-flight requests aborted, finished or frozen)."""
        self.calls: deque[PausedCall] = deque()

    @property
    def active(self) -> bool:
        """A pause was asked for and no resume since (vLLM's is_paused)."""
        return self.mode is not None

    def request(self, mode: str, last_ordinal: int) -> None:
        """Ask for a pause; a second request while one is active changes nothing."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if self.mode is None:
            self.mode, self.upto, self.paused = mode, last_ordinal, False

    def resume(self) -> list[PausedCall]:
        """Serve again; returns the calls that needed the pause and never ran (the caller
        fails them)."""
        self.mode, self.paused = None, False
        left = [call for call in self.calls if call.needs_pause]
        self.calls = deque(call for call in self.calls if not call.needs_pause)
        return left

    def admissible(self, ordinal: int) -> bool:
        """Whether a submitted request may enter the scheduler now."""
        return self.mode is None or (not self.paused and ordinal <= self.upto)

    def settling(self) -> bool:
        """A pause was asked for and has not taken effect yet."""
        return self.mode is not None and not self.paused

    def runnable_calls(self) -> bool:
        return any(self.paused or not call.needs_pause for call in self.calls)

    def take_calls(self) -> list[PausedCall]:
        """The calls that may run now (the others stay queued)."""
        calls = [call for call in self.calls if self.paused or not call.needs_pause]
        self.calls = deque(call for call in self.calls if call not in calls)
        return calls
