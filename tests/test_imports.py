"""comm's modules import one another without a cycle, and none imports another's private names."""

import ast
from pathlib import Path

COMM = Path(__file__).resolve().parent.parent / "comm"


def _module_name(path: Path) -> str:
    parts = path.relative_to(COMM.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict:
    """Module -> (the comm modules it imports anywhere in its file, the private names it takes from them)."""
    modules = {_module_name(path): path for path in COMM.rglob("*.py")}
    found = {}
    for name, path in modules.items():
        targets, private = set(), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    if submodule in modules:
                        targets.add(submodule)
                    elif node.module in modules:
                        targets.add(node.module)
                        if alias.name.startswith("_"):
                            private.add(f"{node.module}.{alias.name}")
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name in modules)
        found[name] = (targets - {name}, private)
    return found


def _cycle(graph: dict) -> list:
    """One import cycle, as the modules along it, or an empty list."""
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target, path + [target])
                if cycle:
                    return cycle
        state[module] = "done"
        return []

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            if cycle:
                return cycle
    return []


def test_no_import_cycle():
    graph = {module: targets for module, (targets, _) in _imports().items()}
    assert _cycle(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_imports_another_modules_private_names():
    private = {module: names for module, (_, names) in _imports().items() if names}
    allowed = {  # comm's own underscore modules are the package's internals, named so to stay out of the API
        name for names in private.values() for name in names if name.split(".")[-2].startswith("_")}
    assert {module: names - allowed for module, names in private.items() if names - allowed} == {}
