"""The project's import graph, read from the source with `ast` (nothing imported): no circle among the modules of
kernels/ and trainer/, no project import inside a function (every dependency shows at the top of its module), and
kernels/ never imports trainer/ (docs/architecture.md, ../shared/DESIGN.md)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "trainer")
# the one project import a function may make: the CUDA extension, built only where CUDA exists (kernels/adamw.py
# imports it under guard the first time the CUDA op is asked for)
OPTIONAL = {"kernels._C"}


def _module_name(path: Path) -> str:
    return path.parent.name if path.stem == "__init__" else f"{path.parent.name}.{path.stem}"


def _targets(node: ast.AST, package: str, modules: set[str]) -> list[str]:
    """The project modules an import statement names (a `from pkg import name` of a submodule names it)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = package if node.level else node.module
        if node.level and node.module:
            base = f"{package}.{node.module}"
        if base is None:
            return []
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    else:
        return []
    return [name for name in names if name.split(".")[0] in PACKAGES]


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """({module: the project modules it imports at module level}, [(module, target, line) of in-function imports])."""
    files = {_module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).glob("*.py"))}
    modules = set(files)
    graph: dict[str, set[str]] = {}
    in_function: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, name: str, package: str, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            child_inside = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for target in _targets(child, package, modules):
                if child_inside:
                    in_function.append((name, target, child.lineno))
                elif target != name:
                    graph[name].add(target)
            visit(child, name, package, child_inside)

    for name, path in files.items():
        graph[name] = set()
        visit(ast.parse(path.read_text()), name, name.split(".")[0], False)
    return graph, in_function


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    found: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                found.append(stack[stack.index(dep) :] + [dep])
            elif dep in graph and not state.get(dep):
                walk(dep, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            walk(node, [])
    return found


def test_the_reader_sees_the_imports_it_must():
    graph, _ = import_graph()
    assert {"trainer.engine", "trainer.callbacks", "trainer.checkpoint"} <= graph["trainer.trainer"]
    assert "trainer.attention" in graph["trainer.model"] and "kernels" in graph["trainer.model"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_circle():
    graph, _ = import_graph()
    assert _cycles(graph) == []


def test_no_project_import_inside_a_function():
    _, in_function = import_graph()
    assert [(m, t, line) for m, t, line in in_function if t not in OPTIONAL] == []


def test_kernels_never_import_trainer():
    graph, _ = import_graph()
    upward = {
        (m, d) for m, deps in graph.items() if m.split(".")[0] == "kernels" for d in deps if d.startswith("trainer")
    }
    assert upward == set()
