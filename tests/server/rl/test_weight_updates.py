"""vLLM's weight-sync routes: pause, update from a checkpoint folder, resume. After an
update from folder B a server started on A answers, bit for bit, as a fresh server started on
B (greedy ids and logprobs, TP1 and TP2), whether B comes as a folder or is broadcast by a
trainer process over the group the server joins for it; a folder (or an update_info) whose
tensor names or shapes differ from the served checkpoint's is refused naming the tensor, and
the old weights keep serving; /metrics counts updates and failures."""

from __future__ import annotations

import re
import threading

import httpx
import pytest
from safetensors.torch import load_file

from helios_logprobs.collectives import weight_transfer
from tests.server.helpers import free_port, post, strict_json

pytestmark = pytest.mark.slow

PROMPTS = ([5, 77, 130, 42, 9], [200, 3, 3, 17, 64, 101, 7, 280])
PAIRS = {1: ("rl_a1", "rl_b1"), 2: ("rl_a2", "rl_b2")}


@pytest.fixture(scope="module", autouse=True)
def _start_together(rl_servers):
    rl_servers.start("a1", "b1", "a2", "b2")


def outputs(server) -> list[tuple[list[int], list]]:
    """Greedy ids and their logprob entries for each prompt (exact JSON values)."""
    out = []
    for prompt in PROMPTS:
        body = {"token_ids": prompt, "sampling_params": {
            "temperature": 0.0, "max_tokens": 16, "logprobs": 3, "ignore_eos": True}}
        response = post(server, "/inference/v1/generate", body)
        assert response.status_code == 200, response.text
        choice = strict_json(response.content)["choices"][0]
        out.append((choice["token_ids"], choice["logprobs"]["content"]))
    return out


def pause(server, **query) -> httpx.Response:
    return httpx.post(server.url + "/pause", params=query, timeout=120.0)


def resume(server) -> httpx.Response:
    return httpx.post(server.url + "/resume", timeout=120.0)


def is_paused(server) -> bool:
    response = httpx.get(server.url + "/is_paused", timeout=30.0)
    assert response.status_code == 200, response.text
    return response.json()["is_paused"]


def update(server, folder) -> httpx.Response:
    return post(server, "/update_weights", {"update_info": {"model_path": str(folder)}})


def counter(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30.0).text
    match = re.search(rf"^helios:{name}_total (\S+)$", text, re.MULTILINE)
    assert match, text[:2000]
    return float(match.group(1))


def paused_update(server, folder) -> httpx.Response:
    assert pause(server).json() == {"status": "paused"}
    assert is_paused(server)
    try:
        return update(server, folder)
    finally:
        assert resume(server).json() == {"status": "resumed"}
        assert not is_paused(server)


@pytest.mark.parametrize("tp", [1, 2])
def test_update_from_a_folder_equals_a_fresh_server(request, rl_models, tp):
    served, fresh = (request.getfixturevalue(name) for name in PAIRS[tp])
    before, on_b = outputs(served), outputs(fresh)
    assert before != on_b  # (the checkpoints differ where it shows)
    updates = counter(served, "rl_weight_update")
    refused = update(served, rl_models["b"])  # not paused
    assert refused.status_code == 409, refused.text
    response = paused_update(served, rl_models["b"])
    assert response.status_code == 200, response.text
    assert outputs(served) == on_b  # bit for bit
    assert counter(served, "rl_weight_update") == updates + 1
    assert paused_update(served, rl_models["a"]).status_code == 200
    assert outputs(served) == before


@pytest.mark.parametrize("tp", [1, 2])
def test_mismatched_tensors_are_refused_and_the_old_weights_serve(request, rl_models, tmp_path,
                                                                  tp):
    served = request.getfixturevalue(PAIRS[tp][0])
    before = outputs(served)
    failures = counter(served, "rl_weight_update_failures")
    cases = [(rl_models["renamed"], "model.norm.weight"),
             (rl_models["narrowed"], "model.layers.1.mlp.down_proj.weight"),
             (tmp_path / "absent", "absent")]
    assert pause(served).status_code == 200
    try:
        for folder, named in cases:
            response = update(served, folder)
            assert response.status_code == 400, response.text
            error = strict_json(response.content)["error"]
            assert error["param"] == "update_info.model_path"
            assert named in error["message"], error
    finally:
        resume(served)
    assert outputs(served) == before
    assert counter(served, "rl_weight_update_failures") == failures + len(cases)


def _trainer_group(server, port: int, world: int):
    """The trainer's end of the group (this process), joined by the server's ranks."""
    joined: dict = {}
    opening = threading.Thread(target=lambda: joined.update(
        group=weight_transfer.trainer_init("127.0.0.1", port, world, timeout_s=120)))
    opening.start()
    response = post(server, "/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
        "world_size": world}})
    opening.join(120)
    assert response.status_code == 200, response.text
    assert response.json() == {"message": "Weight transfer initialized"}
    return joined["group"]


def broadcast_update(server, group, tensors: dict, info: dict) -> None:
    """POST /update_weights with ``info`` while this process, the trainer, broadcasts the
    tensors in its order; the update answers 200."""
    answers: list[httpx.Response] = []
    updating = threading.Thread(target=lambda: answers.append(
        post(server, "/update_weights", {"update_info": info})))
    updating.start()
    weight_transfer.trainer_send_weights(group, ((name, tensors[name]) for name in info["names"]))
    updating.join(120)
    assert answers and answers[0].status_code == 200, answers


@pytest.mark.parametrize("tp", [1, 2])
def test_update_broadcast_by_a_trainer_equals_a_fresh_server(request, rl_models, tp):
    served, fresh = (request.getfixturevalue(name) for name in PAIRS[tp])
    before, on_b = outputs(served), outputs(fresh)
    refused = post(served, "/init_weight_transfer_engine", {"init_info": {  # (CPU ranks)
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
        "world_size": 1 + tp, "backend": "nccl"}})
    assert refused.status_code == 400, refused.text
    assert strict_json(refused.content)["error"]["param"] == "init_info.backend"
    group = _trainer_group(served, free_port(), 1 + tp)
    tensors = load_file(str(rl_models["b"] / "model.safetensors"))
    names = sorted(tensors, reverse=True)  # (any order: the one update_info gives)
    info = {"names": names, "dtype_names": ["float32"] * len(names),
            "shapes": [list(tensors[name].shape) for name in names]}
    wrong = {**info, "shapes": [[1], *info["shapes"][1:]]}
    missing = {key: value[1:] for key, value in info.items()}
    assert pause(served).status_code == 200
    try:
        for bad, param, named in ((wrong, "update_info.shapes", names[0]),
                                  (missing, "update_info.names", names[0])):
            response = post(served, "/update_weights", {"update_info": bad})
            assert response.status_code == 400, response.text
            error = strict_json(response.content)["error"]
            assert error["param"] == param and named in error["message"], error
        broadcast_update(served, group, tensors, info)
    finally:
        resume(served)
        weight_transfer.leave(group)
    assert outputs(served) == on_b  # bit for bit
    assert paused_update(served, rl_models["a"]).status_code == 200
    assert outputs(served) == before
