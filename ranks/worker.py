"""The peer loop: a rank > 0 runs every plan the coordinator sends, until told to stop."""

from __future__ import annotations

import logging

from helios_logprobs.collectives.control import PeerChannel, PeerError, Shutdown
from helios_logprobs.ranks.plan import StepPlan
from helios_logprobs.ranks.step import RankStep

log = logging.getLogger(__name__)


def run_peer(step: RankStep, channel: PeerChannel, poll_s: float = 0.5) -> int:
    """Returns the process exit status: 0 after a Shutdown, raises on any failure."""
    while True:
        msg = channel.poll(poll_s)
        if msg is None:
            continue
        if isinstance(msg, Shutdown):
            log.info("rank %d: shutdown (%s)", channel.rank, msg.reason)
            return 0
        if not isinstance(msg, StepPlan):
            raise RuntimeError(f"rank {channel.rank}: unexpected control message {msg!r}")
        try:
            step.run(msg)
        except Exception as exc:
            channel.send(PeerError(channel.rank, f"{type(exc).__name__}: {exc}"))
            raise
