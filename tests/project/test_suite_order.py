"""The suite's order (tests/conftest.py, tests/support/order.py): longest first by `tests/durations.json`, the tests
marked `waits` kept apart. A test missing from the file runs after every recorded one: a renamed test drops out that
way (its old name stays in the file, its new one is not there), and one long test started late becomes the run's
tail, so every name the file holds must be a test of the suite."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from tests.support.order import order

ROOT = Path(__file__).resolve().parents[2]
DURATIONS = ROOT / "tests" / "durations.json"


def _tests_in(path: Path) -> set[str]:
    """`name` and `Class::name` of every test function the module defines."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(f"{node.name}::{f.name}" for f in node.body if isinstance(f, ast.FunctionDef))
    return names


def test_every_recorded_duration_names_a_test_of_the_suite():
    stale = []
    for nodeid in json.loads(DURATIONS.read_text()):
        path, _, name = nodeid.partition("::")
        if not (ROOT / path).is_file() or name.split("[")[0] not in _tests_in(ROOT / path):
            stale.append(nodeid)
    fix = "rewrite it with `make test PYTEST_ARGS=--write-durations`"
    assert not stale, f"{DURATIONS.name} names tests that do not exist: {stale}; {fix}"


def test_longest_first_and_the_rest_in_their_order():
    seconds = {"b": 30.0, "d": 60.0, "e": 6.0}
    assert order(["a", "b", "c", "d", "e", "f"], seconds, set(), 3) == ["d", "b", "e", "a", "c", "f"]


def test_a_waiting_test_starts_when_no_other_waits():
    # Longest first would start a, w1 and w2 together on 3 workers: two of them waiting leave a core idle.
    seconds = {"a": 100.0, "w1": 90.0, "w2": 85.0, "b": 50.0, "c": 40.0, "d": 30.0}
    names = ["a", "b", "c", "d", "w1", "w2"]
    # a, w1, b from 0 s; c at 50 (b ends); at 90 c and w1 end: w2, then d
    assert order(names, seconds, {"w1", "w2"}, 3) == ["a", "w1", "b", "c", "w2", "d"]
    # one worker: nothing runs side by side, so the order is longest first
    assert order(names, seconds, {"w1", "w2"}, 1) == ["a", "w1", "w2", "b", "c", "d"]
    # only waiting tests left: the next one starts anyway (a worker never idles)
    assert order(["w1", "w2"], seconds, {"w1", "w2"}, 3) == ["w1", "w2"]
