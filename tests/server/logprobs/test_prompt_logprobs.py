"""Prompt scoring over HTTP (a server started with --prompt-logprobs): vLLM's
`prompt_logprobs`, echo with logprobs, an lm-evaluation-harness loglikelihood, the tokenizer
routes, and the refusals; values against transformers' FP32 log_softmax."""

from __future__ import annotations

import math

import httpx
import pytest

from helios_logprobs.runtime.http.output.wire import (
    NonFiniteLogprob,
    natural_ranks,
    prompt_logprobs_entry,
)
from helios_logprobs.runtime.outputs import PromptLogprob, TokenLogprob
from helios_logprobs.runtime.text.token_bytes import TokenBytes
from tests.checkpoints import hf_logprobs
from tests.oracles import check_natural
from tests.server.helpers import (
    TOLERANCE,
    chat_prompt_ids,
    encoder,
    expected_offsets,
    hf_rows,
    hf_tokenizer,
    post,
    same,
    served_name,
    sse_events,
    strict_json,
    token_id_of,
    vocab_bytes,
)
from tests.tokenizer_fixtures import vllm_sequence_texts, vllm_token_text

pytestmark = pytest.mark.slow

NEAR_TIE = 1e-5
IDS = {"return_tokens_as_token_ids": True}
TEXT = "Hello café world, 中文 and 🙂"


# ----------------------------------------------------------------------------- oracles
def check_rank(rank: int, value: float, row) -> None:
    """rank = 1 + the number of ids strictly greater (near-ties may go either way)."""
    above = int((row > value + NEAR_TIE).sum())
    at_most = int((row > value - NEAR_TIE).sum())
    assert 1 + above <= rank <= max(at_most, 1), (rank, above, at_most)


def natural_pairs(pairs: list[tuple[int, float]], chosen: int, n: int) -> list[tuple[int, float]]:
    """A dict that starts with the chosen id, then the natural top-n without it -> the
    natural top-n (the chosen id put back in its place when it belongs there)."""
    assert pairs[0][0] == chosen
    rest = pairs[1:]
    if len(rest) == n:
        return rest
    assert len(rest) == n - 1, (len(rest), n)
    value = pairs[0][1]
    at = next((i for i, (t, v) in enumerate(rest) if (value, -chosen) > (v, -t)), len(rest))
    return [*rest[:at], pairs[0], *rest[at:]]


def check_prompt_logprobs(items: list, prompt: list[int], model_dir, n: int,
                          as_ids: bool = False) -> None:
    """vLLM's prompt_logprobs list: null, then per position the prompt token (value, rank)
    and the natural top-n, each with its rank, against transformers; each decoded_token as
    vLLM decodes it after the prompt tokens before (position 0 excluded), or "token_id:N"."""
    rows = hf_logprobs(model_dir, prompt)  # row i predicts prompt[i + 1]
    table, tokenizer = vocab_bytes(model_dir), encoder(model_dir)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    assert len(items) == len(prompt) and items[0] is None
    for position in range(1, len(prompt)):
        item, row, token = items[position], rows[position - 1], prompt[position]
        keys = list(item)
        assert keys[0] == str(token)
        for key, entry in item.items():
            assert set(entry) == {"logprob", "rank", "decoded_token"}
            own = table[int(key)].decode("utf-8", errors="replace")
            assert entry["decoded_token"] == (f"token_id:{key}" if as_ids else vllm_token_text(
                decode, own, int(key), prompt[1:position]))
            assert abs(entry["logprob"] - float(row[int(key)])) <= TOLERANCE, (position, key)
            check_rank(entry["rank"], entry["logprob"], row)
        pairs = [(int(k), v["logprob"]) for k, v in item.items()]
        check_natural(natural_pairs(pairs, token, n), row, n)


def check_echoed(lp: dict, prompt: list[int], text: str, model_dir, n: int) -> int:
    """The prompt positions that lead an echoed choice's logprobs (return_tokens_as_token_ids):
    first entry null, values and natural alternatives against transformers, offsets into the
    echoed text. Returns the number of prompt entries."""
    count = len(prompt)
    assert [token_id_of(t) for t in lp["tokens"][:count]] == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    rows = hf_logprobs(model_dir, prompt)
    for position in range(1, count):
        row, token = rows[position - 1], prompt[position]
        assert abs(lp["token_logprobs"][position] - float(row[token])) <= TOLERANCE
        pairs = [(token_id_of(k), v) for k, v in lp["top_logprobs"][position].items()]
        assert pairs[0] == (token, lp["token_logprobs"][position])
        check_natural(natural_pairs(pairs, token, n), row, n)
    table = vocab_bytes(model_dir)
    pieces = [table[t] for t in prompt]
    if pieces[0].startswith(b" ") and not text.startswith(" "):
        pieces[0] = pieces[0][1:]  # Metaspace: the decoder drops the first token's space
    assert b"".join(pieces).decode("utf-8", errors="replace") == text
    assert lp["text_offset"][:count] == expected_offsets(pieces)
    return count


def merged(events: list) -> dict[int, dict]:
    """Streamed completion chunks joined per choice: text, logprobs lists, prompt_logprobs."""
    out: dict[int, dict] = {}
    for event in events:
        for choice in event["choices"]:
            into = out.setdefault(choice["index"], {"text": "", "logprobs": None,
                                                    "prompt_logprobs": None})
            into["text"] += choice["text"]
            if choice["logprobs"] is not None:
                lists = into["logprobs"] = into["logprobs"] or {
                    "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                for key, values in choice["logprobs"].items():
                    lists[key] += values
            if choice.get("prompt_logprobs") is not None:
                into["prompt_logprobs"] = (into["prompt_logprobs"] or []) + choice[
                    "prompt_logprobs"]
            if choice["finish_reason"] is not None:
                into["finish_reason"] = choice["finish_reason"]
    return out


def completion(server, body: dict) -> dict:
    response = post(server, "/v1/completions", {"model": served_name(server), **body})
    assert response.status_code == 200, response.text
    return strict_json(response.content)


def streamed(server, body: dict) -> dict[int, dict]:
    response = post(server, "/v1/completions",
                    {"model": served_name(server), **body, "stream": True})
    assert response.status_code == 200, response.text
    return merged(sse_events(response))


def whole(choice: dict) -> dict:
    keep = ("text", "logprobs", "prompt_logprobs", "finish_reason")
    return {k: choice[k] for k in keep}


# ----------------------------------------------------------------------------- completions
def test_echo_with_logprobs_text_prompt(scoring_server):
    server = scoring_server
    prompt = encoder(server.model_dir).encode(TEXT).ids
    body = {"prompt": TEXT, "echo": True, "logprobs": 3, "max_tokens": 4, "temperature": 0.0,
            "ignore_eos": True, **IDS}
    choice = completion(server, body)["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(TEXT)
    count = check_echoed(lp, prompt, TEXT, server.model_dir, 3)
    generated = [token_id_of(t) for t in lp["tokens"][count:]]
    assert len(generated) == 4
    rows = hf_rows(server.model_dir, prompt, generated)
    for j, token in enumerate(generated):
        assert abs(lp["token_logprobs"][count + j] - float(rows[j, token])) <= TOLERANCE
        assert lp["text_offset"][count + j] >= len(TEXT)
    assert choice["prompt_logprobs"] is None
    # The stream carries the same, prompt entries first (concatenated chunks = the whole).
    assert same(streamed(server, body)[0], whole(choice))
    # Without token-id strings: token texts, and the first entry still null.
    plain = completion(server, {**body, "return_tokens_as_token_ids": False})["choices"][0]
    owns = [vocab_bytes(server.model_dir)[t].decode("utf-8", errors="replace") for t in prompt]
    tokenizer = encoder(server.model_dir)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    # vLLM: position 0 decoded alone; each later one after the prompt tokens before it, less
    # position 0 (it has no prompt logprob entry, so it is no context).
    assert plain["logprobs"]["tokens"][:count] == [owns[0]] + vllm_sequence_texts(
        decode, owns[1:], prompt[1:])
    assert same(plain["logprobs"]["token_logprobs"], lp["token_logprobs"])


def test_echo_with_logprobs_token_prompt_only(scoring_server):
    """A token-id prompt (special token, split characters), max_tokens 0: only the prompt
    entries, its text decoded with special tokens kept, finish "length"."""
    server = scoring_server
    prompt = [1] + encoder(server.model_dir).encode("naïve 🙂 ok").ids + [2, 40]
    text = hf_tokenizer(server.model_dir).decode(prompt, skip_special_tokens=False)
    body = {"prompt": prompt, "echo": True, "logprobs": 5, "max_tokens": 0, **IDS}
    out = completion(server, body)
    choice = out["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert check_echoed(choice["logprobs"], prompt, text, server.model_dir, 5) == len(prompt)
    assert len(choice["logprobs"]["tokens"]) == len(prompt)
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 0,
                            "total_tokens": len(prompt)}
    assert same(streamed(server, body)[0], whole(choice))
    # A one-token prompt: one null entry.
    one = completion(server, {**body, "prompt": [40]})["choices"][0]
    assert one["logprobs"]["token_logprobs"] == [None] and one["finish_reason"] == "length"


@pytest.mark.parametrize("n", [0, 5, 20])
def test_prompt_logprobs_completions(scoring_server, n):
    server = scoring_server
    prompts = [TEXT, "emoji 🙂 party 🎉 and words"]
    ids = [encoder(server.model_dir).encode(p).ids for p in prompts]
    body = {"prompt": prompts, "prompt_logprobs": n, "max_tokens": 3, "n": 2, "seed": 5,
            "ignore_eos": True}
    out = completion(server, body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for choice in out["choices"]:
        prompt = ids[choice["index"] // 2]
        check_prompt_logprobs(choice["prompt_logprobs"], prompt, server.model_dir, n)
        assert choice["logprobs"] is None
    assert same(out["choices"][0]["prompt_logprobs"], out["choices"][1]["prompt_logprobs"])
    if n > 0:  # vLLM refuses prompt_logprobs > 0 in a stream (0 streams, as there)
        refused_in_a_stream(server, "/v1/completions", body)
        return
    stream = streamed(server, body)
    for choice in out["choices"]:
        assert same(stream[choice["index"]], whole(choice))


def refused_in_a_stream(server, path: str, body: dict) -> None:
    response = post(server, path, {"model": served_name(server), **body, "stream": True})
    assert response.status_code == 400, response.text
    error = strict_json(response.content)["error"]
    assert error["param"] == "prompt_logprobs"
    assert "`prompt_logprobs` are not available when `stream=True`." in error["message"]


def test_prompt_logprobs_with_the_openai_client(scoring_server):
    server = scoring_server
    prompt = encoder(server.model_dir).encode(TEXT).ids
    response = server.client().completions.create(
        model=served_name(server), prompt=prompt, max_tokens=2, logprobs=2, temperature=0.0,
        extra_body={"prompt_logprobs": 2, "ignore_eos": True},
    )
    choice = response.choices[0]
    check_prompt_logprobs(choice.model_extra["prompt_logprobs"], prompt, server.model_dir, 2)
    assert len(choice.logprobs.tokens) == 2  # no echo: generated tokens only


def test_lm_eval_loglikelihood(scoring_server):
    """lm-evaluation-harness `local-completions` loglikelihood: token-id prompts, echo,
    logprobs 1, max_tokens 1, temperature 0; it reads token_logprobs[ctxlen:-1] and calls a
    continuation greedy when each chosen value is the maximum of its top_logprobs dict."""
    server = scoring_server
    tok = encoder(server.model_dir)
    cases = []
    for text in ["The garden is", "Hello world, the café", "numbers 1 2 3", "a b c d e f"]:
        context = tok.encode(text).ids
        greedy = list(context)
        for _ in range(3):
            greedy.append(int(hf_logprobs(server.model_dir, greedy)[-1].argmax()))
        other = context + tok.encode(" zebra").ids
        for full in (greedy, other):
            rows = hf_logprobs(server.model_dir, full)
            top2 = rows[len(context) - 1:-1].topk(2).values
            if float((top2[:, 0] - top2[:, 1]).min()) < 1e-3:  # no near-ties in the oracle
                continue
            cases.append((full, len(context), rows))
    assert len(cases) >= 4
    out = completion(server, {"prompt": [full for full, _, _ in cases], "echo": True,
                              "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234})
    choices = sorted(out["choices"], key=lambda c: c["index"])
    seen_greedy = set()
    for (full, ctxlen, rows), choice in zip(cases, choices, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(full) + 1
        logprob = sum(lp["token_logprobs"][ctxlen:-1])
        is_greedy = all(value == max(top.values()) for value, top in
                        zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1],
                            strict=True))
        want = sum(float(rows[i - 1, full[i]]) for i in range(ctxlen, len(full)))
        want_greedy = all(int(rows[i - 1].argmax()) == full[i] for i in range(ctxlen, len(full)))
        assert abs(logprob - want) <= TOLERANCE * (len(full) - ctxlen)
        assert is_greedy == want_greedy
        seen_greedy.add(is_greedy)
    assert seen_greedy == {True, False}


# ----------------------------------------------------------------------------- chat
def test_prompt_logprobs_chat(scoring_server):
    server = scoring_server
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello café 🙂"}]
    prompt = chat_prompt_ids(server.model_dir, messages)
    body = {"model": served_name(server), "messages": messages, "prompt_logprobs": 4,
            "max_tokens": 3, "n": 2, "seed": 2, "ignore_eos": True}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    out = strict_json(response.content)
    check_prompt_logprobs(out["prompt_logprobs"], prompt, server.model_dir, 4)
    assert out["usage"]["prompt_tokens"] == len(prompt)
    # Streamed: refused above 0 (vLLM's rule); at 0, choice 0's first chunks carry it
    # (top-level), in prompt order.
    refused_in_a_stream(server, "/v1/chat/completions", body)
    body = {**body, "prompt_logprobs": 0}
    out = strict_json(post(server, "/v1/chat/completions", body).content)
    events = sse_events(post(server, "/v1/chat/completions", {**body, "stream": True}))
    pieces = [e["prompt_logprobs"] for e in events if "prompt_logprobs" in e]
    assert pieces and same([item for piece in pieces for item in piece], out["prompt_logprobs"])
    first_content = next(i for i, e in enumerate(events)
                         if e["choices"] and e["choices"][0]["index"] == 0
                         and (e["choices"][0]["delta"].get("content")
                              or e["choices"][0]["finish_reason"]))
    last_prompt = max(i for i, e in enumerate(events) if "prompt_logprobs" in e)
    assert last_prompt < first_content
    # The official client parses it (extra field) and the default is null.
    client = server.client()
    parsed = client.chat.completions.create(
        model=served_name(server), messages=messages, max_tokens=2,
        extra_body={"prompt_logprobs": 0})
    check_prompt_logprobs(parsed.model_extra["prompt_logprobs"], prompt, server.model_dir, 0)
    plain = client.chat.completions.create(model=served_name(server), messages=messages,
                                           max_tokens=2)
    assert plain.model_extra["prompt_logprobs"] is None


# ----------------------------------------------------------------------------- tokenizer routes
def test_tokenize_and_detokenize(scoring_server):
    server, name = scoring_server, served_name(scoring_server)
    tok = encoder(server.model_dir)
    ids = tok.encode(TEXT).ids
    out = strict_json(post(server, "/tokenize", {"model": name, "prompt": TEXT,
                                                 "return_token_strs": True}).content)
    assert out == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                   "token_strs": [tok.id_to_token(t) for t in ids]}
    back = strict_json(post(server, "/detokenize", {"model": name, "tokens": ids}).content)
    assert back == {"prompt": TEXT}
    messages = [{"role": "user", "content": "Hi there"}]
    chat = strict_json(post(server, "/tokenize", {"messages": messages}).content)
    assert chat["tokens"] == chat_prompt_ids(server.model_dir, messages)
    assert chat["token_strs"] is None
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with_tools = strict_json(post(server, "/tokenize", {"messages": messages,
                                                        "tools": tools}).content)
    assert with_tools["tokens"] == chat_prompt_ids(server.model_dir, messages, tools=tools)
    special = [1, *ids[:3], 2]
    text = strict_json(post(server, "/detokenize", {"tokens": special}).content)["prompt"]
    assert text == hf_tokenizer(server.model_dir).decode(special, skip_special_tokens=False)
    again = strict_json(post(server, "/tokenize", {"prompt": text,
                                                  "add_special_tokens": False}).content)
    assert again["tokens"] == special
    info = strict_json(httpx.get(server.url + "/tokenizer_info").content)
    assert info["eos_token"] == "<|endoftext|>" and "<|im_start|>" in info["chat_template"]
    for path, body, param, status in [
        ("/detokenize", {"tokens": [5, 100000]}, "tokens", 400),
        ("/detokenize", {"tokens": "abc"}, "tokens", 400),
        ("/tokenize", {"prompt": 5}, "prompt", 400),
        ("/tokenize", {"messages": [{"role": "user"}]}, "messages", 400),
        ("/tokenize", {"messages": messages, "tools": [{"type": "function"}]}, "tools", 400),
        ("/tokenize", {"prompt": "x", "model": "nope"}, "model", 404),
    ]:
        response = post(server, path, body)
        assert response.status_code == status, (path, body, response.text)
        assert strict_json(response.content)["error"]["param"] == param


# ----------------------------------------------------------------------------- refusals
def check_refused(server, path: str, body: dict, param: str, *, mentions: str = "") -> None:
    for stream in (False, True):
        response = post(server, path, {"model": served_name(server), **body, "stream": stream})
        assert response.status_code == 400, response.text
        error = strict_json(response.content)["error"]
        assert error["param"] == param and param in error["message"], error
        assert mentions in error["message"]


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def test_refusals_on_a_scoring_server(scoring_server):
    server = scoring_server
    for value in (21, -1, "many", 2.5):
        check_refused(server, "/v1/completions", {"prompt": "Hi", "prompt_logprobs": value},
                      "prompt_logprobs")
        check_refused(server, "/v1/chat/completions", {**CHAT, "prompt_logprobs": value},
                      "prompt_logprobs")
    check_refused(server, "/v1/completions",
                  {"prompt": "Hi", "echo": True, "logprobs": 0, "logprob_token_ids": [3]},
                  "echo")
    check_refused(server, "/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": 21},
                  "logprobs")
    card = strict_json(httpx.get(server.url + "/v1/models").content)["data"][0]
    assert card["capabilities"] == {"max_logprobs": 20, "logprob_token_ids": True,
                                    "prompt_logprobs": True}


def test_refusals_without_prompt_scoring(server):
    """A server started without --prompt-logprobs loads, serves, and refuses scoring."""
    check_refused(server, "/v1/completions", {"prompt": "Hi", "prompt_logprobs": 0},
                  "prompt_logprobs", mentions="--prompt-logprobs")
    check_refused(server, "/v1/chat/completions", {**CHAT, "prompt_logprobs": 0},
                  "prompt_logprobs", mentions="--prompt-logprobs")
    check_refused(server, "/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": 1},
                  "echo", mentions="--prompt-logprobs")
    card = strict_json(httpx.get(server.url + "/v1/models").content)["data"][0]
    assert card["capabilities"]["prompt_logprobs"] is False
    echo = completion(server, {"prompt": "Hi", "echo": True, "max_tokens": 0})
    assert echo["choices"][0]["text"] == "Hi" and echo["choices"][0]["logprobs"] is None


# ----------------------------------------------------------------------------- TP4
def test_tp4_echo_with_logprobs(tp4_server):
    server = tp4_server
    text = "Hello world, the café 中文"
    prompt = encoder(server.model_dir).encode(text).ids
    body = {"prompt": text, "echo": True, "logprobs": 5, "max_tokens": 1, "temperature": 0.0,
            "ignore_eos": True, "prompt_logprobs": 2, **IDS}
    choice = completion(server, body)["choices"][0]
    assert choice["text"].startswith(text)
    count = check_echoed(choice["logprobs"], prompt, text, server.model_dir, 5)
    assert len(choice["logprobs"]["tokens"]) == count + 1
    check_prompt_logprobs(choice["prompt_logprobs"], prompt, server.model_dir, 2, as_ids=True)


# ----------------------------------------------------------------------------- wire builders
def test_prompt_wire_values_and_ranks(model_dirs):
    tb = TokenBytes(encoder(model_dirs["byte_level"]))
    entry = PromptLogprob(3, 70, -math.inf, 300, (TokenLogprob(5, -0.5), TokenLogprob(6, -0.5),
                                                  TokenLogprob(70, -1.0)))
    item = prompt_logprobs_entry(entry, tb, 3)
    assert list(item) == ["70", "5", "6"]
    assert item["70"]["logprob"] == -9999.0 and item["70"]["rank"] == 300
    assert [item["5"]["rank"], item["6"]["rank"]] == [1, 1]  # equal values share a rank
    assert natural_ranks([TokenLogprob(1, -1.0), TokenLogprob(2, -1.0),
                          TokenLogprob(3, -2.0)]) == [1, 1, 3]
    assert prompt_logprobs_entry(None, tb, 3) is None
    for bad in (math.nan, math.inf):
        with pytest.raises(NonFiniteLogprob):
            prompt_logprobs_entry(PromptLogprob(1, 70, bad, 1), tb, 0)
