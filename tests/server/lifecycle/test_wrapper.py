"""`helios-serve --tp 2` starts torchrun, which serves the embedded model on two ranks (on the
CPU with gloo, started and stopped like the other servers: tests/server/helpers.py)."""

from __future__ import annotations

import httpx

from helios_logprobs.launch.tiny_model import ensure_tiny_model
from tests.oracles import check_natural
from tests.server.helpers import (
    TOLERANCE,
    encoder,
    hf_rows,
    launch,
    natural_from_dict,
    token_id_of,
)


def test_helios_serve_wrapper_runs_two_ranks(tmp_path):
    model_dir = ensure_tiny_model(tmp_path / "cache")

    def wrapper(port: int) -> list[str]:
        return ["-m", "helios_logprobs.launch.wrapper", "--tp", "2", "--model", str(model_dir),
                "--port", str(port), "--capacity", "2"]

    server = launch("wrapper", model_dir, 2, [], tmp_path, command=wrapper)
    try:
        server.wait_healthy()
        prompt_ids = encoder(model_dir).encode("The garden").ids
        body = {"model": model_dir.name, "prompt": prompt_ids, "max_tokens": 3,
                "temperature": 0.0, "logprobs": 2, "ignore_eos": True,
                "return_tokens_as_token_ids": True}
        out = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        lp = out["choices"][0]["logprobs"]
        generated = [token_id_of(t) for t in lp["tokens"]]
        assert len(generated) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
        # The TP2 job's values against transformers on the same checkpoint.
        rows = hf_rows(model_dir, prompt_ids, generated)
        for j, token_id in enumerate(generated):
            assert abs(lp["token_logprobs"][j] - float(rows[j, token_id])) <= TOLERANCE
            assert float(rows[j, token_id]) >= float(rows[j].max()) - TOLERANCE  # greedy
            check_natural(natural_from_dict(lp["top_logprobs"][j], token_id, 2), rows[j], 2)
    finally:
        server.stop()
