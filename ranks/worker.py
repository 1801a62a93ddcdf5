"""The peer loop: a rank > 0 runs every plan the coordinator sends, until told to stop."""

from __future__ import annotations

import logging

from helios_logprobs.collectives.control import PeerChannel, PeerError, Shutdown
from helios_logprobs.ranks.model.weight_transfer import (
    JoinWeightTransfer,
    ReceiveWeights,
    join_transfer,
    receive_update,
)
from helios_logprobs.ranks.model.weight_update import UpdateWeights, apply_update
from helios_logprobs.ranks.plan import StepPlan
from helios_logprobs.ranks.step import RankStep

log = logging.getLogger(__name__)
WEIGHT_MESSAGES = {UpdateWeights: apply_update, JoinWeightTransfer: join_transfer,
                   ReceiveWeights: receive_update}
"""Weight-sync messages: every rank runs the handler, and all agree on its outcome."""


def run_peer(step: RankStep, channel: PeerChannel, poll_s: float = 0.5) -> int:
    """Returns the process exit status: 0 after a Shutdown, raises on any failure."""
    while True:
        msg = channel.poll(poll_s)
        if msg is None:
            continue
        if isinstance(msg, Shutdown):
            log.info("rank %d: shutdown (%s)", channel.rank, msg.reason)
            return 0
        handler = WEIGHT_MESSAGES.get(type(msg))
        if handler is not None:  # (every rank agrees on the outcome: no reply)
            error = handler(step.model, msg)
            log.log(logging.WARNING if error else logging.INFO, "rank %d: %s: %s",
                    channel.rank, type(msg).__name__, error or "done")
            continue
        if not isinstance(msg, StepPlan):
            raise RuntimeError(f"rank {channel.rank}: unexpected control message {msg!r}")
        try:
            step.run(msg)
        except Exception as exc:
            channel.send(PeerError(channel.rank, f"{type(exc).__name__}: {exc}"))
            raise
