"""A core's declared buffers and graphs, and their validation against the logprobs contract."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from helios_logprobs.kernels.layout import EXPORT_K, MAX_TOKEN_IDS, PAYLOAD_WORDS, PROMPT_ROW_WORDS
from helios_logprobs.ranks.contract.abi6 import HEADER

COMPLETION_RECORDS = "completion_records"
COMPLETION_LOGPROBS = "completion_logprobs"
LOGPROB_REQUESTED = "logprob_requested"
LOGPROB_TOKEN_IDS = "logprob_token_ids"
LOGPROB_TOKEN_ID_COUNTS = "logprob_token_id_counts"
PROMPT_LOGPROBS = "prompt_logprobs"
PROMPT_TARGET_TOKENS = "prompt_target_tokens"

ID_INPUTS = (LOGPROB_TOKEN_IDS, LOGPROB_TOKEN_ID_COUNTS)
GENERATION_BUFFERS = (COMPLETION_LOGPROBS, LOGPROB_REQUESTED, *ID_INPUTS)
PROMPT_BUFFERS = (PROMPT_LOGPROBS, PROMPT_TARGET_TOKENS)
CONTRACT_BUFFERS = (COMPLETION_RECORDS, *GENERATION_BUFFERS, *PROMPT_BUFFERS)
OUTPUT_ONLY_BUFFERS = (COMPLETION_LOGPROBS, PROMPT_LOGPROBS)

FRAMES = 2
DEFAULT_COMPLETION_TOKEN_CAPACITY = 8

SCORED_PREFILL = "scored_prefill"
SAMPLING_KINDS = ("sampling", "speculative", "mixed")
"""Graph kinds that sample tokens: they must bind the flag vector when logprobs are declared."""
GRAPH_KINDS = (*SAMPLING_KINDS, "prefill", SCORED_PREFILL, "admission", "maintenance", "vision")

DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32")


class DeclarationError(ValueError):
    """A core's declarations break the contract: the core fails loading."""


def resolve_completion_token_capacity(requested: int | None) -> int:
    """T: None or 0 means eight, positive values are literal."""
    if requested is None or requested == 0:
        return DEFAULT_COMPLETION_TOKEN_CAPACITY
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise ValueError(
            f"completion_token_capacity: expected None, 0 or a positive int, got {requested!r}"
        )
    return requested


def describe(dtype: str, shape: Iterable[int]) -> str:
    return f"{dtype}[{', '.join(str(extent) for extent in shape)}]"


@dataclass(frozen=True)
class BufferDecl:
    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise DeclarationError(f"buffer name: expected a non-empty string, got {self.name!r}")
        if self.dtype not in DTYPES:
            raise DeclarationError(f"{self.name}: dtype {self.dtype!r} is not one of {DTYPES}")
        if not isinstance(self.shape, tuple) or any(
            type(extent) is not int or extent < 0 for extent in self.shape
        ):
            raise DeclarationError(f"{self.name}: shape must be a tuple of ints >= 0: {self.shape}")

    def describe(self) -> str:
        return describe(self.dtype, self.shape)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BufferDecl:
        name, dtype, shape = _fields(data, "buffer", ("name", "dtype", "shape"))
        if not isinstance(shape, list):
            raise DeclarationError(f"{name}: shape must be a JSON list, got {shape!r}")
        return cls(name=name, dtype=dtype, shape=tuple(shape))


@dataclass(frozen=True)
class GraphDecl:
    name: str
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise DeclarationError(f"graph name: expected a non-empty string, got {self.name!r}")
        if self.kind not in GRAPH_KINDS:
            raise DeclarationError(
                f"graph {self.name!r}: kind {self.kind!r} is not one of {GRAPH_KINDS}"
            )
        for role in ("inputs", "outputs"):
            names = getattr(self, role)
            if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
                raise DeclarationError(
                    f"graph {self.name!r}: {role} must be a tuple of buffer names, got {names!r}"
                )
            if len(set(names)) != len(names):
                raise DeclarationError(f"graph {self.name!r}: {role} repeat a buffer: {names}")

    def binds(self, buffer: str) -> bool:
        return buffer in self.inputs or buffer in self.outputs

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GraphDecl:
        name, kind, inputs, outputs = _fields(data, "graph", ("name", "kind", "inputs", "outputs"))
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise DeclarationError(f"graph {name!r}: inputs and outputs must be JSON lists")
        return cls(name=name, kind=kind, inputs=tuple(inputs), outputs=tuple(outputs))


@dataclass(frozen=True)
class CoreDeclarations:
    buffers: tuple[BufferDecl, ...]
    graphs: tuple[GraphDecl, ...]

    def __post_init__(self) -> None:
        for label, items in (("buffer", self.buffers), ("graph", self.graphs)):
            names = [item.name for item in items]
            repeated = sorted({n for n in names if names.count(n) > 1})
            if repeated:
                raise DeclarationError(f"{label} names declared more than once: {repeated}")

    def buffer(self, name: str) -> BufferDecl | None:
        return next((b for b in self.buffers if b.name == name), None)

    def declared(self, name: str) -> bool:
        return self.buffer(name) is not None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CoreDeclarations:
        buffers, graphs = _fields(data, "declarations", ("buffers", "graphs"))
        if not isinstance(buffers, list) or not isinstance(graphs, list):
            raise DeclarationError("declarations: buffers and graphs must be JSON lists")
        return cls(
            buffers=tuple(BufferDecl.from_dict(b) for b in buffers),
            graphs=tuple(GraphDecl.from_dict(g) for g in graphs),
        )

    @classmethod
    def from_json(cls, text: str) -> CoreDeclarations:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise DeclarationError(f"declarations: not valid JSON ({error})") from error
        return cls.from_dict(data)


def _fields(data: Any, label: str, keys: tuple[str, ...]) -> tuple[Any, ...]:
    if not isinstance(data, Mapping):
        raise DeclarationError(f"{label}: expected a JSON object, got {data!r}")
    missing = [key for key in keys if key not in data]
    if missing:
        raise DeclarationError(f"{label}: missing keys {missing} in {dict(data)!r}")
    return tuple(data[key] for key in keys)


@dataclass(frozen=True)
class LogprobCapabilities:
    k: int
    supports_token_ids: bool
    prompt_capacity: int = 0
    """C, the scored-prefill row capacity; 0 when the core declares no prompt scoring."""

    def __post_init__(self) -> None:
        if not 0 <= self.k <= EXPORT_K:
            raise ValueError(f"k: expected 0..{EXPORT_K}, got {self.k}")
        if self.supports_token_ids and self.k != EXPORT_K:
            raise ValueError(f"supports_token_ids requires k={EXPORT_K}, got k={self.k}")
        if self.prompt_capacity < 0:
            raise ValueError(f"prompt_capacity: expected >= 0, got {self.prompt_capacity}")
        if self.prompt_capacity and self.k != EXPORT_K:
            raise ValueError(f"prompt scoring requires K={EXPORT_K} generation logprob outputs")

    @property
    def allow_logprobs(self) -> bool:
        return self.k > 0

    @property
    def prompt_scoring(self) -> bool:
        return self.prompt_capacity > 0

    @property
    def payload_words(self) -> int:
        """Declared last extent of completion_logprobs (0 when it is not declared)."""
        if self.supports_token_ids:
            return PAYLOAD_WORDS
        return 2 + 2 * self.k if self.k else 0


def validate(
    decl: CoreDeclarations, capacity: int, token_capacity: int | None
) -> LogprobCapabilities:
    """Check a core's logprob layout; raise DeclarationError for anything malformed."""
    if capacity < 1:
        raise ValueError(f"capacity: expected >= 1, got {capacity}")
    tokens = resolve_completion_token_capacity(token_capacity)
    k, supports_token_ids = _check_generation(decl, capacity, tokens)
    _check_graphs(decl, k, supports_token_ids)
    prompt_capacity = _check_prompt(decl, k, supports_token_ids)
    return LogprobCapabilities(k, supports_token_ids, prompt_capacity)


def _mismatch(buffer: BufferDecl, expected: str) -> DeclarationError:
    return DeclarationError(f"{buffer.name}: declared {buffer.describe()}, expected {expected}")


def _check_exact(decl: CoreDeclarations, name: str, dtype: str, shape: tuple[int, ...]) -> None:
    buffer = decl.buffer(name)
    if buffer is not None and (buffer.dtype, buffer.shape) != (dtype, shape):
        raise _mismatch(buffer, describe(dtype, shape))


def _check_generation(decl: CoreDeclarations, capacity: int, tokens: int) -> tuple[int, bool]:
    frame_geometry = (FRAMES, capacity, HEADER + tokens)
    _check_exact(decl, COMPLETION_RECORDS, "int64", frame_geometry)
    declared = [name for name in GENERATION_BUFFERS if decl.declared(name)]
    if not declared:
        return 0, False
    if not decl.declared(COMPLETION_RECORDS):
        raise DeclarationError(
            f"{COMPLETION_RECORDS}: not declared, expected {describe('int64', frame_geometry)} "
            f"whenever a logprob buffer is declared (declared: {', '.join(declared)})"
        )
    ids = [name for name in ID_INPUTS if name in declared]
    missing = [name for name in GENERATION_BUFFERS if name not in declared]
    if ids and missing:
        raise DeclarationError(
            f"{', '.join(ids)}: declared without {', '.join(missing)}; a core that declares "
            f"the ID inputs must declare all five buffers"
        )
    pair = (COMPLETION_LOGPROBS, LOGPROB_REQUESTED)
    for present, absent in (pair, pair[::-1]):
        if present in declared and absent not in declared:
            raise DeclarationError(
                f"{present}: declared without {absent}; the packed output and the flag "
                f"vector are declared together"
            )
    _check_exact(decl, LOGPROB_REQUESTED, "int32", (capacity,))
    payload = decl.buffer(COMPLETION_LOGPROBS)
    assert payload is not None
    last = str(PAYLOAD_WORDS) if ids else "2+2K"
    geometry = f"int32[{FRAMES}, {capacity}, {tokens}, {last}]"
    if payload.dtype != "int32" or payload.shape[:-1] != (FRAMES, capacity, tokens):
        bound = "" if ids else f" with 1<=K<={EXPORT_K}"
        raise _mismatch(payload, f"{geometry}{bound} ({FRAMES} frames, {capacity} slots)")
    words = payload.shape[-1]
    if ids:
        if words != PAYLOAD_WORDS:
            raise _mismatch(
                payload, f"last extent {PAYLOAD_WORDS} (K={EXPORT_K}) with the ID inputs declared"
            )
        _check_exact(decl, LOGPROB_TOKEN_IDS, "int32", (capacity, MAX_TOKEN_IDS))
        _check_exact(decl, LOGPROB_TOKEN_ID_COUNTS, "int32", (capacity,))
        return EXPORT_K, True
    if words % 2 or not 1 <= (words - 2) // 2 <= EXPORT_K:
        raise _mismatch(payload, f"last extent 2+2K with 1<=K<={EXPORT_K}")
    return (words - 2) // 2, False


def _check_graphs(decl: CoreDeclarations, k: int, supports_token_ids: bool) -> None:
    flag_inputs = (LOGPROB_REQUESTED, *ID_INPUTS) if supports_token_ids else (LOGPROB_REQUESTED,)
    for graph in decl.graphs:
        label = f"graph {graph.name!r} ({graph.kind})"
        for name in CONTRACT_BUFFERS:
            if graph.binds(name) and not decl.declared(name):
                raise DeclarationError(f"{label}: binds {name}, which is not declared")
        for name in OUTPUT_ONLY_BUFFERS:
            if name in graph.inputs:
                raise DeclarationError(
                    f"{label}: binds {name} as an input, expected it among the outputs; "
                    f"the output buffer cannot be uploaded"
                )
        for name in (LOGPROB_REQUESTED, *ID_INPUTS, PROMPT_TARGET_TOKENS):
            if name in graph.outputs:
                raise DeclarationError(
                    f"{label}: binds {name} as an output, expected it among the inputs"
                )
        if k == 0:
            continue
        binds_flags = any(name in graph.inputs for name in flag_inputs)
        if graph.kind in SAMPLING_KINDS or binds_flags or COMPLETION_LOGPROBS in graph.outputs:
            missing = [name for name in flag_inputs if name not in graph.inputs]
            if missing:
                raise DeclarationError(
                    f"{label}: inputs lack {', '.join(missing)}, expected "
                    f"{', '.join(flag_inputs)}; sampling graphs bind the flag vector and, when "
                    f"the ID inputs are declared, both of them"
                )
            for name in (COMPLETION_RECORDS, COMPLETION_LOGPROBS):
                if name not in graph.outputs:
                    raise DeclarationError(
                        f"{label}: outputs lack {name}; a graph that binds the logprob flags "
                        f"writes {COMPLETION_RECORDS} and {COMPLETION_LOGPROBS}"
                    )


def _check_prompt(decl: CoreDeclarations, k: int, supports_token_ids: bool) -> int:
    present = [name for name in PROMPT_BUFFERS if decl.declared(name)]
    scored = [graph for graph in decl.graphs if graph.kind == SCORED_PREFILL]
    if not present and not scored:
        return 0
    missing = [name for name in PROMPT_BUFFERS if name not in present]
    if not scored:
        missing.append(f"a {SCORED_PREFILL} graph")
    if missing:
        found = present + [f"graph {graph.name!r}" for graph in scored]
        raise DeclarationError(
            f"prompt scoring: declared {', '.join(found)} without {', '.join(missing)}; "
            f"declare {PROMPT_LOGPROBS}, {PROMPT_TARGET_TOKENS} and a {SCORED_PREFILL} "
            f"graph, or none of them"
        )
    targets = decl.buffer(PROMPT_TARGET_TOKENS)
    assert targets is not None
    if targets.dtype != "int32" or len(targets.shape) != 1 or targets.shape[0] < 1:
        raise _mismatch(targets, "int32[C] with C >= 1")
    rows = targets.shape[0]
    _check_exact(decl, PROMPT_LOGPROBS, "int32", (FRAMES, rows, PROMPT_ROW_WORDS))
    if k != EXPORT_K:
        raise DeclarationError(
            f"{PROMPT_LOGPROBS}: prompt scoring requires K={EXPORT_K} generation logprob "
            f"outputs, declared K={k}"
        )
    for graph in decl.graphs:
        label = f"graph {graph.name!r} ({graph.kind})"
        if graph.kind != SCORED_PREFILL:
            for name in PROMPT_BUFFERS:
                if graph.binds(name):
                    raise DeclarationError(
                        f"{label}: binds {name}, expected only {SCORED_PREFILL} graphs to bind "
                        f"prompt scoring buffers"
                    )
        elif PROMPT_TARGET_TOKENS not in graph.inputs or PROMPT_LOGPROBS not in graph.outputs:
            raise DeclarationError(
                f"{label}: inputs {list(graph.inputs)}, outputs {list(graph.outputs)}, "
                f"expected {PROMPT_TARGET_TOKENS} among the inputs and {PROMPT_LOGPROBS} "
                f"among the outputs"
            )
    return rows
