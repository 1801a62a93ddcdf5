"""The engine core's side of the weight-sync API (runtime/http/endpoints/weights.py): pause,
resume, is_paused and update_weights as operations on the engine, each answering an HTTP
status and a JSON body. The API server processes reach them over the frontend sockets
(runtime/frontend: ControlCall / ControlReply); an in-process engine is called directly.

An update runs on the step thread while the engine is paused: the new folder is checked
against the served one (names and shapes), every peer gets ``UpdateWeights`` on the control
plane (after every plan already sent, so in order), and every rank loads its shard and
commits only if all ranks staged theirs (ranks/model/weight_update.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from helios_logprobs.ranks.model.weight_update import (
    UpdateWeights,
    WeightUpdateError,
    apply_update,
    check_same_tensors,
)
from helios_logprobs.runtime.engine.pause import PAUSE_MODES

log = logging.getLogger("helios_logprobs.runtime.engine")

OPS = ("pause", "resume", "is_paused", "update_weights")
Answer = tuple[int, dict[str, Any]]


def error_answer(status: int, message: str, param: str | None = None) -> Answer:
    return status, {"error": message, "param": param}


class WeightControl:
    """One per engine (``for_engine``): serializes updates, counts them."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        """One update at a time."""

    @staticmethod
    def for_engine(engine) -> WeightControl:
        control = getattr(engine, "_weight_control", None)
        if control is None:
            control = engine._weight_control = WeightControl(engine)
        return control

    def handle(self, op: str, args: dict[str, Any]) -> Answer:
        """Blocking (a pause in mode "wait" waits for the requests in flight): run it on a
        thread of its own, never on the step thread."""
        engine = self.engine
        if op == "pause":
            mode = args.get("mode", "abort")
            if mode not in PAUSE_MODES:
                return error_answer(400, f"mode must be one of {', '.join(PAUSE_MODES)}, got "
                                         f"{mode!r}", "mode")
            if not engine.pause(mode):
                return error_answer(503, "the engine failed or stopped before the pause took "
                                         "effect")
            return 200, {"status": "paused"}
        if op == "resume":
            engine.resume()
            return 200, {"status": "resumed"}
        if op == "is_paused":
            return 200, {"is_paused": engine.is_paused()}
        if op == "update_weights":
            return self.update(args.get("model_path"))
        return error_answer(400, f"unknown control operation {op!r}")

    def update(self, model_path: Any) -> Answer:
        param = "update_info.model_path"
        if not isinstance(model_path, str) or not model_path:
            return error_answer(400, "update_info.model_path: a checkpoint folder (a string) "
                                     "is required", param)
        engine = self.engine
        if engine.model_dir is None:
            return error_answer(400, "this engine does not know its served checkpoint folder",
                                param)
        with self.lock:
            if not engine.is_paused():
                return error_answer(409, "pause generation first (POST /pause): weights are "
                                         "updated only while the engine is paused")
            try:
                check_same_tensors(engine.model_dir, model_path)
            except WeightUpdateError as exc:
                engine.weight_updates["failed"] += 1
                return error_answer(400, f"{exc}; the served weights are unchanged", param)
            number = engine.weight_updates["succeeded"] + engine.weight_updates["failed"] + 1
            start = time.monotonic()
            try:
                error = engine.run_paused(lambda: self._apply(model_path, number))
            except RuntimeError as exc:
                return error_answer(409, f"{exc}: pause generation first (POST /pause)")
            if error is not None:
                engine.weight_updates["failed"] += 1
                log.warning("weight update %d from %s failed: %s", number, model_path, error)
                return error_answer(500, f"the update failed ({error}); the served weights are "
                                         f"unchanged")
            engine.weight_updates["succeeded"] += 1
            elapsed = time.monotonic() - start
            log.info("weight update %d from %s in %.2f s", number, model_path, elapsed)
            return 200, {"message": "Weights updated", "model_path": model_path,
                         "weight_updates": engine.weight_updates["succeeded"],
                         "seconds": round(elapsed, 3)}

    def _apply(self, model_path: str, number: int) -> str | None:
        """On the step thread: every peer, then this rank."""
        update = UpdateWeights(model_path, number)
        self.engine.broadcast(update)
        return apply_update(self.engine.step.model, update)
