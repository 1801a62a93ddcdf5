"""Weight updates of a server started from a GGUF file (quantized, llama.cpp's q/k
permutation): from a safetensors folder with Hugging Face's names, and from a GGUF file, the
server then answers bit for bit as a fresh server started on the new weights (a GGUF file of
them in F32, so both servers read the same config from GGUF metadata); going back to the
served file restores its answers; a folder whose tensor shape differs is refused naming the
tensor and the old weights keep serving; a trainer's broadcast is checked against the GGUF's
tensors and lands the same bits. TP1 (the shard slicing at TP2 is the folder
update's, tests/server/rl/test_weight_updates.py, and the GGUF reader's,
tests/distributed/test_gguf_tp.py)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from helios_logprobs.collectives import weight_transfer
from tests.checkpoints import write_llama
from tests.gguf_files import VOCAB, write_gguf
from tests.server.helpers import free_port, launch, strict_json
from tests.server.rl.checkpoints import narrow_down_proj, reweighted
from tests.server.rl.conftest import COMMON
from tests.server.rl.test_weight_updates import (
    _trainer_group,
    broadcast_update,
    counter,
    outputs,
    pause,
    resume,
    update,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_servers(tmp_path_factory):
    """(server on a.gguf, server on b.gguf, {name: path}) with b the reweighted a."""
    root = tmp_path_factory.mktemp("gguf-updates")
    hf_a = write_llama(root / "hf-a", vocab_size=VOCAB)
    hf_b = reweighted(hf_a, root / "hf-b", seed=7)
    paths = {"hf_b": hf_b, "a": write_gguf(hf_a, root / "a.gguf"),
             "b": write_gguf(hf_b, root / "b.gguf", types={}),  # (F32: hf_b's values)
             "narrowed": reweighted(hf_a, root / "narrowed", seed=8, edit=narrow_down_proj)}
    servers = [launch(f"gguf_{name}", paths[name], 1, COMMON, root) for name in ("a", "b")]
    try:
        for server in servers:
            server.wait_healthy()
        yield servers[0], servers[1], paths
    finally:
        for server in servers:
            server.stop()


def test_a_gguf_server_updates_from_safetensors_and_gguf(gguf_servers):
    served, fresh, paths = gguf_servers
    before, on_b = outputs(served), outputs(fresh)
    assert before != on_b  # (the weights differ where it shows)
    updates = counter(served, "rl_weight_update")
    assert pause(served).status_code == 200
    try:
        for source, want in (("hf_b", on_b), ("a", before), ("b", on_b)):
            response = update(served, paths[source])
            assert response.status_code == 200, (source, response.text)
            assert resume(served).status_code == 200
            assert outputs(served) == want, source  # bit for bit
            assert pause(served).status_code == 200
        refused = update(served, paths["narrowed"])
        assert refused.status_code == 400, refused.text
        error = strict_json(refused.content)["error"]
        assert error["param"] == "update_info.model_path"
        assert "model.layers.1.mlp.down_proj.weight" in error["message"], error
    finally:
        resume(served)
    assert outputs(served) == on_b  # the refused folder changed nothing
    assert counter(served, "rl_weight_update") == updates + 3


def test_a_gguf_server_takes_a_trainers_broadcast(gguf_servers):
    """The served GGUF's names and shapes (Hugging Face's) check a trainer's update_info."""
    served, fresh, paths = gguf_servers
    on_b, group = outputs(fresh), None
    assert pause(served).status_code == 200
    try:
        assert update(served, paths["a"]).status_code == 200
        resume(served)
        before = outputs(served)
        assert before != on_b
        group = _trainer_group(served, free_port(), 2)
        tensors = load_file(str(paths["hf_b"] / "model.safetensors"))
        names = sorted(tensors)
        info = {"names": names, "dtype_names": ["float32"] * len(names),
                "shapes": [list(tensors[name].shape) for name in names]}
        assert pause(served).status_code == 200
        broadcast_update(served, group, tensors, info)
    finally:
        resume(served)
        weight_transfer.leave(group)
    assert outputs(served) == on_b  # bit for bit
