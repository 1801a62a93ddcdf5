"""The engine core's xgrammar backend: the served vocabulary as xgrammar's TokenizerInfo,
grammars compiled once per spec, and one matcher per constrained request (GrammarState).

The vocabulary is the tokenizer's true bytes per id (runtime/text/token_bytes.py: the same
for an HF tokenizer.json and a GGUF file's converted one), sized to the model's LM head
(``vocab_size``, padded lanes included: they have no bytes, so xgrammar never allows them).
Special added tokens get no bytes either, so no grammar can spell one; the end of a grammar
is the stop tokens (the model's EOS ids), which xgrammar allows exactly where the grammar
accepts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import tokenizers
import xgrammar as xgr

from helios_logprobs.runtime.structured.grammar import grammar_of, grammar_reason
from helios_logprobs.runtime.structured.spec import StructuredSpec
from helios_logprobs.runtime.structured.state import GrammarState
from helios_logprobs.runtime.text.token_bytes import TokenBytes

COMPILED_CACHE = 256
"""Compiled grammars kept (least recently used dropped first)."""
COMPILER_THREADS = 2


class GrammarError(ValueError):
    """A spec that cannot be compiled against the served vocabulary (xgrammar's reason)."""


def encoded_vocab(token_bytes: TokenBytes, vocab_size: int) -> list[bytes]:
    """Each id's bytes for xgrammar's RAW vocabulary: special added tokens and ids without a
    piece are empty (xgrammar treats empty tokens as special: never in a mask)."""
    return [b"" if token_id >= token_bytes.size or token_bytes.is_special(token_id)
            else token_bytes.bytes_of(token_id) for token_id in range(vocab_size)]


class GrammarBackend:
    def __init__(self, vocab: Sequence[bytes], vocab_size: int, stop_token_ids: Sequence[int]):
        if vocab_size < 1 or len(vocab) != vocab_size:
            raise ValueError(f"need {vocab_size} token byte strings, got {len(vocab)}")
        stops = sorted({t for t in stop_token_ids if 0 <= t < vocab_size})
        if not stops:
            raise ValueError("structured outputs need at least one stop (EOS) token id")
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stops)
        self.info = xgr.TokenizerInfo(list(vocab), xgr.VocabType.RAW, vocab_size=vocab_size,
                                      stop_token_ids=list(stops))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=COMPILER_THREADS)
        self._compiled: OrderedDict[StructuredSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tokenizer: tokenizers.Tokenizer, vocab_size: int,
                       stop_token_ids: Sequence[int]) -> GrammarBackend:
        token_bytes = TokenBytes(tokenizer, vocab_size)
        return cls(encoded_vocab(token_bytes, vocab_size), vocab_size, stop_token_ids)

    @property
    def words(self) -> int:
        """int32 words of one bitmask row."""
        return (self.vocab_size + 31) // 32

    def compiled(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        """The spec's grammar compiled for this vocabulary (cached per spec)."""
        with self._lock:
            found = self._compiled.get(spec)
            if found is not None:
                self._compiled.move_to_end(spec)
                return found
        try:
            compiled = self.compiler.compile_grammar(grammar_of(spec))
        except ValueError as exc:  # (grammar_of: xgrammar's reason already)
            raise GrammarError(str(exc)) from exc
        except RuntimeError as exc:
            raise GrammarError(grammar_reason(exc)) from exc
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        return compiled

    def state(self, spec: StructuredSpec) -> GrammarState:
        """A fresh matcher for one request."""
        return GrammarState(self.compiled(spec), self.vocab_size, self.stop_token_ids)


class LazyGrammarBackend:
    """Builds the backend from the model directory's tokenizer on first use (a server that
    never sees a structured request never pays for the vocabulary tables)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, stop_token_ids: Sequence[int]):
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    def get(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                path = self.model_dir / "tokenizer.json"
                if not path.is_file():
                    raise GrammarError(f"structured outputs need the model's tokenizer ({path} "
                                       f"is missing)")
                tokenizer = tokenizers.Tokenizer.from_file(str(path))
                self._backend = GrammarBackend.from_tokenizer(tokenizer, self.vocab_size,
                                                              self.stop_token_ids)
            return self._backend

    def state(self, spec: StructuredSpec) -> GrammarState:
        return self.get().state(spec)
