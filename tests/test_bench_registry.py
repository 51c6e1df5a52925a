"""``cpd bench NAME``: one subcommand per registered benchmark, each with its own flags
only (tools/bench/registry.py). Parsing only: nothing here runs a benchmark."""

from __future__ import annotations

import argparse
import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.registry import BENCHMARKS
from tools.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent

# Each benchmark's flags as docs/benchmarks/ documents them; every subcommand also has
# the common --json.
FLAGS: dict[str, set[str]] = {
    "hashing": {"--tokens", "--block-size", "--repeat"},
    "kvindex": {"--quick", "--blocks"},
    "transfer": {"--quick", "--peer-prefix", "--nats-host"},
    "model": {"--preset", "--tokens"},
    "ttft": {"--quick"},
    "client": {"--quick", "--contexts", "--iterations"},
    "serve": {"--quick"},
    "workingset": {"--quick", "--configs", "--ratios", "--engine-blocks", "--session-tokens",
                   "--concurrency"},
    "router": {"--quick", "--blocks"},
    "sweep": {"--quick", "--workload", "--trace", "--preset", "--time-scale", "--qps",
              "--ramp-s", "--steady-s", "--settle-s", "--topologies", "--stop-after",
              "--out"},
    "faults": {"--quick", "--scenarios", "--concurrency", "--duration-s"},
    "plan": {"--quick", "--jobs", "--fidelity", "--sweep-json", "--waves", "--services"},
    "fuzz": {"--cases", "--seed"},
    "soak": {"--minutes", "--concurrency", "--fault-every"},
}

# (command line after `cpd bench`, attributes it must parse to)
PARSES: list[tuple[str, dict[str, object]]] = [
    ("hashing", {"tokens": None, "block_size": 256, "repeat": 200, "json": None}),
    ("hashing --tokens 1000 --block-size 64 --repeat 5 --json out/h.json",
     {"tokens": 1000, "block_size": 64, "repeat": 5, "json": "out/h.json"}),
    ("kvindex", {"quick": False, "blocks": None}),
    ("kvindex --quick --blocks 20000 --json k.json",
     {"quick": True, "blocks": 20000, "json": "k.json"}),
    ("transfer", {"quick": False, "peer_prefix": None, "nats_host": "127.0.0.1"}),
    ("transfer --quick --peer-prefix 'ip netns exec h2' --nats-host 10.0.0.3",
     {"quick": True, "peer_prefix": "ip netns exec h2", "nats_host": "10.0.0.3"}),
    ("model", {"preset": None, "tokens": None}),
    ("model --preset small --tokens 4096", {"preset": "small", "tokens": 4096}),
    ("ttft --quick --json t.json", {"quick": True, "json": "t.json"}),
    ("client --quick", {"quick": True, "contexts": None, "iterations": None}),
    ("client --quick --contexts 1024 4096 --iterations 10",
     {"quick": True, "contexts": [1024, 4096], "iterations": 10}),
    ("serve --quick --json s.json", {"quick": True, "json": "s.json"}),
    ("router --quick --blocks 20000", {"quick": True, "blocks": 20000}),
    ("workingset", {"quick": False, "configs": None, "ratios": None, "engine_blocks": None,
                    "session_tokens": 2048, "concurrency": 2}),
    ("workingset --configs cpd cpd_disk --ratios 2 8 --engine-blocks 96 --session-tokens 4096 "
     "--concurrency 4 --json w.json",
     {"configs": ["cpd", "cpd_disk"], "ratios": [2.0, 8.0], "engine_blocks": 96,
      "session_tokens": 4096, "concurrency": 4, "json": "w.json"}),
    ("sweep", {"quick": False, "workload": "coding-agent", "trace": None, "preset": None,
               "time_scale": None, "qps": None, "stop_after": None, "out": None}),
    ("sweep --quick --workload mooncake --trace t.jsonl --preset b200-tp4-llama-3.1-8b-fp8 "
     "--time-scale 0.5 --qps 0.4,0.8 --ramp-s 1 --settle-s 2 --steady-s 4 "
     "--topologies '2P1D pd-rr,CPD-1D' --stop-after 1 --out o --json o/s.json",
     {"quick": True, "workload": "mooncake", "trace": "t.jsonl",
      "preset": "b200-tp4-llama-3.1-8b-fp8", "time_scale": 0.5, "qps": "0.4,0.8",
      "ramp_s": 1.0, "settle_s": 2.0, "steady_s": 4.0, "topologies": "2P1D pd-rr,CPD-1D",
      "stop_after": 1, "out": "o", "json": "o/s.json"}),
    ("faults", {"quick": False, "scenarios": None, "concurrency": None,
                "duration_s": None}),
    ("faults --quick --scenarios a,b --concurrency 60 --duration-s 14",
     {"quick": True, "scenarios": "a,b", "concurrency": 60, "duration_s": 14.0}),
    ("plan --waves --services --json w.json",
     {"waves": True, "services": True, "quick": False, "fidelity": False, "json": "w.json"}),
    ("fuzz", {"cases": 10_000, "seed": 0}),
    ("fuzz --cases 200 --seed 3", {"cases": 200, "seed": 3}),
    ("soak", {"minutes": 30.0, "concurrency": 100, "fault_every": 4}),
    ("soak --minutes 2 --concurrency 40 --fault-every 2",
     {"minutes": 2.0, "concurrency": 40, "fault_every": 2}),
]


def _parse(line: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *shlex.split(line)])


def _subparser(name: str) -> argparse.ArgumentParser:
    bench = next(a for a in build_parser()._actions
                 if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    names = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    return names.choices[name]


def _declared(name: str) -> dict[str, argparse.Action]:
    """The flags ``cpd bench name`` declares, beyond -h and the common --json."""
    parser = _subparser(name)
    parser.format_usage()  # adds the benchmark's flags
    return {s: a for a in parser._actions for s in a.option_strings
            if s.startswith("--") and s not in ("--help", "--json")}


def test_the_registry_is_every_module_that_declares_its_arguments() -> None:
    declaring = set()
    for path in sorted((ROOT / "tools" / "bench").glob("*.py")):
        defined = {n.name for n in ast.parse(path.read_text()).body
                   if isinstance(n, ast.FunctionDef)}
        if "add_arguments" in defined:
            assert "run_args" in defined, path
            declaring.add(f"tools.bench.{path.stem}")
    assert {b.module for b in BENCHMARKS.values()} == declaring
    assert all(b.module == f"tools.bench.{name}" for name, b in BENCHMARKS.items())
    assert set(FLAGS) == set(BENCHMARKS)


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_each_benchmark_declares_its_documented_flags(name: str) -> None:
    assert set(_declared(name)) == FLAGS[name]
    usage = _subparser(name).format_usage()
    assert set(re.findall(r"--[a-z][a-z-]*", usage)) == FLAGS[name] | {"--json"}


@pytest.mark.parametrize(("line", "expected"), PARSES, ids=[p[0] for p in PARSES])
def test_documented_command_lines_parse(line: str, expected: dict[str, object]) -> None:
    args = _parse(line)
    assert args.func.__name__ == "cmd_bench" and args.what == line.split()[0]
    assert {k: getattr(args, k) for k in expected} == expected


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_client_iterations_below_one_are_refused(value: str) -> None:
    with pytest.raises(SystemExit):
        _parse(f"client --iterations {value}")


def _foreign() -> list[tuple[str, tuple[str, ...]]]:
    """(benchmark, a flag of another benchmark that it does not declare, with a value
    where the other benchmark's flag takes one)."""
    out: set[tuple[str, tuple[str, ...]]] = set()
    for other in BENCHMARKS:
        for flag, action in _declared(other).items():
            value = () if action.nargs == 0 else (
                str(next(iter(action.choices))) if action.choices else "1",)
            out |= {(name, (flag, *value)) for name in BENCHMARKS if flag not in FLAGS[name]}
    return sorted(out)


@pytest.mark.parametrize(("name", "flag"), _foreign())
def test_a_flag_of_another_benchmark_is_refused(name: str, flag: tuple[str, ...],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["bench", name, *flag])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"cpd bench {name}: error: unrecognized arguments: {flag[0]}" in err, err


def test_bench_help_lists_every_benchmark_and_no_benchmark_flags(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name, b in BENCHMARKS.items():
        assert re.search(rf"^\s+{name}\s+{re.escape(b.help.split()[0])}", out, re.M), name
    assert not set(re.findall(r"--[a-z][a-z-]*", out)) - {"--help"}, out


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_help_lists_its_own_flags_only(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    options = set(re.findall(r"^\s+(--[a-z][a-z-]*)", out, re.M))
    assert options == FLAGS[name] | {"--json"}


def test_a_benchmark_is_imported_only_when_its_subcommand_is_used() -> None:
    """Building the parser imports no benchmark module of its own accord; ``cpd bench
    hashing`` imports hashing and none of the heavy dependencies of the others."""
    probe = (
        "import sys\n"
        "from tools.cli import build_parser\n"
        "parser = build_parser()\n"
        "before = set(sys.modules)\n"
        "parser.parse_args(['bench', 'hashing'])\n"
        "print(' '.join(sorted(m for m in set(sys.modules) - before"
        " if m.startswith(('tools', 'services', 'torch', 'vllm', 'ucxx', 'openai')))))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["tools.bench.hashing"]


def _documented_commands() -> list[tuple[str, str]]:
    """``(where, command line after `cpd bench`)`` of every ``cpd bench NAME ...`` in the
    README, docs/, the Makefile and the CI script: fenced or indented lines (with their
    ``\\`` continuations) and inline code spans; synopses with ``[...]`` or ``a|b``
    placeholders are left out."""
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / ".ci" / "run",
             *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "scripts").glob("*"))]
    found = []
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text().replace("\\\n", " ")
        spans = [s.replace("\n", " ") for s in re.findall(r"`([^`]*cpd bench [^`]*)`", text)]
        for span in [*spans, *(line for line in text.splitlines() if "`" not in line)]:
            for m in re.finditer(r"cpd bench (\w+)(?=\s|$)([^`\n]*)", span):
                rest = m.group(2).split(" #")[0]
                if "[" in rest or "|" in rest or m.group(1) not in BENCHMARKS:
                    continue
                line = " ".join(f"{m.group(1)}{rest}".split())
                found.append((path.relative_to(ROOT).as_posix(), line))
    return sorted(set(found))


def test_every_command_line_in_the_docs_parses() -> None:
    commands = _documented_commands()
    assert {line.split()[0] for _, line in commands} == set(BENCHMARKS)
    for where, line in commands:
        if line.endswith(" --json"):  # prose naming the flag (`cpd bench sweep --json`)
            line += " PATH"
        try:
            _parse(line)
        except SystemExit:
            pytest.fail(f"{where}: `cpd bench {line}` does not parse")
