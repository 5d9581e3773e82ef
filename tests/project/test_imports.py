"""The import rules of docs/design.md, read from the source: no circles, the package table, imports at the top.

The graph is built from each module's AST (no import is executed): an edge for every ``import`` of one of our
modules, those under ``if TYPE_CHECKING:`` included: an import for annotations only is still a dependency, so a
circle through one is a circle. Imports inside a function body are "deferred": they cannot make an import circle but
still count for the package rules.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pretrain", "data_pipeline", "evals", "cluster", "tracking", "bench")
# What each package may import of ours besides itself (docs/design.md); a prefix allows everything under it.
ALLOWED = {
    "data_pipeline": (),
    "pretrain": ("data_pipeline", "tracking"),  # the training loop records its run through tracking
    "tracking": ("pretrain.checkpoint.run_folder", "data_pipeline"),
    "evals": ("pretrain", "data_pipeline", "tracking"),
    "bench": ("pretrain", "data_pipeline"),
    "cluster": PACKAGES,
}
# Within what ALLOWED permits: evals never import the trainer, nothing imports cluster (ALLOWED says so too).
FORBIDDEN = {"evals": ("pretrain.train",)}
# Modules allowed more than their package (docs/design.md): the GPU campaign checks the planner against what it
# measured, so its plan part asks the planner.
EXCEPTIONS = {"bench.gpu.plan": ("cluster",)}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _ours(name: str) -> str | None:
    """The most specific module of ours that importing ``name`` runs (``pretrain.config.train_config.X`` →
    ``pretrain.config.train_config``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _import_nodes(node: ast.AST, deferred: bool = False):
    """(Import or ImportFrom node, inside a function?) for every import statement, ``if TYPE_CHECKING:`` included."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, deferred
        return
    deferred = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    for child in ast.iter_child_nodes(node):
        yield from _import_nodes(child, deferred)


@functools.cache
def imports(module: str) -> list[tuple[str, int, bool]]:
    """(module of ours imported, line, deferred) for each import in ``module`` that names one of ours."""
    path = MODULES[module]
    return imports_in(path.read_text(encoding="utf-8"), module, is_package=path.name == "__init__.py")


def imports_in(source: str, module: str, is_package: bool = False) -> list[tuple[str, int, bool]]:
    """`imports` of ``source``, read as the text of ``module`` (an ``__init__.py`` when ``is_package``)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node, deferred in _import_nodes(ast.parse(source, module)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        for name in dict.fromkeys(names):
            target = _ours(name) if name.split(".")[0] in PACKAGES else None
            if target and target != module:
                found.append((target, node.lineno, deferred))
    return found


def import_graph() -> dict[str, set[str]]:
    """Module → the modules of ours it imports while it is being imported (the edges that can close a circle)."""
    return {m: {t for t, _, deferred in imports(m) if not deferred} for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _allowed(module: str, target: str) -> bool:
    package, other = module.split(".")[0], target.split(".")[0]
    if any(target == f or target.startswith(f + ".") for f in FORBIDDEN.get(package, ())):
        return False
    if any(target == e or target.startswith(e + ".") for e in EXCEPTIONS.get(module, ())):
        return True
    return other == package or any(target == a or target.startswith(a + ".") for a in ALLOWED[package])


def test_the_graph_sees_our_imports():
    # The checks below are only as good as the graph: known edges of each kind must be in it.
    graph = import_graph()
    config = graph["pretrain.config.train_config"]
    assert "pretrain.config.typed_yaml" in config and "pretrain.model.vit" in config
    assert "pretrain.config.typed_yaml" in graph["cluster.profiles"]
    # An import for annotations only is an edge (not deferred); one inside a function is a deferred edge.
    annotations_only = "if TYPE_CHECKING:\n    from pretrain.config.train_config import TrainConfig\n"
    assert imports_in(annotations_only, "pretrain.config.optim") == [("pretrain.config.train_config", 2, False)]
    deferred = "def f():\n    from pretrain.model import vit\n"
    assert imports_in(deferred, "pretrain.model.tasks") == [("pretrain.model.vit", 2, True)]
    # Config sections' owners, which pretrain.config.train_config imports to compose TrainConfig:
    for owner in ("pretrain.config.optim", "pretrain.config.ds_config", "pretrain.model.tasks"):
        assert "pretrain.config.train_config" not in graph[owner]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    graph = import_graph()
    found = cycles(graph)
    described = [" <-> ".join(c) + f" (edges: {sorted((a, b) for a in c for b in graph[a] if b in c)})" for c in found]
    assert not found, "import circles between our modules:\n" + "\n".join(described)


def test_packages_import_only_what_docs_design_allows():
    broken = [
        f"{MODULES[m].relative_to(ROOT)}:{line} imports {target}"
        for m in MODULES
        for target, line, _ in imports(m)
        if not _allowed(m, target)
    ]
    assert not broken, "imports the package table of docs/design.md forbids:\n" + "\n".join(broken)


# The one module of ours imported inside a function: the eval-scheduler actor's task imports its body in the task's
# own process, so that the actor never imports torch (docs/design.md, "Imports go at the top").
DEFERRED_OK = {("cluster.driver.eval_scheduler", "cluster.driver.eval_task")}


def test_our_modules_import_each_other_at_the_top():
    # Function-level imports are for heavy optional externals (deepspeed, ray, mlflow, matplotlib) only.
    deferred = [
        f"{MODULES[m].relative_to(ROOT)}:{line} imports {target} inside a function"
        for m in MODULES
        for target, line, is_deferred in imports(m)
        if is_deferred and (m, target) not in DEFERRED_OK
    ]
    assert not deferred, "move these imports to the top of their file:\n" + "\n".join(deferred)
