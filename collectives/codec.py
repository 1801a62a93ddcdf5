"""The one msgpack encoder/decoder for control-plane messages.

Packages above ``collectives`` define their own frozen dataclass messages and register them
with a tag (``@message("step_plan")``); ``encode`` turns a registered message into bytes and
``decode`` turns bytes back into an equal message. Supported field values: None, bool, int of
any size, float (bit-exact, NaN payloads and -0.0 included), str, bytes, lists, tuples, dicts,
registered dataclasses and enums, torch tensors and numpy arrays of numeric or bool dtype
(dtype + shape + raw bytes, bit-exact) and numpy scalars.

Wire format: every non-msgpack value is an ``ExtType`` whose data is itself msgpack:
dataclass ``[tag, [init field values...]]``, tuple ``[items...]``, enum ``[tag, value]``,
tensor ``[dtype, shape, bytes]``, ndarray/numpy scalar ``[dtype.str, shape, bytes]``, big int
``signed little-endian bytes``. A top-level payload is always one registered dataclass.
Anything else (an unknown tag, a truncated or extra byte, a wrong arity, a value a message's
``__post_init__`` rejects) raises ``CodecError``; a failed decode leaves no state behind.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack
import numpy as np
import torch

T = TypeVar("T")

_DATACLASS, _TUPLE, _ENUM, _TENSOR, _NDARRAY, _NPSCALAR, _BIGINT = range(1, 8)
_INT64_MIN, _UINT64_MAX = -(1 << 63), (1 << 64) - 1

_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
    )
}
_NUMPY_KINDS = frozenset("biuf")


class CodecError(ValueError):
    """A value that cannot be encoded, or bytes that are not a valid registered message."""


class _Registry:
    def __init__(self) -> None:
        self.by_tag: dict[str, type] = {}
        self.tag_of: dict[type, str] = {}
        self.fields: dict[type, tuple[str, ...]] = {}

    def add(self, cls: type, tag: str) -> None:
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"codec: tag must be a non-empty str, got {tag!r}")
        is_enum = isinstance(cls, type) and issubclass(cls, enum.Enum)
        if not is_enum and not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"codec: {cls!r} is neither a dataclass nor an Enum")
        old = self.by_tag.get(tag)
        if old is not None and old is not cls and _qualname(old) != _qualname(cls):
            raise ValueError(f"codec: tag {tag!r} already registered to {_qualname(old)}")
        if self.tag_of.get(cls, tag) != tag:
            raise ValueError(f"codec: {_qualname(cls)} already registered as {self.tag_of[cls]!r}")
        self.by_tag[tag] = cls
        self.tag_of[cls] = tag
        if not is_enum:
            self.fields[cls] = tuple(f.name for f in dataclasses.fields(cls) if f.init)


_REGISTRY = _Registry()


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register(cls: type[T], tag: str) -> type[T]:
    """Register a dataclass (a message or a nested value) or an Enum under ``tag``."""
    _REGISTRY.add(cls, tag)
    return cls


def message(tag: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: ``@message("step_plan")`` above ``@dataclass(frozen=True)``."""
    return lambda cls: register(cls, tag)


def registered_tag(cls: type) -> str | None:
    return _REGISTRY.tag_of.get(cls)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)


def _default(obj: Any) -> msgpack.ExtType:
    kind = type(obj)
    if kind is tuple:
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    if kind is int:  # only out-of-range ints reach here
        width = (obj.bit_length() + 8) // 8
        return msgpack.ExtType(_BIGINT, obj.to_bytes(width, "little", signed=True))
    tag = _REGISTRY.tag_of.get(kind)
    if isinstance(obj, enum.Enum):
        if tag is None:
            raise CodecError(f"unregistered enum {_qualname(kind)}: register it with @message")
        return msgpack.ExtType(_ENUM, _pack([tag, obj.value]))
    if dataclasses.is_dataclass(obj):
        if tag is None:
            raise CodecError(f"unregistered dataclass {_qualname(kind)}: decorate with @message")
        values = [getattr(obj, name) for name in _REGISTRY.fields[kind]]
        return msgpack.ExtType(_DATACLASS, _pack([tag, values]))
    if isinstance(obj, torch.Tensor):
        name = str(obj.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise CodecError(f"tensor dtype {obj.dtype} is not supported")
        flat = obj.detach().to("cpu").contiguous().reshape(-1)
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return msgpack.ExtType(_TENSOR, _pack([name, list(obj.shape), raw]))
    if isinstance(obj, np.ndarray | np.generic) and np.asarray(obj).dtype.kind in _NUMPY_KINDS:
        arr = np.asarray(obj)
        code = _NPSCALAR if isinstance(obj, np.generic) else _NDARRAY
        return msgpack.ExtType(code, _pack([arr.dtype.str, list(arr.shape), arr.tobytes()]))
    if isinstance(obj, bool | int | float | str | bytes | list | dict):  # subclasses
        return _plain(obj)
    if isinstance(obj, bytearray | memoryview):
        return bytes(obj)
    if isinstance(obj, np.ndarray):
        raise CodecError(f"numpy dtype {obj.dtype} is not supported")
    raise CodecError(f"cannot encode a value of type {_qualname(kind)}")


def _plain(obj: Any) -> Any:
    for base in (bool, int, float, str, bytes, list, dict):
        if isinstance(obj, base):
            return base(obj)
    raise AssertionError(obj)  # pragma: no cover


def encode(msg: Any) -> bytes:
    """Serialize one registered dataclass message."""
    if type(msg) not in _REGISTRY.fields:
        raise CodecError(f"not a registered message: {_qualname(type(msg))}")
    try:
        return _pack(msg)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"cannot encode {_qualname(type(msg))}: {exc}") from exc


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(
        data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True
    )


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _BIGINT:
        return int.from_bytes(data, "little", signed=True)
    body = _unpack(data)
    if code == _TUPLE:
        return tuple(_expect(body, list, "tuple"))
    if code in (_DATACLASS, _ENUM):
        tag, value = _expect(body, list, "message", 2)
        cls = _REGISTRY.by_tag.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise CodecError(f"unknown message tag {tag!r}")
        names = _REGISTRY.fields.get(cls)
        if (code == _ENUM) != (names is None):
            raise CodecError(f"tag {tag!r} names the wrong kind of class ({_qualname(cls)})")
        if names is None:
            return cls(value)
        values = _expect(value, list, f"fields of {tag!r}", len(names))
        return cls(**dict(zip(names, values, strict=True)))
    if code in (_TENSOR, _NDARRAY, _NPSCALAR):
        dtype_name, shape, raw = _expect(body, list, "array", 3)
        if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
            raise CodecError(f"bad array shape {shape!r}")
        if not isinstance(raw, bytes):
            raise CodecError("array data must be bytes")
        if code == _TENSOR:
            return _tensor(dtype_name, shape, raw)
        dtype = np.dtype(dtype_name)
        if dtype.kind not in _NUMPY_KINDS:
            raise CodecError(f"numpy dtype {dtype} is not supported")
        _check_size(shape, dtype.itemsize, raw)
        arr = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
        return arr[()] if code == _NPSCALAR else arr
    raise CodecError(f"unknown extension code {code}")


def _tensor(dtype_name: Any, shape: list[int], raw: bytes) -> torch.Tensor:
    dtype = _TORCH_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise CodecError(f"unsupported tensor dtype {dtype_name!r}")
    _check_size(shape, torch.empty((), dtype=dtype).element_size(), raw)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _check_size(shape: list[int], itemsize: int, raw: bytes) -> None:
    if math.prod(shape) * itemsize != len(raw):
        raise CodecError(f"array of shape {shape} needs {math.prod(shape) * itemsize} bytes, "
                         f"got {len(raw)}")


def _expect(value: Any, kind: type, what: str, length: int | None = None) -> Any:
    if not isinstance(value, kind) or (length is not None and len(value) != length):
        size = "" if length is None else f" of length {length}"
        raise CodecError(f"malformed {what}: expected {kind.__name__}{size}, got {value!r:.80}")
    return value


def decode(data: bytes | bytearray | memoryview) -> Any:
    """Parse one registered message; ``CodecError`` for anything else."""
    try:
        msg = _unpack(bytes(data))
    except CodecError:
        raise
    except Exception as exc:  # msgpack, UnicodeDecodeError, a message's __post_init__, ...
        raise CodecError(f"malformed message ({type(exc).__name__}: {exc})") from exc
    if type(msg) not in _REGISTRY.fields:
        raise CodecError(f"payload is not a registered message: {msg!r:.80}")
    return msg


__all__ = ["CodecError", "decode", "encode", "message", "register", "registered_tag"]
