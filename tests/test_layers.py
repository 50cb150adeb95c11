"""The package's layers point one way: kernels import nothing of ours, the algorithm and its state import no SGLang
and no glue, only the glue (patches/) touches SGLang, and no module imports itself back through others."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# installed package name of each source folder (pyproject's package-dir)
FOLDERS = {"sgl_sparsekv": "sgl_sparsekv", "kernels": "sgl_sparsekv.kernels", "patches": "sgl_sparsekv.patches",
           "configs": "sgl_sparsekv.configs"}


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def imports(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside a function (a lazy import is still a dependency)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: {i for i in imports(p) if i in mods and i != m and mods[i].name != "__init__.py"}
            for m, p in mods.items()}


def test_kernels_import_nothing_of_ours_but_kernels():
    for m, p in modules().items():
        if m.startswith("sgl_sparsekv.kernels"):
            ours = {i for i in imports(p) if i.startswith("sgl_sparsekv")}
            assert all(i.startswith("sgl_sparsekv.kernels") for i in ours), (m, ours)


def test_only_the_glue_touches_sglang():
    for m, p in modules().items():
        got = imports(p)
        if not m.startswith("sgl_sparsekv.patches"):
            assert not {i for i in got if i.split(".")[0] == "sglang"}, m
            assert not {i for i in got if i.startswith("sgl_sparsekv.patches")}, m


def circle(g: dict[str, set[str]]) -> list[str] | None:
    """The first import circle of a graph (module -> the modules it imports), as a path, or None."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(g.get(m, ())):
            if state.get(n) == "open":
                return path + [n]
            if n not in state and (found := visit(n, path + [n])):
                return found
        state[m] = "done"
        return None

    for m in sorted(g):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_no_import_circle():
    assert circle(graph()) is None


def test_a_circle_is_found():
    """The check above can fail: the loop config and head_roles had (each imported the other inside a function)."""
    assert circle({"config": {"errors", "head_roles"}, "head_roles": {"config"}, "errors": set()}) == [
        "config", "head_roles", "config"]
    assert circle({"config": {"errors", "head_roles"}, "head_roles": {"errors"}, "errors": set()}) is None
