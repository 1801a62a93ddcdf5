"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info.

/tokenize takes a prompt (`add_special_tokens` true by default) or chat `messages` rendered
exactly as /v1/chat/completions renders them (`add_generation_prompt` true,
`continue_final_message` false, `add_special_tokens` false by default, `chat_template_kwargs`)
and answers {"count", "max_model_len", "tokens", "token_strs"}; `token_strs` (with
`return_token_strs`) are the vocabulary pieces, as vLLM's `convert_ids_to_tokens`.
/detokenize answers {"prompt"}: the ids decoded with special tokens kept (vLLM's
`tokenizer.decode`), so text -> /tokenize -> /detokenize gives the text back for a lossless
tokenizer. /tokenizer_info is the model's tokenizer_config.json (JSON values only) with
`tokenizer_class` and the chat template the server uses; lm-evaluation-harness probes it and
/tokenize to choose its remote tokenizer.
"""

from __future__ import annotations

import json
from typing import Any

from helios_logprobs.ranks.contract.requests import check_token_ids
from helios_logprobs.runtime.http.assets import ModelAssets
from helios_logprobs.runtime.http.endpoints.chat import render
from helios_logprobs.runtime.http.protocol.messages import parse_messages
from helios_logprobs.runtime.http.protocol.models import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from helios_logprobs.runtime.http.protocol.tools import check_tools
from helios_logprobs.runtime.text.detokenizer import detokenize


def tokenize_model(data: dict[str, Any]) -> type[TokenizeChatRequest | TokenizeCompletionRequest]:
    """vLLM's TokenizeRequest union: a body with `messages` is a chat request."""
    return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest


def tokenize(
    req: TokenizeChatRequest | TokenizeCompletionRequest, assets: ModelAssets, max_model_len: int
) -> dict[str, Any]:
    """The response body; RequestError (HTTP 400) names the parameter."""
    refused = req.refusal()
    if refused is not None:
        raise refused
    if isinstance(req, TokenizeChatRequest):
        if req.tools is not None:  # (rendered into the template as chat renders them)
            check_tools(req.tools)
        text = render(req, parse_messages(req.messages), assets)
        ids = assets.encode(text, add_special_tokens=req.add_special_tokens, param="messages")
    else:
        ids = assets.encode(req.prompt, add_special_tokens=req.add_special_tokens,
                            param="prompt")
    strs = None
    if req.return_token_strs:
        strs = [assets.tokenizer.id_to_token(token_id) or "" for token_id in ids]
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": strs}


def detokenize_ids(req: DetokenizeRequest, assets: ModelAssets, vocab_size: int
                   ) -> dict[str, Any]:
    check_token_ids("tokens", req.tokens, min(vocab_size, assets.token_bytes.size))
    text, _ = detokenize(assets.token_bytes, req.tokens, skip_special_tokens=False)
    return {"prompt": text}


def _json_value(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def tokenizer_info(assets: ModelAssets) -> dict[str, Any]:
    """tokenizer_config.json's JSON values (special tokens given as objects flattened to their
    text, as vLLM sends them), `tokenizer_class`, and the chat template in use."""
    path = assets.model_dir / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if path.is_file():
        loaded = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(loaded, dict):
            config = {k: v for k, v in loaded.items() if _json_value(v)}
    for key in ("vocab_file", "merges_file", "tokenizer_file"):
        config.pop(key, None)
    for key, value in list(config.items()):
        if key.endswith("_token") and isinstance(value, dict) and "content" in value:
            config[key] = value["content"]
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    if assets.chat_template is not None:
        config["chat_template"] = assets.chat_template.source
    return config
