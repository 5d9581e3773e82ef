"""Nothing of ours draws from the global Python and NumPy generators; only pretrain/randomness.py seeds, saves and
restores them (a checkpoint's `rng_state`). Read from the source: at run time their states also move under other
libraries' threads (HTTP retry jitter), so a test of states before and after cannot tell who drew.
"""

from __future__ import annotations

import ast

from tests.project.test_imports import MODULES

OWNER = "pretrain.randomness"
# NumPy's seeded generators: each call builds a private one, the legacy global `RandomState` stays untouched.
NUMPY_PRIVATE = {
    "default_rng",
    "Generator",
    "SeedSequence",
    "BitGenerator",
    "RandomState",
    "PCG64",
    "PCG64DXSM",
    "MT19937",
    "Philox",
    "SFC64",
}
PYTHON_PRIVATE = {"Random", "SystemRandom"}


def _draws(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, call) for every use of the global generators: `random.X`, `from random import X`, `np.random.X`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "random":
            found += [(node.lineno, f"from random import {a.name}") for a in node.names if a.name not in PYTHON_PRIVATE]
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id == "random" and node.attr not in PYTHON_PRIVATE:
            found.append((node.lineno, f"random.{node.attr}"))
        is_np_random = (
            isinstance(owner, ast.Attribute)
            and owner.attr == "random"
            and isinstance(owner.value, ast.Name)
            and owner.value.id in ("np", "numpy")
        )
        if is_np_random and node.attr not in NUMPY_PRIVATE:
            found.append((node.lineno, f"np.random.{node.attr}"))
    return found


def test_the_rule_sees_a_global_draw():
    source = "import random\nimport numpy as np\nrandom.shuffle(x)\nnp.random.rand(3)\nnp.random.default_rng(0)\n"
    assert _draws(ast.parse(source)) == [(3, "random.shuffle"), (4, "np.random.rand")]
    assert _draws(ast.parse("from random import choice, Random\n")) == [(1, "from random import choice")]


def test_only_the_randomness_module_touches_the_global_generators():
    offenders = [
        f"{module}:{line}: {call}"
        for module, path in MODULES.items()
        if module != OWNER
        for line, call in _draws(ast.parse(path.read_text(), str(path)))
    ]
    assert not offenders, f"draw from a private generator (random.Random, np.random.default_rng) instead: {offenders}"
    assert _draws(ast.parse(MODULES[OWNER].read_text()))  # the rule reads the module that does seed them
