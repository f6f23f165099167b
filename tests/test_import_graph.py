"""moe_lib's modules import each other without a cycle, counting imports inside functions too: a cycle is a tangle a
reader has to hold in their head (and that a lazy import hides from the interpreter, not from them)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "moe_lib"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The moe_lib modules ``path`` imports anywhere in it (``from . import x`` counts as importing module x where x
    is a module, else as importing the package)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("moe_lib"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("moe_lib"):
                continue
            for alias in node.names:
                child = f"{target}.{alias.name}"
                found.add(child if child in modules else target)
    return {module for module in found if module in modules and module != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_moe_lib_imports_have_no_cycle():
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    graph = {module_name(path): imported_modules(path, modules) for path in paths}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"
