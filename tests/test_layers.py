"""The layers of DESIGN.md hold in the source: no import circle in fastrl/ (imports inside
functions included), nothing in kernels/ imports the API layer, and the two kernel backends
offer every launcher the API layer calls with one signature (fastrl._ops.LAUNCHERS)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re

import fastrl._native
import fastrl._ops

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _imports(path: pathlib.Path, package: str) -> set[str]:
    """The fastrl modules ``path`` (module ``package``.stem, or the package itself for an
    __init__.py) imports anywhere in its body, as dotted names; ``from m import x`` counts as
    m and, where x is a module, m.x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == "fastrl" or name.startswith("fastrl.")}


def _fastrl_modules() -> dict[str, set[str]]:
    """Every module of the installed-package sources under fastrl/ -> the fastrl modules it imports."""
    modules = {}
    for path in sorted((ROOT / "fastrl").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if parts[-1] == "__init__" else name.rpartition(".")[0]
        modules[name] = _imports(path, package)
    # An import of a package's member is an edge to the member alone; of the package itself (its
    # __init__), an edge to the package. A module's own parent packages are not edges: importing
    # fastrl.integrations.verl runs fastrl/__init__ first whatever verl imports.
    return {name: {d for d in deps if d in modules and d != name and not name.startswith(d + ".")}
            for name, deps in modules.items()}  # fmt: skip


def test_no_import_circle_in_fastrl():
    graph = _fastrl_modules()
    assert "fastrl._distributed" in graph and "fastrl._sharded.logprobs" in graph  # (the walk found the tree)
    circles = []
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                circles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, f"import circles: {circles}"


def test_kernels_import_no_api_layer():
    """kernels/ (installed as fastrl.kernels) may use the bottom-layer row layout alone."""

    def allowed(module: str) -> bool:
        return any(module == m or module.startswith(m + ".") for m in ("fastrl.kernels", "fastrl._rows"))

    for path in sorted((ROOT / "kernels").rglob("*.py")):
        package = "fastrl." + ".".join(path.relative_to(ROOT).parent.parts)
        outside = sorted(m for m in _imports(path, package) if not allowed(m))
        assert not outside, f"{path.relative_to(ROOT)} imports {outside}"


def test_both_backends_offer_every_launcher_with_one_signature():
    """fastrl._ops.LAUNCHERS is the declared contract: the C++ launchers (fastrl._native) and the
    Triton ones (fastrl.kernels.<family>) take the same parameters, by name, kind and default. A
    backend's own launch choice may follow them as a keyword with a default, which the operators
    never pass (the Triton sampler's window=, its row histogram, for tests and the static model)."""
    source = (ROOT / "fastrl" / "_ops.py").read_text()
    for family, names in fastrl._ops.LAUNCHERS.items():
        triton = importlib.import_module(f"fastrl.kernels.{family}")
        for name in names:
            assert f'launchers(backend, "{family}").{name}' in source, f"{family}.{name} declared but not called"
            native_params = list(inspect.signature(getattr(fastrl._native, name)).parameters.values())
            triton_params = list(inspect.signature(getattr(triton, name)).parameters.values())
            shape = lambda params: [(p.name, p.kind, p.default) for p in params]  # noqa: E731
            common = min(len(native_params), len(triton_params))
            assert shape(native_params[:common]) == shape(triton_params[:common]), f"{family}.{name} differ"
            for extra in native_params[common:] + triton_params[common:]:
                assert extra.kind == extra.KEYWORD_ONLY and extra.default is not extra.empty, (family, name, extra)
                assert f"{extra.name}=" not in source, f"{family}.{name}: the operators pass {extra.name}"
    for family, names in fastrl._ops.TRITON_LAUNCHERS.items():
        triton = importlib.import_module(f"fastrl.kernels.{family}")
        for name in names:  # (Triton's alone: the operator refuses another backend)
            assert callable(getattr(triton, name)) and not hasattr(fastrl._native, name), (family, name)
            assert f'launchers(_triton_backend(backend, "{name}"), "{family}").{name}' in source, (family, name)
    called = set(re.findall(r'launchers\(backend, "(\w+)"\)\.(\w+)', source))
    declared = {(family, name) for family, names in fastrl._ops.LAUNCHERS.items() for name in names}
    assert called == declared, f"called but not declared: {sorted(called - declared)}"
