"""The engine core's side of the weight-sync API (runtime/http/endpoints/weights.py): pause,
resume, is_paused, init_weight_transfer and update_weights as operations on the engine, each
answering an HTTP status and a JSON body. The API server processes reach them over the
frontend sockets (runtime/frontend: ControlCall / ControlReply); an in-process engine is
called directly.

An update runs on the step thread while the engine is paused: the new folder is checked
against the served one (names and shapes), every peer gets ``UpdateWeights`` on the control
plane (after every plan already sent, so in order), and every rank loads its shard and
commits only if all ranks staged theirs (ranks/model/weight_update.py). From a trainer
(``update_info`` with vLLM's names, dtype_names and shapes) the same happens with the
tensors the trainer broadcasts to every rank over the group it opened
(ranks/model/weight_transfer.py), after the names and shapes were checked here; the group's
backend is NCCL when the ranks are on CUDA, else gloo (``init_info.backend`` may name it).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from helios_logprobs.collectives import weight_transfer
from helios_logprobs.collectives.groups import group_size
from helios_logprobs.ranks.model.weight_transfer import (
    DTYPES,
    JoinWeightTransfer,
    ReceiveWeights,
    join_transfer,
    receive_update,
)
from helios_logprobs.ranks.model.weight_update import (
    UpdateWeights,
    WeightUpdateError,
    apply_update,
    check_same_tensors,
    tensor_shapes,
)
from helios_logprobs.runtime.engine.pause import PAUSE_MODES

log = logging.getLogger("helios_logprobs.runtime.engine")

OPS = ("pause", "resume", "is_paused", "init_weight_transfer", "update_weights")
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
        if op == "init_weight_transfer":
            return self.init_transfer(args.get("init_info"))
        if op == "update_weights":
            info = args.get("update_info")
            if isinstance(info, dict) and "names" in info:
                return self.update_from_trainer(info)
            return self.update(info.get("model_path") if isinstance(info, dict) else None)
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
            number = sum(engine.weight_updates.values()) + 1
            return self._run(lambda: self._apply(model_path, number), model_path)

    def init_transfer(self, info: Any) -> Answer:
        """Join the trainer's group on every rank (blocks the steps until it is formed)."""
        engine = self.engine
        model = engine.step.model
        if not isinstance(info, dict):
            return error_answer(400, "init_info: an object with master_address, master_port, "
                                     "rank_offset and world_size is required", "init_info")
        backend = info.get("backend") or weight_transfer.backend_for(model.device)
        try:
            weight_transfer.check_backend(backend, model.device)
        except ValueError as exc:
            return error_answer(400, f"init_info.backend: {exc}", "init_info.backend")
        try:
            msg = JoinWeightTransfer(info.get("master_address"), info.get("master_port"),
                                     info.get("rank_offset", 1), info.get("world_size"),
                                     backend)
        except ValueError as exc:
            return error_answer(400, f"init_info: {exc}", "init_info")
        ranks = group_size(model.group)
        if msg.world_size != msg.rank_offset + ranks:
            return error_answer(400, f"init_info.world_size: this server has {ranks} rank(s): "
                                     f"world_size must be rank_offset + {ranks}",
                                "init_info.world_size")

        def join() -> str | None:
            engine.broadcast(msg)
            return join_transfer(model, msg)

        with self.lock:
            error = engine.run_between_steps(join)
        if error is not None:
            return error_answer(500, f"joining the weight transfer group failed: {error}")
        return 200, {"message": "Weight transfer initialized"}

    def update_from_trainer(self, info: dict[str, Any]) -> Answer:
        """vLLM's update_info (names, dtype_names, shapes): checked against the served
        checkpoint before any rank receives anything; then every tensor is broadcast by the
        trainer, in that order."""
        engine = self.engine
        try:
            msg = self._receive_message(info)
        except WeightUpdateError as exc:
            engine.weight_updates["failed"] += 1
            return error_answer(400, f"{exc}; the served weights are unchanged",
                                exc.tensor or "update_info")
        with self.lock:
            if not engine.is_paused():
                return error_answer(409, "pause generation first (POST /pause): weights are "
                                         "updated only while the engine is paused")
            if getattr(engine.step.model, "weight_transfer", None) is None:
                return error_answer(409, "no weight transfer group: POST "
                                         "/init_weight_transfer_engine first")
            return self._run(lambda: self._receive(msg), "the trainer")

    def _receive_message(self, info: dict[str, Any]) -> ReceiveWeights:
        if self.engine.model_dir is None:
            raise WeightUpdateError("this engine does not know its served checkpoint folder")
        names, dtypes, shapes = (info.get(key) for key in ("names", "dtype_names", "shapes"))
        if info.get("packed"):
            raise WeightUpdateError("packed transfers are not supported", "update_info.packed")
        for key, value in (("names", names), ("dtype_names", dtypes), ("shapes", shapes)):
            if not isinstance(value, list) or len(value) != len(names or ()):
                raise WeightUpdateError(f"update_info.{key}: a list as long as names is "
                                        f"required", f"update_info.{key}")
        served = tensor_shapes(self.engine.model_dir)
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            if name not in served:
                raise WeightUpdateError(f"tensor {name!r} is not a tensor of the served "
                                        f"checkpoint", "update_info.names")
            if not isinstance(shape, list) or tuple(shape) != served[name]:
                raise WeightUpdateError(f"tensor {name!r} has shape {shape}, the served one "
                                        f"{list(served[name])}", "update_info.shapes")
            if dtype not in DTYPES:
                raise WeightUpdateError(f"tensor {name!r}: dtype {dtype!r} is not one of "
                                        f"{sorted(DTYPES)}", "update_info.dtype_names")
        missing = sorted(served.keys() - set(names))
        if missing or len(set(names)) != len(names):
            what = f"tensor {missing[0]!r} is missing" if missing else "a name repeats"
            raise WeightUpdateError(f"update_info.names: {what} (every tensor of the served "
                                    f"checkpoint, once each)", "update_info.names")
        number = sum(self.engine.weight_updates.values()) + 1
        return ReceiveWeights(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes),
                              number)

    def _receive(self, msg: ReceiveWeights) -> str | None:
        self.engine.broadcast(msg)
        return receive_update(self.engine.step.model, msg)

    def _run(self, fn, source: str) -> Answer:
        """``fn`` on the paused step thread, counted."""
        engine = self.engine
        start = time.monotonic()
        try:
            error = engine.run_paused(fn)
        except RuntimeError as exc:
            return error_answer(409, f"{exc}: pause generation first (POST /pause)")
        if error is not None:
            engine.weight_updates["failed"] += 1
            log.warning("weight update from %s failed: %s", source, error)
            return error_answer(500, f"the update failed ({error}); the served weights are "
                                     f"unchanged")
        engine.weight_updates["succeeded"] += 1
        elapsed = time.monotonic() - start
        log.info("weight update from %s in %.2f s", source, elapsed)
        return 200, {"message": "Weights updated", "source": source,
                     "weight_updates": engine.weight_updates["succeeded"],
                     "seconds": round(elapsed, 3)}

    def _apply(self, model_path: str, number: int) -> str | None:
        """On the step thread: every peer, then this rank."""
        update = UpdateWeights(model_path, number)
        self.engine.broadcast(update)
        return apply_update(self.engine.step.model, update)
