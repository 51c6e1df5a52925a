"""Routes are types, not prose: no test, benchmark or service reads a route's reason or
its wording (``Route.describe``) for a substring; they compare the reason code and the
route's fields.

The walk reads every module under ``tests/``, ``tools/``, ``services/`` and ``libs/`` and
flags ``x in <obj>.reason`` / ``<obj>.describe()``, string searches on them
(``startswith``, ``find``, ``split``, ...) and ``re`` calls given them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cpd.protocol import wire

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("tests", "tools", "services", "libs")
_STRING_SEARCHES = {"startswith", "endswith", "find", "rfind", "index", "rindex", "count",
                    "split", "rsplit", "partition", "rpartition", "removeprefix",
                    "removesuffix"}
_RE_CALLS = {"search", "match", "fullmatch", "findall", "finditer", "split", "sub"}


def _is_prose(node: ast.AST) -> bool:
    """``<obj>.reason`` or ``<obj>.describe()``."""
    if isinstance(node, ast.Attribute) and node.attr == "reason":
        return True
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "describe")


def prose_reads(source: str) -> list[int]:
    """Lines of ``source`` that search a reason or a route's wording."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators, strict=True):
                if isinstance(op, ast.In | ast.NotIn) and _is_prose(right):
                    out.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            searched = f.attr in _STRING_SEARCHES and _is_prose(f.value)
            by_re = (f.attr in _RE_CALLS and isinstance(f.value, ast.Name)
                     and f.value.id == "re" and any(_is_prose(a) for a in node.args))
            if searched or by_re:
                out.append(node.lineno)
    return out


@pytest.mark.parametrize(("source", "flagged"), [
    ('assert "kvindex unavailable" in r.reason', True),
    ('assert "failover" not in final.route.reason', True),
    ("ok = d.route().describe().startswith('warm')", True),
    ("m = re.search('found', r.reason)", True),
    ("x = r.reason.split(';')", True),
    ('assert "warm" in r.describe()', True),
    ("assert r.reason is RouteReason.WARM", False),
    ("assert r.reason == RouteReason.COLD", False),
    ('assert ev.reason == "checksum"', False),
    ("log.info('x', why=r.describe())", False),
])
def test_the_rule_catches_substring_reads(source: str, flagged: bool) -> None:
    assert bool(prose_reads(source)) is flagged


def test_no_module_reads_a_reason_for_substrings() -> None:
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue  # this module's own examples
            found += [f"{path.relative_to(ROOT)}:{line}"
                      for line in prose_reads(path.read_text())]
    assert not found, found


@pytest.mark.parametrize("reason", list(wire.RouteReason))
def test_every_reason_code_has_words(reason: wire.RouteReason) -> None:
    route = wire.Route(policy="cpd", path="cold", reason=reason, reusable_tokens=10)
    assert route.describe()
    decoded = wire.decode(wire.encode(wire.Final(request_id="r", seq=1, route=route)))
    assert isinstance(decoded, wire.Final) and decoded.route.reason is reason


def named_reads(source: str) -> list[int]:
    """Lines that read a field by a name built at run time (``getattr(r, f"tokens_{t}")``):
    a typed accessor (``wire.PromptTokens.by_source``) says what exists."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "getattr" and len(node.args) >= 2
            and isinstance(node.args[1], ast.JoinedStr)]


@pytest.mark.parametrize("source, flagged", [
    ('getattr(r, f"tokens_{tier}")', True),
    ("getattr(r, 'tokens_gpu')", False),
    ("r.tokens.by_source()[wire.TokenSource.GPU]", False),
])
def test_the_rule_catches_fields_read_by_built_names(source: str, flagged: bool) -> None:
    assert bool(named_reads(source)) is flagged


def test_no_module_reads_fields_by_built_names() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}"
             for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
             if path != Path(__file__).resolve()
             for line in named_reads(path.read_text())]
    assert not found, found


def test_tokens_by_source_names_every_source() -> None:
    r = wire.Route(tokens=wire.PromptTokens(gpu=1, dram=2, remote=3, computed=4, disk=5))
    assert r.reused_tokens == 11
    assert r.tokens.by_source() == {wire.TokenSource.GPU: 1, wire.TokenSource.DRAM: 2,
                                    wire.TokenSource.DISK: 5, wire.TokenSource.REMOTE: 3,
                                    wire.TokenSource.COMPUTED: 4}
    assert set(r.tokens.by_source()) == set(wire.TokenSource)
