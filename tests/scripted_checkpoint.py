"""A tiny Llama whose output a prompt scripts: each token is followed by a chosen successor.

Written with transformers, so transformers still gives reference logprobs. Attention and MLP
outputs are zero (zero o_proj and down_proj), so the residual stream at a position is the
embedding of its token; the embedding is one-hot (token t -> unit vector t of the hidden
size), the final RMSNorm turns it into sqrt(hidden) * e_t, and the untied head's column t
puts a large weight on successor[t] plus small seeded noise elsewhere: greedy decoding follows
``successor`` deterministically, and every logit row still has distinct, non-trivial values.

The tokenizer is a real `tokenizers` byte-level BPE without merges (each lowercase letter,
digit, space "Ġ" and newline "Ċ" is one token), with ``<eos>`` (special, EOS), ``<sep>``
(special, not EOS: skip_special_tokens leaves it out of the text) and ``<think>`` /
``</think>`` as added non-special tokens, so they appear in the text.
"""

from __future__ import annotations

import json
import math
import string
from pathlib import Path

import torch

EOS = "<eos>"
THINK = "<think>"
END_THINK = "</think>"
SEP = "<sep>"
PIECES = [*string.ascii_lowercase, *string.digits, "Ġ", "Ċ"]
"""Base vocabulary pieces (byte-level: "Ġ" is a space, "Ċ" a newline)."""
ADDED = [EOS, THINK, END_THINK, SEP]
HIDDEN = 64
MARGIN = 1.5
"""Head weight of the successor (logit MARGIN * sqrt(HIDDEN) = 12)."""
NOISE = 0.08


TOOL_CALL = "<tool_call>"
END_TOOL_CALL = "</tool_call>"


def build_tokenizer(extra: tuple[str, ...] = ()):
    """`extra`: more added (non-special) tokens after ADDED, e.g. TOOL_CALL, END_TOOL_CALL
    and JSON punctuation (the base pieces are letters, digits, space and newline)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {piece: i for i, piece in enumerate(PIECES)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
    tokenizer.add_tokens([AddedToken(THINK, normalized=False, special=False),
                          AddedToken(END_THINK, normalized=False, special=False)])
    tokenizer.add_special_tokens([AddedToken(SEP, special=True, normalized=False)])
    tokenizer.add_tokens([AddedToken(text, normalized=False, special=False) for text in extra])
    return tokenizer


def default_successors() -> dict[str, str]:
    """Letters cycle a -> b -> ... -> z -> a; digits cycle; <think> -> a; </think> -> newline;
    newline -> "0"; space -> "x"; <eos> -> <eos>; <sep> -> "x"."""
    letters, digits = string.ascii_lowercase, string.digits
    successors = {c: letters[(i + 1) % 26] for i, c in enumerate(letters)}
    successors.update({c: digits[(i + 1) % 10] for i, c in enumerate(digits)})
    successors.update({THINK: "a", END_THINK: "Ċ", "Ċ": "0", "Ġ": "x", EOS: EOS, SEP: "x"})
    return successors


def write_scripted(
    path: Path, successors: dict[str, str] | None = None, seed: int = 7,
    extra: tuple[str, ...] = (),
) -> Path:
    """Write the checkpoint, tokenizer.json and tokenizer_config.json into ``path``; token
    strings in ``successors`` are pieces or added tokens (defaults: default_successors());
    `extra` adds tokens (build_tokenizer), each followed by EOS unless `successors` says."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(extra)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = {piece: tokenizer.token_to_id(piece) for piece in [*PIECES, *ADDED, *extra]}
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=ids[EOS],
        eos_token_id=ids[EOS],
    )
    model = LlamaForCausalLM(config)
    mapping = {**default_successors(), **{text: EOS for text in extra}, **(successors or {})}
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.lm_head.weight
        head.copy_(torch.randn(head.shape) * NOISE)
        for piece, token in ids.items():
            head[ids[mapping[piece]], token] = MARGIN
    model.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS,
        "clean_up_tokenization_spaces": False,
    }))
    return path


def successor_logit() -> float:
    return MARGIN * math.sqrt(HIDDEN)


def encode(model_dir: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return tokenizer.encode(text, add_special_tokens=False).ids


def decode(model_dir: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return tokenizer.decode(ids, skip_special_tokens=False)
