"""The import contract: each folder of the tree is one layer, and lower layers never import
higher ones (docs/architecture.md, "Layers").

The walk reads every import statement of every module (inside functions and
``TYPE_CHECKING`` blocks too) and resolves relative imports, so a lazy import against the
direction fails like a top-level one.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (package, rank), bottom to top. A module may import its own package and packages of
# lower rank; packages of equal rank never import each other.
LAYERS: tuple[tuple[str, int], ...] = (
    ("cpd._hashchain", 0),  # the native block-hash extension
    ("cpd.protocol", 1),
    ("cpd.modelbuild", 2),
    ("cpd.sim", 2),
    ("cpd.ops", 3),
    ("cpd.bus", 4),
    ("cpd.kvstore", 5),
    ("cpd.client", 5),
    ("cpd.apiclient", 5),  # the HTTP client of the OpenAI-compatible API
    ("cpd.transfer", 6),
    ("cpd.engines", 7),
    ("services", 8),
    ("tools", 9),
)

# Where each top-level package's sources are.
SOURCES: dict[str, str] = {"cpd": "libs/cpd", "services": "services", "tools": "tools"}


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.imported} ({self.why})"


def layer_of(module: str, layers: tuple[tuple[str, int], ...] = LAYERS
             ) -> tuple[str, int] | None:
    """The layer a dotted module name belongs to (longest package prefix), else None."""
    best: tuple[str, int] | None = None
    for package, rank in layers:
        if (module == package or module.startswith(package + ".")) and (
                best is None or len(package) > len(best[0])):
            best = (package, rank)
    return best


def _modules(root: Path, sources: dict[str, str]) -> list[tuple[str, Path]]:
    out = []
    for top, folder in sources.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = [top, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append((".".join(parts), path))
    return out


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, dotted target) of every import in ``path``; ``from X import y`` yields
    ``X.y`` so importing a submodule by name counts as importing it."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return out


def violations(root: Path = ROOT, layers: tuple[tuple[str, int], ...] = LAYERS,
               sources: dict[str, str] = SOURCES) -> list[Violation]:
    """Every import of the tree at ``root`` against the layer order."""
    found: list[Violation] = []
    for module, path in _modules(root, sources):
        own = layer_of(module, layers)
        if own is None:
            if module != "cpd":  # the root package re-exports nothing
                found.append(Violation(module, 0, "-", "module outside every layer"))
            continue
        for line, target in _imports(module, path):
            theirs = layer_of(target, layers)
            if theirs is None or theirs[0] == own[0]:
                continue
            if theirs[1] > own[1]:
                found.append(Violation(module, line, target,
                                       f"{own[0]} (rank {own[1]}) is below {theirs[0]} "
                                       f"(rank {theirs[1]})"))
            elif theirs[1] == own[1]:
                found.append(Violation(module, line, target,
                                       f"{own[0]} and {theirs[0]} are the same layer"))
    return found


def test_the_tree_keeps_the_layer_order() -> None:
    found = violations()
    assert not found, "\n".join(map(str, found))


def test_every_library_folder_is_a_layer() -> None:
    packages = {p.name for p in (ROOT / "libs" / "cpd").iterdir()
                if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in (ROOT / "libs" / "cpd").glob("*.py") if p.stem != "__init__"}
    named = {package.split(".")[1] for package, _ in LAYERS if package.startswith("cpd.")}
    assert packages | modules <= named, sorted((packages | modules) - named)


def _tree(tmp: Path, files: dict[str, str]) -> Path:
    for rel, text in {"libs/cpd/__init__.py": "", **files}.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for rel in files:  # every folder on the way is a package
        folder = (tmp / rel).parent
        while folder != tmp and folder.name not in ("libs",):
            (folder / "__init__.py").touch()
            folder = folder.parent
    return tmp


@pytest.mark.parametrize(("files", "expected"), [
    pytest.param({"libs/cpd/protocol/wire.py": "import msgspec\n",
                  "libs/cpd/bus/request.py": "from cpd.protocol import wire\n",
                  "services/router/service.py": "from cpd.bus import request\n"},
                 [], id="downward imports are fine"),
    pytest.param({"libs/cpd/protocol/wire.py": "from cpd.bus.request import Bus\n",
                  "libs/cpd/bus/request.py": ""},
                 [("cpd.protocol.wire", "cpd.bus.request.Bus")], id="absolute, upward"),
    pytest.param({"libs/cpd/protocol/wire.py": "def f():\n    from ..ops import config\n",
                  "libs/cpd/ops/config.py": ""},
                 [("cpd.protocol.wire", "cpd.ops.config")], id="relative and lazy, upward"),
    pytest.param({"libs/cpd/kvstore/store.py": "from cpd import client\n",
                  "libs/cpd/client.py": ""},
                 [("cpd.kvstore.store", "cpd.client")], id="same rank, other package"),
    pytest.param({"libs/cpd/engines/profile.py": "import services.worker\n",
                  "services/worker/__init__.py": ""},
                 [("cpd.engines.profile", "services.worker")], id="library imports a service"),
    pytest.param({"services/router/service.py": "from tools.bench import router\n",
                  "tools/bench/router.py": ""},
                 [("services.router.service", "tools.bench.router")], id="service imports a tool"),
])
def test_a_wrong_way_import_in_a_synthetic_tree_is_found(
        tmp_path: Path, files: dict[str, str], expected: list[tuple[str, str]]) -> None:
    found = violations(_tree(tmp_path, files))
    assert [(v.module, v.imported) for v in found] == expected


def test_a_module_outside_every_layer_is_reported(tmp_path: Path) -> None:
    found = violations(_tree(tmp_path, {"libs/cpd/gadgets.py": "import os\n"}))
    assert [(v.module, v.why) for v in found] == [("cpd.gadgets", "module outside every layer")]


def test_the_readme_layout_table_matches_the_tree() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Layout"):readme.index("## Settings")]
    paths = re.findall(r"^\| `([^`]+)`", table, re.M)
    missing = [p for p in paths if not (ROOT / p.split(",")[0]).exists()]
    assert not missing, missing
    folders = {package.split(".")[1] for package, _ in LAYERS if package.startswith("cpd.")}
    layers = {f"libs/cpd/{f}/" for f in folders if (ROOT / "libs" / "cpd" / f).is_dir()}
    listed = set(paths)
    assert layers <= listed, sorted(layers - listed)
    assert {"services/", "tools/", "tests/"} <= listed
