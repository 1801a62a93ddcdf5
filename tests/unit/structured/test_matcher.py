"""The engine core's matcher over a real tokenizer's vocabulary (the tests' byte-level and
byte-fallback tokenizers, vocabulary padded past the tokenizer): the masks allow exactly the
tokens that keep the text a prefix of the language, EOS only where the grammar accepts, and a
speculative round's proposals are masked from tentative states and rolled back. The oracle
is independent: Python's `re.fullmatch` on the decoded text, and `json`/`jsonschema`."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from helios_logprobs.ranks.grammar_mask import allowed_ids
from helios_logprobs.runtime.structured.backend import GrammarBackend
from helios_logprobs.runtime.structured.spec import StructuredSpec
from helios_logprobs.runtime.structured.state import GrammarViolation
from helios_logprobs.runtime.text.token_bytes import TokenBytes
from tests.tokenizer_fixtures import byte_fallback_tokenizer, byte_level_tokenizer, eos_id

PADDING = 7


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def backend(request):
    tok = byte_level_tokenizer() if request.param == "byte_level" else byte_fallback_tokenizer()
    size = tok.get_vocab_size(with_added_tokens=True) + PADDING
    return tok, GrammarBackend.from_tokenizer(tok, size, [eos_id(tok)])


def walk(backend, spec: StructuredSpec, pick) -> tuple[list[int], list[np.ndarray]]:
    """Generate with the masks: `pick(allowed ids, step)` chooses each token; stops at EOS."""
    tok, grammars = backend
    state = grammars.state(spec)
    out, seen = [], []
    for step in range(200):
        _, masks = state.round(out)
        allowed = allowed_ids(masks[0], grammars.vocab_size)
        seen.append(allowed)
        token = pick(np.nonzero(allowed)[0], step)
        if token == eos_id(tok):
            return out, seen
        out.append(int(token))
    raise AssertionError("the grammar did not end")


def spelled(backend, text: str) -> list[int]:
    """Ids whose bytes spell `text` (longest piece first; no tokenizer normalization)."""
    tok, grammars = backend
    pieces = TokenBytes(tok, grammars.vocab_size)
    target, ids = text.encode(), []
    while target:
        token = max((t for t in range(pieces.size) if not pieces.is_special(t)
                     and pieces.bytes_of(t) and target.startswith(pieces.bytes_of(t))),
                    key=lambda t: len(pieces.bytes_of(t)))
        ids.append(token)
        target = target[len(pieces.bytes_of(token)):]
    return ids


def text_of(backend, ids: list[int]) -> str:
    return backend[0].decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("seed", range(5))
def test_regex_outputs_match_and_eos_only_at_accepting_states(backend, seed):
    pattern = r"(ab|cd)[0-9]{2,4}x?"
    rng = np.random.default_rng(seed)
    eos = eos_id(backend[0])
    out, seen = walk(backend, StructuredSpec("regex", pattern),
                     lambda ids, step: rng.choice(ids))
    text = text_of(backend, out)
    assert re.fullmatch(pattern, text), text
    for k, allowed in enumerate(seen):
        prefix = text_of(backend, out[:k])
        assert allowed[eos] == bool(re.fullmatch(pattern, prefix)), prefix
        assert not allowed[backend[1].vocab_size - PADDING:].any()  # (padded lanes never)


@pytest.mark.parametrize("seed", range(5))
def test_json_schema_outputs_validate(backend, seed):
    schema = {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["ok", "tag", "n"]}
    rng = np.random.default_rng(seed)
    spec = StructuredSpec.from_schema(schema, any_whitespace=False)
    out, _ = walk(backend, spec, lambda ids, step: rng.choice(ids))
    jsonschema.validate(json.loads(text_of(backend, out)), schema)


def test_choice_allows_exactly_the_choices(backend):
    """Each choice can be spelled through the masks (taking the longest allowed token that
    continues it), and EOS is allowed exactly once a choice is complete."""
    tok, grammars = backend
    pieces = TokenBytes(tok, grammars.vocab_size)
    choices = ("yes", "no", 'say "hi"')
    eos = eos_id(tok)
    for choice in choices:
        target, done = choice.encode(), bytearray()

        def spell(allowed, step, target=target, done=done):
            if bytes(done) in {c.encode() for c in choices}:
                assert eos in allowed
            else:
                assert eos not in allowed
            if bytes(done) == target:
                return eos
            rest = target[len(done):]
            token = max((t for t in allowed if t != eos and rest.startswith(pieces.bytes_of(t))),
                        key=lambda t: len(pieces.bytes_of(t)))
            done.extend(pieces.bytes_of(token))
            return token

        out, _ = walk(backend, StructuredSpec.from_choices(choices), spell)
        assert b"".join(pieces.bytes_of(t) for t in out) == target


def test_proposals_masked_tentatively_then_rolled_back(backend):
    tok, grammars = backend
    spec = StructuredSpec("regex", "abc[0-9]+")
    ids = spelled(backend, "abc12")
    state = grammars.state(spec)
    kept, masks = state.round([], ids)
    assert kept == tuple(ids) and len(masks) == 1 + len(ids)
    fresh = grammars.state(spec)
    for k in range(len(ids) + 1):  # row k: the mask after the first k proposals
        assert masks[k] == fresh.round(ids[:k])[1][0]
    assert state.consumed == 0 and state.round([])[1][0] == masks[0]  # (rolled back)
    bad = spelled(backend, "x")
    kept, masks = state.round([], [ids[0], *bad, ids[0]])
    assert kept == (ids[0],) and len(masks) == 2  # (the round ends at the rejected proposal)
    with pytest.raises(GrammarViolation):
        state.round(bad)
