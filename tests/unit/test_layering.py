"""The import layering (DESIGN.md, docs/architecture.md), read from the source.

Every import statement of every module counts, function-level and TYPE_CHECKING ones included,
as do `importlib.import_module` calls with a constant name and a `torch.distributed` reached
through `import torch`. The rules:
(a) imports only point down: launch -> runtime -> ranks -> kernels -> collectives;
(b) inside ranks, contract/, sampler/, model/ and step/ never import capacity/ (it sizes them);
(c) runtime/text/ never imports runtime/engine/ or runtime/http/, runtime/http/protocol/ never
    imports runtime/http/output/, and runtime/outputs.py (what the engine sends to text and
    HTTP) imports none of the three;
(d) nothing imports the five folders by their bare names (they install under helios_logprobs
    only); only kernels/triton/ imports triton; only collectives/ imports torch.distributed or
    zmq.
No module is exempt today; an exception would be listed here with the reason.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "helios_logprobs"
LAYERS = ("launch", "runtime", "ranks", "kernels", "collectives")
"""Top to bottom."""
CLIENTS = ("tests", "bench", "scripts")
"""Folders outside the package that import it (rule d's bare names)."""


@dataclass(frozen=True)
class Import:
    source: str
    """The importing module, e.g. helios_logprobs.runtime.text.stops."""
    target: str
    """The imported module, or module.name for `from module import name`."""
    where: str
    """path:line."""
    attribute: bool = False
    """`module.name` of `from module import name`: a module or any attribute of module."""

    def within(self, *prefixes: str) -> bool:
        return _under(self.target, prefixes)

    def inside(self, *prefixes: str) -> bool:
        return _under(self.source, prefixes)

    def __str__(self) -> str:
        return f"{self.where}: {self.source} imports {self.target}"


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    prefix = [NAMESPACE] if parts[0] in LAYERS else []
    return ".".join(prefix + parts)


def _resolve(source: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = source.split(".") if is_package else source.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_in(text: str, source: str, where: str, is_package: bool = False) -> Iterator[Import]:
    """Every import of one module's source text."""
    for node in ast.walk(ast.parse(text)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(source, is_package, node)
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            targets = [node.args[0].value]
        elif isinstance(node, ast.Attribute) and node.attr == "distributed" \
                and isinstance(node.value, ast.Name) and node.value.id == "torch":
            targets = ["torch.distributed"]
        for i, target in enumerate(targets):
            yield Import(source, target, f"{where}:{node.lineno}",
                         attribute=isinstance(node, ast.ImportFrom) and i > 0)


def _is_import_module(func: ast.expr) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("import_module", "__import__")


def _modules(folders: tuple[str, ...]) -> Iterator[Path]:
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield path


def collect(folders: tuple[str, ...]) -> list[Import]:
    found = []
    for path in _modules(folders):
        found += imports_in(path.read_text(encoding="utf-8"), module_name(path),
                            str(path.relative_to(ROOT)), path.name == "__init__.py")
    return found


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) > 1 and parts[0] == NAMESPACE and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return None


def _pkg(*names: str) -> tuple[str, ...]:
    return tuple(f"{NAMESPACE}.{name}" for name in names)


def points_up(imp: Import) -> bool:
    """(a) A target in a higher layer than its source."""
    source, target = _layer(imp.source), _layer(imp.target)
    return source is not None and target is not None and target < source


def reaches_capacity(imp: Import) -> bool:
    """(b) contract, sampler, model or step import capacity."""
    return (imp.inside(*_pkg("ranks.contract", "ranks.sampler", "ranks.model", "ranks.step"))
            and imp.within(*_pkg("ranks.capacity")))


def crosses_runtime_rooms(imp: Import) -> bool:
    """(c) text -> engine/http, protocol -> output, outputs -> engine/http/text."""
    if imp.inside(*_pkg("runtime.text")):
        return imp.within(*_pkg("runtime.engine", "runtime.http"))
    if imp.inside(*_pkg("runtime.http.protocol")):
        return imp.within(*_pkg("runtime.http.output"))
    if imp.inside(*_pkg("runtime.outputs")):
        return imp.within(*_pkg("runtime.engine", "runtime.http", "runtime.text"))
    return False


def bare_name(imp: Import) -> bool:
    """(d) A folder imported by its bare name (`kernels`, `ranks.plan`, ...)."""
    return imp.target.split(".")[0] in LAYERS


def foreign_backend(imp: Import) -> bool:
    """(d) triton outside kernels/triton/; torch.distributed or zmq outside collectives/."""
    if _under(imp.target, ("triton",)):
        return not imp.inside(*_pkg("kernels.triton"))
    if _under(imp.target, ("torch.distributed", "zmq")):
        return not imp.inside(*_pkg("collectives"))
    return False


RULES: dict[str, Callable[[Import], bool]] = {
    "points up the layers": points_up,
    "a ranks room imports capacity": reaches_capacity,
    "crosses the runtime rooms": crosses_runtime_rooms,
    "imports a bare folder name": bare_name,
    "imports a backend outside its folder": foreign_backend,
}


@pytest.fixture(scope="module")
def package_imports() -> list[Import]:
    found = collect(LAYERS)
    assert len({imp.source for imp in found}) > 100  # (the walk found the package)
    return found


@pytest.fixture(scope="module")
def client_imports() -> list[Import]:
    return collect(CLIENTS)


@pytest.mark.parametrize("rule", [r for r in RULES if r != "imports a bare folder name"])
def test_package_modules_keep_the_layering(package_imports, rule):
    broken = [str(imp) for imp in package_imports if RULES[rule](imp)]
    assert not broken, f"{rule}:\n" + "\n".join(broken)


def _source_of(module: str) -> Path | None:
    """The file of a namespace module (a package's __init__.py, possibly absent), or None."""
    parts = module.split(".")
    if parts[0] != NAMESPACE or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    path = ROOT.joinpath(*parts[1:])
    if path.is_dir():
        return path / "__init__.py"
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if any(path.parent.glob(f"{path.name}.*.so")) or path.with_suffix(".c").is_file():
        return path.with_suffix(".c")  # (a compiled extension: built from its C source)
    return None


def _bound(tree: ast.Module) -> set[str] | None:
    """The names a module binds at its top level (None: a star import binds anything)."""
    names: set[str] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            if any(alias.name == "*" for alias in node.names):
                return None
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        else:
            pending += [child for child in ast.iter_child_nodes(node)
                        if isinstance(child, ast.stmt)]
    return names


def resolves(imp: Import) -> bool:
    """`import X` needs module X; `from X import name` needs module X.name or a top-level
    name of X."""
    if not imp.attribute:
        return _source_of(imp.target) is not None
    module, name = imp.target.rsplit(".", 1)
    if _source_of(imp.target) is not None:
        return True
    source = _source_of(module)
    if source is None or source.suffix != ".py" or not source.is_file():
        return False
    names = _names_of(source)
    return names is None or name in names


@functools.cache
def _names_of(source: Path) -> frozenset[str] | None:
    names = _bound(ast.parse(source.read_text(encoding="utf-8")))
    return None if names is None else frozenset(names)


def test_every_namespace_import_resolves_in_the_tree(package_imports, client_imports):
    """A moved module or name leaves no import behind, function-level ones included."""
    found = package_imports + client_imports
    stale = [str(imp) for imp in found if imp.within(NAMESPACE) and not resolves(imp)]
    assert not stale, "\n".join(stale)


@pytest.mark.parametrize(("text", "resolved"), [
    ("from helios_logprobs.ranks.capacity import buffers", True),
    ("from helios_logprobs.ranks.contract import buffers", False),
    ("from helios_logprobs.runtime.outputs import GeneratedToken", True),
    ("from helios_logprobs.runtime.engine.client import TokenLogprobs", False),
    ("import helios_logprobs.kernels.cpu.backend", True),
    ("import helios_logprobs.kernels.torch_impl.backend", False),
])
def test_a_stale_import_does_not_resolve(text, resolved):
    found = [imp for imp in imports_in(text, "tests.unit.x", "tests/unit/x.py")
             if imp.attribute or text.startswith("import")]
    assert found and all(resolves(imp) == resolved for imp in found)


def test_nothing_imports_the_bare_folder_names(package_imports, client_imports):
    broken = [str(imp) for imp in package_imports + client_imports if bare_name(imp)]
    assert not broken, "\n".join(broken)


BREACHES = [
    ("ranks/plan.py", "from helios_logprobs.runtime.engine.client import SamplingParams",
     "points up the layers"),
    ("kernels/api.py", "def f():\n    from helios_logprobs.ranks import plan\n",
     "points up the layers"),
    ("collectives/codec.py", "if TYPE_CHECKING:\n    import helios_logprobs.kernels.layout\n",
     "points up the layers"),
    ("ranks/step/inputs.py", "from helios_logprobs.ranks.capacity.buffers import x",
     "a ranks room imports capacity"),
    ("ranks/contract/core.py", "from ..capacity import sizing", "a ranks room imports capacity"),
    ("runtime/text/stops.py", "from helios_logprobs.runtime.engine.client import Finished",
     "crosses the runtime rooms"),
    ("runtime/text/detokenizer.py", "from helios_logprobs.runtime import http",
     "crosses the runtime rooms"),
    ("runtime/http/protocol/params.py", "from ..output.wire import WireMode",
     "crosses the runtime rooms"),
    ("runtime/outputs.py", "from helios_logprobs.runtime.text.stops import Chunk",
     "crosses the runtime rooms"),
    ("runtime/engine/engine.py", "from ranks.plan import StepPlan", "imports a bare folder name"),
    ("tests/unit/x.py", "import kernels.api", "imports a bare folder name"),
    ("ranks/step/reduce.py", "import triton.language as tl",
     "imports a backend outside its folder"),
    ("ranks/worker.py", "import torch.distributed as dist", "imports a backend outside its folder"),
    ("ranks/worker.py", "from torch import distributed", "imports a backend outside its folder"),
    ("ranks/worker.py", "import torch\ntorch.distributed.barrier()",
     "imports a backend outside its folder"),
    ("runtime/http/server.py", "importlib.import_module('zmq')",
     "imports a backend outside its folder"),
]


@pytest.mark.parametrize(("path", "text", "rule"), BREACHES)
def test_each_rule_catches_its_breach(path, text, rule):
    """The checks can fail: each breach, placed in a real module's file, breaks exactly the
    rule it names, and the allowed neighbours of each break none."""
    file = ROOT / path
    found = list(imports_in(text, module_name(file), path, file.name == "__init__.py"))
    assert {name for name, check in RULES.items() if any(map(check, found))} == {rule}


ALLOWED = [
    ("launch/serve.py", "from helios_logprobs.collectives.codec import encode"),
    ("runtime/engine/engine.py", "from helios_logprobs.runtime.text.reasoning import x"),
    ("runtime/http/output/wire.py", "from ..protocol.wire_mode import WireMode"),
    ("runtime/text/stops.py", "from helios_logprobs.runtime.outputs import Finished"),
    ("ranks/capacity/buffers.py", "from helios_logprobs.ranks.step import StepConfig"),
    ("kernels/triton/backend.py", "import triton"),
    ("collectives/control.py", "import zmq\nimport torch.distributed as dist"),
    ("tests/unit/x.py", "import helios_logprobs.kernels.api"),
]


@pytest.mark.parametrize(("path", "text"), ALLOWED)
def test_allowed_imports_break_no_rule(path, text):
    file = ROOT / path
    found = list(imports_in(text, module_name(file), path))
    assert found and not [name for name, check in RULES.items() if any(map(check, found))]
