"""The README is executable documentation: every fenced block in it is either run or
checked here, and no block is left out silently.

- ```python blocks run, each in a fresh namespace (each block is self-contained:
  it imports and defines every name it uses). A block that patches a framework
  must call ``patch()`` and then ``unpatch()``: the test checks both happened and
  that no framework is left patched (and unpatches it if one is, so that later
  tests see the frameworks' own functions).
- The ```python signatures block (the API listing) is compared with the real
  signatures: names, order, keyword-only split and defaults.
- ```bash blocks are checked, not run: every ``make X`` target exists in the
  Makefile, every ``python -m X`` module is importable (third-party ones: found;
  veRL's trainer needs its full requirements, which ``make test`` does not
  install), every script path exists, the veRL autopatch module named in
  ``VERL_USE_EXTERNAL_MODULES`` exists (importing it would patch veRL), and every
  line starts with a command this test knows how to check.
- ```text blocks are output or file trees: nothing to run.
- The supported-versions table's CI row matches the Makefile's and pyproject's
  pins, and the environment ``make test`` builds (checked where torch is the
  Makefile's CPU pin and Python the row's minor release: elsewhere it is another
  environment, and the test says so as a skip).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

import fastrl

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
KINDS = ("python", "python signatures", "bash", "text")
FRAMEWORKS = ("verl", "trl", "openrlhf")


def _blocks() -> list[tuple[str, str, int, str]]:
    """(info string, body, first line number, heading above) of every fenced block."""
    blocks, heading, fence = [], "top", None
    for number, line in enumerate(README.splitlines(), 1):
        if fence is None:
            if line.startswith("#") and not line.startswith("#!"):
                heading = line.lstrip("#").strip()
            elif line.lstrip().startswith("```"):
                fence = (line.strip()[3:].strip(), [], number + 1, heading, line[: len(line) - len(line.lstrip())])
        elif line.strip() == "```":
            info, body, first, where, _ = fence
            blocks.append((info, "\n".join(body) + "\n", first, where))
            fence = None
        else:
            fence[1].append(line[len(fence[4]) :])
    assert fence is None, f"README: the block opened at line {fence[2] - 1} is never closed"
    return blocks


BLOCKS = _blocks()


def _of(kind: str) -> list:
    return [
        pytest.param(body, id=f"line{first}-{re.sub(r'[^a-z0-9]+', '-', where.lower()).strip('-')}")
        for info, body, first, where in BLOCKS
        if info == kind
    ]


def test_every_block_is_of_a_kind_this_file_runs_or_checks():
    kinds = {(info, first) for info, _, first, _ in BLOCKS}
    unknown = sorted(f"line {first}: ```{info}" for info, first in kinds if info not in KINDS)
    assert not unknown, f"README blocks this test neither runs nor checks (tag them {KINDS} and handle them): {unknown}"
    assert len(_of("python")) >= 5 and len(_of("bash")) >= 3 and len(_of("python signatures")) == 1


# ---------------------------------------------------------------------------------------------
# Python snippets


def _patch_recorder(monkeypatch, framework: str, calls: list):
    """Wrap ``fastrl.integrations.<framework>``'s patch() and unpatch() so that the
    test sees what the snippet did."""
    module = importlib.import_module(f"fastrl.integrations.{framework}")
    for name in ("patch", "unpatch"):
        original = getattr(module, name)

        def recorded(*args, _original=original, _name=name, **kwargs):
            result = _original(*args, **kwargs)
            calls.append((framework, _name, result))
            return result

        monkeypatch.setattr(module, name, recorded)


@pytest.mark.parametrize("source", _of("python"))
def test_python_snippet_runs(source, monkeypatch, capsys):
    import fastrl.integrations as integrations

    assert integrations.patched() == {}, "a framework was left patched before this snippet"
    frameworks = sorted(set(re.findall(rf"fastrl\.integrations\.({'|'.join(FRAMEWORKS)})\b", source)))
    absent = [f for f in frameworks if importlib.util.find_spec(f) is None]
    if absent:  # make test installs all three; TRL needs Python >= 3.11
        pytest.skip(f"the snippet patches {absent}, not installed here")
    calls: list = []
    for framework in frameworks:
        _patch_recorder(monkeypatch, framework, calls)
    try:
        exec(compile(source, "README.md snippet", "exec"), {"__name__": "__readme__"})
    finally:
        left = integrations.patched()
        for framework in left:
            importlib.import_module(f"fastrl.integrations.{framework}").unpatch()
        if "torch.compile" in source:
            torch._dynamo.reset()
    assert not left, f"the snippet left {sorted(left)} patched: end it with unpatch()"
    for framework in frameworks:
        done = [(name, result) for fw, name, result in calls if fw == framework]
        assert [name for name, _ in done] == ["patch", "unpatch"], (framework, done)
        assert done[0][1], f"{framework}.patch() replaced nothing"
    capsys.readouterr()


# ---------------------------------------------------------------------------------------------
# The API listing


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    return [p for p in [*parts, current.strip()] if p]


def _default(text: str):
    for candidate in (text, text.split(" (")[0]):
        with contextlib.suppress(ValueError, SyntaxError):
            return ast.literal_eval(candidate)
    size = re.fullmatch(r"(\d+) (KiB|MiB|GiB)", text)
    assert size, f"a default the test cannot read: {text!r}"
    return int(size[1]) * 2 ** {"KiB": 10, "MiB": 20, "GiB": 30}[size[2]]


def _listing() -> dict[str, str]:
    """name -> the text between the parentheses of each entry of the API listing."""
    (body,) = [b for info, b, _, _ in BLOCKS if info == "python signatures"]
    entries = re.split(r"\n(?=fastrl\.)", body.strip())
    out = {}
    for entry in entries:
        name = re.match(r"fastrl\.(\w+)\(", entry)[1]
        start, depth = entry.index("("), 0
        for i, char in enumerate(entry[start:], start):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                out[name] = " ".join(entry[start + 1 : i].split())
                break
    return out


def test_api_listing_matches_the_signatures():
    listing = _listing()
    public = {n for n in fastrl.__all__ if callable(getattr(fastrl, n)) and not inspect.isclass(getattr(fastrl, n))}
    assert public - set(listing) == set(), "public functions missing from the README's API listing"
    for name, params in listing.items():
        signature = inspect.signature(getattr(fastrl, name))
        listed, keyword_only = [], False
        for item in _split_top_level(params):
            if item == "*":
                keyword_only = True
            elif item.startswith("**"):
                listed.append((None, inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty))
            else:
                pname, _, default = item.partition("=")
                kind = inspect.Parameter.KEYWORD_ONLY if keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
                listed.append((pname.strip(), kind, _default(default.strip()) if default else inspect.Parameter.empty))
        actual = [
            (None if p.kind == p.VAR_KEYWORD else p.name, p.kind, p.default) for p in signature.parameters.values()
        ]
        assert listed == actual, f"README's listing of fastrl.{name} differs from {signature}"


# ---------------------------------------------------------------------------------------------
# Shell snippets and the commands the prose names


def _makefile_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-][A-Za-z0-9_. -]*?)\s*:(?!=)", line)
        if match:
            targets.update(match[1].split())
    return targets


def _optional_dependencies() -> dict[str, str]:
    """pyproject.toml's extras: name -> the text of its list (tomllib is Python >= 3.11)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[)", text, re.M | re.S)[1]
    return dict(re.findall(r"^([\w-]+)\s*=\s*\[(.*?)\]\s*$", section, re.M | re.S))


def _extras() -> set[str]:
    return set(_optional_dependencies())


COMMANDS = {"python", "python3", "pip", "make", "torchrun", "."}


def _check_command(words: list[str], problems: list[str], line: str) -> None:
    while words and re.fullmatch(r"[A-Z_]+=\S+", words[0]):  # VAR=value prefixes
        var, _, value = words.pop(0).partition("=")
        if var == "VERL_USE_EXTERNAL_MODULES" and importlib.util.find_spec(value) is None:
            problems.append(f"{line}: no module {value}")
    if not words or words[0] not in COMMANDS:
        problems.append(f"{line}: a command this test does not check ({words[:1]})")
        return
    command, args = words[0], words[1:]
    if command == "make":
        targets = _makefile_targets()
        for target in [a for a in args if "=" not in a and not a.startswith("-")]:
            if target not in targets:
                problems.append(f"{line}: no make target {target}")
    elif command in ("python", "python3") and args[:1] == ["-m"]:
        module = args[1]
        if module.split(".")[0] in ("fastrl", "bench", "tools"):  # this tree's: imported, and runnable
            importlib.import_module(module)
            if importlib.util.find_spec(module).submodule_search_locations is not None:
                assert importlib.util.find_spec(f"{module}.__main__"), f"{line}: {module} has no __main__"
        elif importlib.util.find_spec(module) is None:
            problems.append(f"{line}: no module {module}")
    elif command == "pip" and args[:1] == ["install"]:
        for extras in re.findall(r"\.\[([\w,-]+)\]", " ".join(args)):
            for extra in extras.split(","):
                if extra not in _extras():
                    problems.append(f"{line}: no extra {extra} in pyproject.toml")


@pytest.mark.parametrize("source", _of("bash"))
def test_shell_snippet_names_only_what_exists(source):
    problems: list[str] = []
    for raw in source.splitlines():
        line = raw.split(" #")[0].strip()
        if raw.strip().startswith("#"):
            for value in re.findall(r"FASTRL_VERL_OPS=(\S+)", raw):
                from fastrl.integrations import verl

                unknown = set(value.split(",")) - set(verl.OPS)
                if unknown:
                    problems.append(f"{raw.strip()}: no veRL op {sorted(unknown)}")
            continue
        if not line:
            continue
        for command in re.split(r"\s*(?:&&|;)\s*", line):
            _check_command(command.replace('"', "").split(), problems, line)
    assert not problems, problems


def test_every_make_command_and_path_the_readme_names_exists():
    targets = _makefile_targets()
    named = {m.split()[0] for m in re.findall(r"`make ([^`=]+)`", README)}
    named |= {m for m in re.findall(r"^make ([\w-]+)", README, re.M)}
    assert named - targets == set(), f"make targets the README names that the Makefile lacks: {named - targets}"
    path = r"(?<![\w/.<-])((?:examples|bench|tests|tools|fastrl|csrc|kernels)/[\w/.-]*\.(?:py|sh|cpp|h|png|json))"
    paths = set(re.findall(path, README))
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"files the README names that do not exist: {missing}"


def test_every_link_within_the_readme_reaches_a_heading():
    """GitHub's anchors: the heading lowercased, punctuation but '-' dropped, spaces as '-'."""
    text = re.sub(r"```.*?```", "", README, flags=re.S)
    anchors = {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in text.splitlines()
        if line.startswith("#")
    }
    links = set(re.findall(r"\]\(#([^)]+)\)", README))
    assert links - anchors == set(), f"links to no heading: {sorted(links - anchors)}"


def test_no_internal_issue_numbers():
    assert not re.findall(r"\bissues? \d+", README, re.I), "say what happened, not an internal issue number"


# ---------------------------------------------------------------------------------------------
# Supported versions

COLUMNS = ("Python", "torch", "Triton", "veRL", "TRL", "OpenRLHF")
PACKAGES = {"torch": "torch", "Triton": "triton", "veRL": "verl", "TRL": "trl", "OpenRLHF": "openrlhf"}


def _ci_row() -> dict[str, str]:
    lines = README.splitlines()
    (header,) = [i for i, line in enumerate(lines) if line.startswith("| where | " + " | ".join(COLUMNS) + " |")]
    cells = None
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        row = [c.strip() for c in line.strip("|").split("|")]
        if row[0] == "CI (`make test`)":
            cells = row
    assert cells, "the supported-versions table has no CI (`make test`) row"
    return {column: re.search(r"\d+(?:\.\d+)+", cell)[0] for column, cell in zip(COLUMNS, cells[1:])}


def _makefile_variable(name: str) -> str:
    return re.search(rf"^{name}\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)[1]


def test_ci_row_names_what_the_makefile_and_pyproject_pin():
    row = _ci_row()
    assert row["torch"] == _makefile_variable("TORCH_VERSION")
    assert row["veRL"] == _makefile_variable("VERL_VERSION")
    assert row["OpenRLHF"] == _makefile_variable("OPENRLHF_VERSION")
    trl = _optional_dependencies()["trl"]
    assert re.search(rf"[\"']trl=={re.escape(row['TRL'])}[;\"']", trl), trl


def test_ci_row_is_this_environment():
    """`make test` installs torch only when it is missing, so an environment with
    another torch (the GPU image's, a user's own) is not the one the CI row
    describes, and neither is a machine whose Python is another minor release
    (make uses the machine's python3). In the environment CI builds (its Python,
    torch at the Makefile's pin, CPU build) every column must match what is
    installed: Triton is not pinned, so a new release fails here until the row
    says what CI now runs."""
    row = _ci_row()
    torch_version = torch.__version__.split("+")[0]
    if torch_version != _makefile_variable("TORCH_VERSION") or torch.version.cuda is not None:
        pytest.skip(f"torch {torch.__version__} is not the CPU build make test installs: not the CI environment")
    python = ".".join(map(str, sys.version_info[:3]))
    if python.split(".")[:2] != row["Python"].split(".")[:2]:
        pytest.skip(f"Python {python} here, the CI row says {row['Python']}: not the CI environment")
    assert python == row["Python"] or python.startswith(row["Python"] + "."), (python, row["Python"])
    assert torch_version == row["torch"]
    for column, package in PACKAGES.items():
        if column != "torch":
            assert importlib.metadata.version(package) == row[column], (package, row[column])
