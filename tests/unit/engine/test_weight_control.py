"""Pause, resume and weight updates on an in-process TP1 engine (the core's side of the
weight-sync routes): after an update from folder B the serving tensors equal, bit for bit,
those of a model loaded from B, and greedy tokens and logprobs equal a fresh engine's on B;
a refused update changes no tensor; requests sent while paused wait for the resume."""

from __future__ import annotations

import threading

import pytest
import torch

from helios_logprobs.ranks.model import ShardedCausalLM
from helios_logprobs.ranks.model.weight_update import WeightUpdateError, check_same_tensors
from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.engine.config import RuntimeConfig
from helios_logprobs.runtime.engine.pause import PauseState
from helios_logprobs.runtime.engine.weight_update import WeightControl
from tests.checkpoints import write_llama
from tests.server.rl.checkpoints import narrow_down_proj, rename_norm, reweighted

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    a = write_llama(root / "a")
    return {"a": a, "b": reweighted(a, root / "b", 2),
            "renamed": reweighted(a, root / "renamed", 3, rename_norm),
            "narrowed": reweighted(a, root / "narrowed", 4, narrow_down_proj)}


def start(folder):
    config = RuntimeConfig(model_dir=folder, capacity=2, max_model_len=64)
    return build_engine(config, load_rank(config, None)).start()


def tensors(model) -> list[torch.Tensor]:
    w = model.weights
    out = [w.embed, w.final_norm, w.lm_head]
    for layer in w.layers:
        out += [t for t in vars(layer).values() if t is not None]
    return out


def run(engine):
    tokens, _ = engine.generate_sync(PROMPT, GREEDY)
    return [(t.token_id, t.logprob, tuple(t.alternatives)) for t in tokens]


def test_header_check_names_the_tensor(folders):
    check_same_tensors(folders["a"], folders["b"])
    for name, tensor in (("renamed", "model.norm.weight"),
                         ("narrowed", "model.layers.1.mlp.down_proj.weight")):
        with pytest.raises(WeightUpdateError, match=tensor.replace(".", r"\.")):
            check_same_tensors(folders["a"], folders[name])


def test_update_equals_a_fresh_engine_and_refusals_change_nothing(folders):
    engine, fresh = start(folders["a"]), start(folders["b"])
    try:
        control = WeightControl.for_engine(engine)
        before = run(engine)
        status, _ = control.handle("update_weights", {"update_info": {
            "model_path": str(folders["b"])}})
        assert status == 409  # not paused
        assert control.handle("pause", {"mode": "abort"}) == (200, {"status": "paused"})
        kept = [t.clone() for t in tensors(engine.step.model)]
        for name in ("renamed", "narrowed"):
            status, body = control.handle("update_weights", {"update_info": {
                "model_path": str(folders[name])}})
            assert status == 400 and body["param"] == "update_info.model_path"
        assert all(torch.equal(x, y) for x, y in zip(kept, tensors(engine.step.model),
                                                     strict=True))
        status, body = control.handle("update_weights", {"update_info": {
            "model_path": str(folders["b"])}})
        assert status == 200, body
        loaded = ShardedCausalLM.load(folders["b"])
        assert all(torch.equal(x, y) for x, y in zip(tensors(loaded),
                                                     tensors(engine.step.model), strict=True))
        assert control.handle("resume", {}) == (200, {"status": "resumed"})
        assert run(engine) == run(fresh) != before
        assert engine.weight_updates == {"succeeded": 1, "failed": 2}
    finally:
        engine.shutdown()
        fresh.shutdown()


def test_requests_sent_while_paused_wait_for_the_resume(folders):
    engine = start(folders["a"])
    try:
        reference = run(engine)
        assert engine.pause("keep")
        got: list = []
        waiting = threading.Thread(target=lambda: got.append(run(engine)))
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive() and engine.is_paused()
        engine.resume()
        waiting.join(60)
        assert got == [reference] and not engine.is_paused()
    finally:
        engine.shutdown()


def test_pause_state():
    state = PauseState()
    assert not state.active and state.admissible(99)
    with pytest.raises(ValueError, match="mode"):
        state.request("later", 0)
    state.request("wait", 3)
    assert state.active and state.settling()
    assert state.admissible(3) and not state.admissible(4)
    state.request("abort", 9)  # (a second request changes nothing)
    assert (state.mode, state.upto) == ("wait", 3)
    state.paused = True
    assert not state.admissible(3)
    state.resume()
    assert not state.active and state.admissible(4)
