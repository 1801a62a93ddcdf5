"""ranks/step/abi6.h, gate.c's copy of the record layout, against ranks/contract/abi6.py (the
definition): every #define holds the value of the Python name it copies."""

from __future__ import annotations

import re
from pathlib import Path

from helios_logprobs.ranks.contract import abi6

HEADER = Path(__file__).resolve().parents[3] / "ranks" / "step" / "abi6.h"


def header_values() -> dict[str, int]:
    return {name: int(value, 0) for name, value in
            re.findall(r"^#define\s+(\w+)\s+(\S+)$", HEADER.read_text(), flags=re.M)
            if not name.endswith("_H")}


def python_value(name: str) -> int:
    """KIND_<NAME> is abi6.Kind.<NAME>; any other define is the module constant itself."""
    if name.startswith("KIND_"):
        return int(abi6.Kind[name.removeprefix("KIND_")])
    return int(getattr(abi6, name))


def test_every_define_equals_abi6_py() -> None:
    values = header_values()
    assert values == {name: python_value(name) for name in values}


def test_the_header_defines_what_gate_c_reads() -> None:
    gate = re.sub(r"/\*.*?\*/", "", (HEADER.parent / "gate.c").read_text(), flags=re.S)
    used = {name for name in re.findall(r"\b[A-Z][A-Z0-9_]+\b", gate)
            if name not in {"NULL"}}
    assert used <= set(header_values())
    assert {"SLOT", "EPOCH", "KIND", "EMITTED", "FORCED_MASK", "FIRST_LOGIT_ROW", "HEADER",
            "KIND_SAMPLE", "KIND_SPECULATIVE"} <= used
