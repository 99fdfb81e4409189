"""The package layout: no import circles between hf_retrace's modules, and the Hub files import only torch,
transformers and each other (what `trust_remote_code=True` can load where hf_retrace is not installed)."""

import ast
import sys
from pathlib import Path

import pytest

from hf_retrace.hub.validation import CODE_FILES


PACKAGE = Path(__file__).resolve().parents[1] / "hf_retrace"
HUB_FILES = tuple(name.removesuffix(".py") for name in CODE_FILES)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str) -> set[str]:
    """hf_retrace modules that module `name` imports anywhere in its source (function-local and TYPE_CHECKING
    imports included: they are circles too, only deferred)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return {m for m in found if m in MODULES and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as `[a, b, ..., a]`, or None."""
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


def test_no_import_circles():
    graph = {name: imported_modules(name) for name in MODULES}
    assert graph["hf_retrace.bench.report"] and graph["hf_retrace.models.modeling_retrace"]  # the parser sees edges
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_data_never_imports_the_trainer():
    """Imports point one way, data <- trainer: the pool and the collators are usable without the training code,
    and the trainer reads the target features from `hf_retrace.data.target_features`."""
    graph = {name: imported_modules(name) for name in MODULES}
    data = {name for name in MODULES if name.startswith("hf_retrace.data")}
    ties = {(a, b) for a in data for b in graph[a] if b.startswith("hf_retrace.trainer")}
    assert not ties, f"data imports the trainer: {sorted(ties)}"
    assert "hf_retrace.data.target_features" in graph["hf_retrace.trainer.objective"]
    assert "hf_retrace.data.target_features" in graph["hf_retrace.data.pool"]


def test_the_old_tie_would_be_a_circle():
    """Putting back the edge the data package used to have (pool -> trainer.objective's features) closes a circle in
    the real graph, so `test_no_import_circles` guards the direction."""
    graph = {name: imported_modules(name) for name in MODULES}
    graph["hf_retrace.data.target_features"] |= {"hf_retrace.trainer.objective"}
    cycle = find_cycle(graph)
    assert cycle is not None and {"hf_retrace.trainer.objective", "hf_retrace.data.target_features"} <= set(cycle)


@pytest.mark.parametrize("name", HUB_FILES)
def test_hub_files_import_only_torch_transformers_and_each_other(name):
    tree = ast.parse((PACKAGE / "models" / f"{name}.py").read_text())
    # numpy: the shared policy files (a dependency of transformers itself)
    allowed = {"torch", "transformers", "numpy", "huggingface_hub", *sys.stdlib_module_names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            assert node.level == 1 and node.module in HUB_FILES, ast.unparse(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            assert {n.split(".")[0] for n in names} <= allowed, ast.unparse(node)
