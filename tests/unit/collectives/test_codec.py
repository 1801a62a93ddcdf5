from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass, field

import msgpack
import numpy as np
import pytest
import torch

from helios_logprobs.collectives.codec import CodecError, decode, encode, message, register


@message("test.codec.color")
class Color(enum.Enum):
    RED = "red"
    BLUE = 2


@message("test.codec.kind")
class Kind(enum.IntEnum):
    SAMPLE = 1
    SPEC = 2


@message("test.codec.inner")
@dataclass(frozen=True)
class Inner:
    name: str
    values: tuple[float, ...] = ()


@message("test.codec.outer")
@dataclass(frozen=True)
class Outer:
    submission: int
    inner: Inner
    items: list[Inner] = field(default_factory=list)
    table: dict = field(default_factory=dict)
    kind: Kind = Kind.SAMPLE
    color: Color | None = None
    blob: bytes = b""
    extra: object = None


@message("test.codec.tensors")
@dataclass(frozen=True, eq=False)
class Tensors:
    a: torch.Tensor
    b: np.ndarray | None = None


@message("test.codec.checked")
@dataclass(frozen=True)
class Checked:
    n: int
    doubled: int = field(init=False)

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError("n must be >= 0")
        object.__setattr__(self, "doubled", 2 * self.n)


@dataclass(frozen=True)
class Unregistered:
    x: int


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def test_nested_round_trip_keeps_types():
    msg = Outer(
        submission=7,
        inner=Inner("a", (1.0, 2.5)),
        items=[Inner("b"), Inner("c", (3.0,))],
        table={1: "one", "two": (2, 2), (3, 4): [Inner("d")], None: {b"k": True}},
        kind=Kind.SPEC,
        color=Color.BLUE,
        blob=b"\x00\xff",
        extra=[(1, [2, (3,)]), {"x": None}],
    )
    out = decode(encode(msg))
    assert out == msg
    assert type(out.inner.values) is tuple and type(out.items) is list
    assert out.kind is Kind.SPEC and out.color is Color.BLUE
    assert type(out.extra[0]) is tuple and type(out.extra[0][1][1]) is tuple


@pytest.mark.parametrize(
    "value",
    [0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**64) - 1, 2**200 + 17, -(3**150)],
)
def test_big_ints(value):
    out = decode(encode(Outer(value, Inner("i"))))
    assert out.submission == value and type(out.submission) is int


def test_special_floats_bit_exact():
    nan_payload = struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0]
    values = (math.nan, -math.nan, nan_payload, -0.0, 0.0, math.inf, -math.inf, 5e-324, 1e308)
    out = decode(encode(Inner("f", values))).values
    assert [_bits(v) for v in out] == [_bits(v) for v in values]


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int32,
        torch.int64,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.bool,
    ],
)
def test_tensor_bit_exact(dtype):
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (3, 5, 8), dtype=torch.uint8, generator=gen)
    t = raw.view(dtype) if dtype != torch.bool else raw % 2 == 1
    out = decode(encode(Tensors(t))).a
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out.view(torch.uint8), t.contiguous().view(torch.uint8))


def test_tensor_special_values_and_layouts():
    specials = torch.tensor([math.nan, -0.0, math.inf, -math.inf, 1.0], dtype=torch.float32)
    nan_bits = torch.tensor([0x7FC00001, -1], dtype=torch.int32).view(torch.float32)
    for t in (
        specials,
        nan_bits,
        torch.arange(12.0).reshape(3, 4).t(),
        torch.tensor(3.5),
        torch.empty(0, 4, dtype=torch.int32),
        torch.ones(2, requires_grad=True),
    ):
        out = decode(encode(Tensors(t))).a
        assert out.shape == t.shape and out.dtype == t.dtype and not out.requires_grad
        assert torch.equal(
            out.reshape(-1).view(torch.uint8), t.detach().contiguous().reshape(-1).view(torch.uint8)
        )
    out = decode(encode(Tensors(torch.zeros(3)))).a
    out += 1  # writable, owns its memory


def test_numpy_arrays_and_scalars():
    arr = np.array([[np.nan, -0.0], [np.inf, 2.0]], dtype=np.float32)
    ints = np.arange(-5, 5, dtype=np.int64).reshape(2, 5)
    out = decode(encode(Tensors(torch.zeros(1), arr)))
    assert out.b.dtype == arr.dtype and out.b.tobytes() == arr.tobytes()
    out = decode(encode(Outer(1, Inner("n"), extra=[ints, np.float32(-0.0), np.bool_(True)])))
    assert np.array_equal(out.extra[0], ints) and out.extra[0].dtype == np.int64
    assert type(out.extra[1]) is np.float32 and _bits(out.extra[1]) == _bits(-0.0)
    assert type(out.extra[2]) is np.bool_ and out.extra[2]


def test_init_false_fields_recomputed_and_validation_is_codec_error():
    assert decode(encode(Checked(4))).doubled == 8
    bad = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["test.codec.checked", [-1]])))
    with pytest.raises(CodecError, match="n must be"):
        decode(bad)


def _ext(code: int, body: object) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, msgpack.packb(body)))


@pytest.mark.parametrize(
    "payload, match",
    [
        (b"", "malformed"),
        (b"\xc1", "malformed"),
        (b"garbage that is not msgpack\xff", "malformed"),
        (encode(Inner("x"))[:-1], "malformed"),
        (encode(Inner("x")) + b"\x00", "malformed"),
        (msgpack.packb([1, 2, 3]), "not a registered message"),
        (_ext(1, ["no.such.tag", []]), "unknown message tag 'no.such.tag'"),
        (_ext(1, ["test.codec.inner", ["x", [], "too many"]]), "fields of"),
        (_ext(1, ["test.codec.inner"]), "malformed message"),
        (_ext(1, ["test.codec.color", ["red"]]), "wrong kind"),
        (_ext(3, ["test.codec.color", "green"]), "malformed"),
        (_ext(99, []), "unknown extension code 99"),
        (
            _ext(
                1,
                [
                    "test.codec.tensors",
                    [msgpack.ExtType(4, msgpack.packb(["float32", [4], b"\x00" * 15]))],
                ],
            ),
            "needs 16 bytes",
        ),
        (
            _ext(
                1,
                [
                    "test.codec.tensors",
                    [msgpack.ExtType(4, msgpack.packb(["complex64", [1], b"\x00" * 8]))],
                ],
            ),
            "unsupported tensor dtype",
        ),
        (
            _ext(
                1,
                ["test.codec.tensors", [msgpack.ExtType(4, msgpack.packb(["float32", [-1], b""]))]],
            ),
            "bad array shape",
        ),
        (
            _ext(
                1,
                [
                    "test.codec.tensors",
                    [0, msgpack.ExtType(5, msgpack.packb(["|O", [1], b"\x00" * 8]))],
                ],
            ),
            "not supported",
        ),
        (b"\xd4\x01\xff", "malformed"),
    ],
)
def test_malformed_payloads_raise_codec_error(payload, match):
    with pytest.raises(CodecError, match=match):
        decode(payload)


def test_encode_rejects_unsupported_values():
    with pytest.raises(CodecError, match="not a registered message"):
        encode(Unregistered(1))
    with pytest.raises(CodecError, match="unregistered dataclass"):
        encode(Outer(1, Unregistered(2)))  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="cannot encode"):
        encode(Outer(1, Inner("x"), extra={1, 2}))
    with pytest.raises(CodecError, match="not supported"):
        encode(Tensors(torch.zeros(2, dtype=torch.complex64)))
    with pytest.raises(CodecError, match="unregistered enum"):
        encode(Outer(1, Inner("x"), extra=enum.Enum("Tmp", "A").A))


def test_registration_conflicts():
    with pytest.raises(ValueError, match="already registered"):
        register(Unregistered, "test.codec.inner")
    with pytest.raises(TypeError, match="neither a dataclass"):
        register(int, "test.codec.int")
    register(Inner, "test.codec.inner")  # idempotent
    with pytest.raises(ValueError, match="already registered as"):
        register(Inner, "test.codec.inner2")
