"""The project's import graph, read from the source with `ast` (nothing imported): no circle among the modules of
kernels/ and trainer/, no project import inside a function (every dependency shows at the top of its module),
kernels/ never imports trainer/, and trainer/'s folders stand in one order, each importing only from those below it
(`LAYERS`; docs/architecture.md, ../shared/DESIGN.md)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "trainer")
# the project imports a function may make, each for an optional dependency: the CUDA extension, built only where
# CUDA exists (kernels/adamw.py imports it under guard the first time the CUDA op is asked for), and the 4-bit
# layers, which import bitsandbytes (an extra, seconds to import) and are imported only when load_in_4bit asks
OPTIONAL = {"kernels._C", "trainer.model.quant"}


# trainer/'s layers from the ground up: a module imports from its own layer (no circle) or a lower one, never a
# higher. A module of trainer/ is in the layer whose prefix names it (a folder, or a module at trainer/'s top).
LAYERS = (
    ("trainer.coerce", "trainer.dist", "trainer.checkpoint_hf"),  # errors and value parsing, process facts, HF files
    ("trainer.config",),  # TrainingArguments, the CLI/YAML parser
    ("trainer.model",),  # the causal LM, attention, LoRA
    ("trainer.data",),  # SFT and preference data, batching, the tokenizer, the embedded tasks
    ("trainer.parallel",),  # the transforms (checkpointing, compile, DDP/FSDP2), DeepSpeed
    ("trainer.build",),  # a model comes to exist: meta -> settings -> transforms -> weights
    ("trainer.loop",),  # Trainer, engines, optimizers, checkpoints and resume, callbacks, loggers, evaluation
    ("trainer.methods",),  # trainers built on the loop: preference (DPO and its kin)
    (
        "trainer",
        "trainer.cli",
        "trainer.cli_args",
        "trainer.sft",
        "trainer.dpo",
        "trainer.grpo",
        "trainer.generate",
        "trainer.merge",
    ),  # the commands and their conductor, the public names
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    """The index in LAYERS of a trainer module's layer (the longest matching prefix), None if no layer names it."""
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix != "trainer" and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    return None if best is None else best[0]


def _targets(node: ast.AST, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """The project modules an import statement names (a `from pkg import name` of a submodule names it)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        else:
            base = node.module
        if not base:
            return []
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    else:
        return []
    return [name for name in names if name.split(".")[0] in PACKAGES]


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """({module: the project modules it imports at module level}, [(module, target, line) of in-function imports])."""
    files = {_module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}
    modules = set(files)
    graph: dict[str, set[str]] = {}
    in_function: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, name: str, is_package: bool, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            child_inside = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for target in _targets(child, name, is_package, modules):
                if child_inside:
                    in_function.append((name, target, child.lineno))
                elif target != name:
                    graph[name].add(target)
            visit(child, name, is_package, child_inside)

    for name, path in files.items():
        graph[name] = set()
        visit(ast.parse(path.read_text()), name, path.stem == "__init__", False)
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
    assert {"trainer.loop.engine", "trainer.loop.callbacks", "trainer.loop.checkpoint"} <= graph["trainer.loop.trainer"]
    model = graph["trainer.model.causal_lm"]
    assert "trainer.model.attention" in model and "kernels" in model
    assert "kernels._dispatch" in graph["kernels.rms_norm"]  # a relative import inside kernels/
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert layer_of("trainer.loop.trainer") > layer_of("trainer.build") > layer_of("trainer.model.lora")
    assert layer_of("trainer.coerce") == 0 and layer_of("trainer") == layer_of("trainer.sft") == len(LAYERS) - 1


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


def test_every_trainer_module_has_a_layer():
    graph, _ = import_graph()
    assert [m for m in graph if m.startswith("trainer") and layer_of(m) is None] == []


def test_trainer_imports_only_from_its_own_layer_or_below():
    graph, _ = import_graph()
    upward = sorted(
        (m, d)
        for m, deps in graph.items()
        if m.startswith("trainer")
        for d in deps
        if d.startswith("trainer") and layer_of(d) > layer_of(m)
    )
    assert upward == []
