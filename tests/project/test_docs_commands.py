"""Every command the docs show runs, in a form that cannot train: a renamed field, flag, target or module fails here.

Where commands are found (README.md and every docs/**/*.md, the dated benchmark files included):

- every line of every fenced code block (any info string), with a line ending in ``\\`` or followed by an indented
  line that starts with ``[`` or ``-`` joined to it; lines of diagrams (drawn with ``─``/``▶``/``│``) are not commands;
- every inline code span outside fenced blocks (a span may wrap onto the next line of its paragraph).

A line or span is a command when it starts (after optional ``VAR=value`` words) with ``make <target>``,
``python -m <module>`` (also ``python3``, ``.venv/bin/python``) or ``torchrun ... -m <module>``; the job of a
``ray job submit ... -- <command>`` line is that command. Then:

- a trailing ``# comment`` is dropped;
- it is split at `` | ``, `` || ``, `` && `` and ``; `` into parts, and every part that starts with a command is a
  command of its own (``make status | make logs | make stop`` is three; ``python -m x | head`` is one);
- ``[...]`` groups are optional: the command is checked twice, with every group left out and with every group in;
- it is a *synopsis* when it holds a placeholder: ``...``/``…``, a token with ``|`` alternatives
  (``--checkpoint|--weights``, ``cpu|cuda``), an upper-case metavariable (``PATH``, ``OUT_DIR``, ``IN.npz``, ``N``),
  an ``<angle-bracketed>`` part (``runs/<run>/...``) or ``key=value``/``k=v``/``field=int``. A synopsis is never
  run, not even with ``--dry-run``: its flags and its concrete values are checked (below).

How each command is checked (nothing here can train, submit, generate data or write outside the test):

- ``make <target> VAR=...``: ``make -n`` with the same words, from the repository root in an environment without
  the Makefile's variables, must succeed (the target exists, the variables expand); ``make launch`` is always given
  ``DRY_RUN=1``. The ``python -m <module> ...`` lines of what make would run are then checked as below, so the
  Makefile's variable handling (``SET="a=1 b=2"`` → ``--set a=1 --set b=2``, ``DRY_RUN`` → ``--dry-run``) is
  tested too. Deriving the command with ``make -n`` and running it in this process, rather than running
  ``make -s launch ... DRY_RUN=1`` itself, costs one import of torch and Ray for all the commands instead of one
  per command, and it does not depend on the setup stamp (pyproject.toml newer than it would make a real ``make``
  run ``pip install`` first).
- ``python -m <module> ...`` of this project: ``main(<leading positionals> + ["--help"])`` must exit 0, and every
  ``-flag`` of the command (each alternative of ``--a|--b``) must appear in that help, so a renamed flag or
  sub-command fails. ``torchrun``'s own flags are looked up in torchrun's help the same way. Then, if it has
  arguments (a bare ``python -m pretrain.train`` in prose names the entry point; it is no command): a command
  that is no synopsis, of a module whose help offers ``--dry-run``, runs with ``--dry-run`` (in this process,
  output captured) and must return 0 (``pretrain.train`` validates the config at the world size
  ``--nproc-per-node`` gives, ``cluster.launch`` resolves the config and builds the plan). Any other has the
  values it names validated without running, placeholders left out: ``--config``/``--recipe`` through
  ``pretrain.config.train_config.load_config`` (with the ``--set`` overrides where they are config overrides),
  ``--cluster`` through ``cluster.profiles.load_profile``, ``--suite`` through ``evals.suites.load_suite``, and
  ``data_pipeline.builtin.sets``'s dataset name and ``--set`` sizes through its own checks. Paths to data that is not
  here (``/data/imagenet21k``, a checkpoint) are never opened.
- ``NOT_RUN`` below lists what is only looked up (``make -n`` or ``--help``), each with its reason; every entry
  must still match a command in the docs (``test_not_run_entries_are_used``).

Results are cached per distinct command, so a command the docs repeat (``make launch``) is checked once.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PROJECT_PACKAGES = {"pretrain", "data_pipeline", "evals", "cluster", "tracking", "bench"}
MAKE_VARIABLES = ("CLUSTER", "RECIPE", "SET", "DRY_RUN", "EXPERIMENT", "RUNS", "PYTEST_ARGS", "MAKEFLAGS", "MAKELEVEL")

# What is only looked up, never run, and why. Keys: "make <target>" (checked by `make -n` alone) or "python -m <module>"
# (checked by --help and its flags alone, even where the module has --dry-run).
NOT_RUN = {
    "make test": "runs the whole suite, this file included",
    "make test-fast": "runs the suite without the slow tests, this file included",
    "make test-shuffled": "runs the whole suite in a random order, this file included",
    "make setup": "installs packages with pip",
    "python -m pytest": "runs tests (not this project's module; the suite is run by `make test`)",
    "python -m tracking.ui": "serves until stopped; its --dry-run also needs port 5000 free, which depends on the "
    "machine, not on the docs",
}

_PREFIX = re.compile(
    r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"  # VAR=value words
    r"(?:make\s+[a-z][\w-]*"
    r"|(?:\S*/)?python3?\s+-m\s+[A-Za-z_][\w.]*"
    r"|(?:\S*/)?torchrun\s(?:.*?\s)?-m\s+[A-Za-z_][\w.]*)"
)
_RAY_SUBMIT = re.compile(r"^(?:\S*/)?ray\s+job\s+submit\s(?:.*?\s)?--\s+(.+)$")  # Ray's CLI: the job's entrypoint
_SEPARATOR = re.compile(r"\s+(?:\|\||\||&&)\s+|;\s+")
_DIAGRAM = re.compile(r"[─▶│┌└├]")
_OPTIONAL = re.compile(r"(?:(?<=\s)|^)\[([^\[\]]*)\](?=\s|$)")
_METAVAR = re.compile(r"^[A-Z][A-Z0-9_]*(?:[.{].*)?$")
_GENERIC_SETTING = re.compile(r"^(?:key|k|field)=(?:value|v|int)$", re.IGNORECASE)
_ELLIPSES = ("...", "…")


@dataclass(frozen=True)
class DocCommand:
    file: str  # relative to the repository root
    line: int
    text: str  # as written, comment dropped, one alternative

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


def _strip_comment(text: str) -> str:
    return re.sub(r"(?:^|\s)#.*$", "", text).strip()


def _commands_in(text: str) -> list[str]:
    """The commands of one line or span ([] when it does not start with one)."""
    text = _strip_comment(" ".join(text.split()))
    if submitted := _RAY_SUBMIT.match(text):
        text = submitted.group(1)
    if not _PREFIX.match(text) or _DIAGRAM.search(text):
        return []
    return [part.strip() for part in _SEPARATOR.split(text) if _PREFIX.match(part.strip())]


def extract(path: Path) -> list[DocCommand]:
    rel = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    found: list[DocCommand] = []
    prose = list(lines)  # the file with fenced blocks blanked, for the inline spans
    in_fence = False
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("```"):
            in_fence, prose[i] = not in_fence, ""
            i += 1
            continue
        if in_fence:
            prose[i] = ""
            start, text = i, _strip_comment(lines[i])
            while i + 1 < len(lines) and (
                text.endswith("\\") or (re.match(r"^\s+[\[-]", lines[i + 1]) and _PREFIX.match(text))
            ):
                i += 1
                prose[i] = ""
                text = text.rstrip("\\").rstrip() + " " + _strip_comment(lines[i])
            found += [DocCommand(rel, start + 1, c) for c in _commands_in(text.strip())]
            i += 1
            continue
        i += 1
    joined = "\n".join(prose)
    for match in re.finditer(r"(?<!`)`([^`]+)`(?!`)", joined):
        if "\n\n" in match.group(1):
            continue
        line = joined.count("\n", 0, match.start()) + 1
        found += [DocCommand(rel, line, c) for c in _commands_in(match.group(1))]
    return sorted(found, key=lambda c: c.line)


DOC_COMMANDS = [c for path in DOC_FILES for c in extract(path)]


# --------------------------------------------------------------------------------------------- expanding


def variants(text: str) -> list[list[str]]:
    """Token lists: every optional group left out, and every group in (one list when there is no group)."""
    without = _OPTIONAL.sub(" ", text)
    with_all = _OPTIONAL.sub(lambda m: f" {m.group(1)} ", text)
    out = [shlex.split(without)]
    if with_all != without:
        out.append(shlex.split(with_all))
    return [[t for t in tokens if t not in _ELLIPSES] for tokens in out]


def is_synopsis(text: str) -> bool:
    if any(e in text for e in _ELLIPSES):
        return True
    for token in shlex.split(_OPTIONAL.sub(lambda m: f" {m.group(1)} ", text)):
        if re.match(r"^[A-Z_][A-Z0-9_]*=", token):  # a make variable or environment assignment: its value counts
            token = token.split("=", 1)[1]
        if "|" in token or re.search(r"<[^>]*>", token) or _GENERIC_SETTING.match(token):
            return True
        if _METAVAR.match(token) and "=" not in token:
            return True
    return False


def _env_words(tokens: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        key, value = tokens[0].split("=", 1)
        env[key] = value
        tokens = tokens[1:]
    return env, tokens


# --------------------------------------------------------------------------------------------- running


@dataclass(frozen=True)
class ModuleRun:
    module: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    launcher_flags: tuple[str, ...] = ()  # torchrun's own flags, checked against torchrun's help


def _entry(module: str) -> str:
    """The module ``python -m module`` runs: a package's ``__main__``, else the module itself."""
    spec = importlib.util.find_spec(module)
    return f"{module}.__main__" if spec is not None and spec.submodule_search_locations else module


def _call_main(module: str, argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """``module.main(argv)`` in this process with ``env`` set: (exit status, what it printed)."""
    main = importlib.import_module(_entry(module)).main
    out = io.StringIO()
    saved = {k: os.environ.get(k) for k in (*env, "COLUMNS", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key, None)
    os.environ.update({"COLUMNS": "200", **env})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main(argv)
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 2)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return int(code or 0), out.getvalue()


@functools.cache
def help_text(module: str, positionals: tuple[str, ...]) -> str:
    spec = importlib.util.find_spec(_entry(module))
    assert spec is not None and spec.origin, f"no module {module}"
    # A main() that ignores its argv would run for real: only argparse CLIs are called.
    assert "ArgumentParser" in Path(spec.origin).read_text(), f"{module} has no argparse CLI; add it to NOT_RUN"
    code, text = _call_main(module, [*positionals, "--help"], {})
    assert code == 0, f"python -m {module} {' '.join(positionals)} --help exited {code}:\n{text[-3000:]}"
    return text


@functools.cache
def torchrun_help() -> str:
    from torch.distributed.run import get_args_parser

    return get_args_parser().format_help()


@functools.cache
def dry_run(run: ModuleRun) -> tuple[int, str]:
    args = list(run.args)
    assert "--dry-run" in args  # the one thing that may run: never a command that could train or submit
    return _call_main(run.module, args, dict(run.env))


def _flags(args: list[str]) -> list[str]:
    """The ``-flags`` of ``args``, each alternative of ``--a|--b`` and ``N|--full`` (not ``-``, not ``-1``)."""
    alternatives = [alt for token in args for alt in token.split("|")]
    return [a.split("=", 1)[0] for a in alternatives if re.match(r"^--?[A-Za-z]", a)]


def _missing_flags(flags: list[str], help_: str) -> list[str]:
    return [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_)]


def _values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag] + [
        a.split("=", 1)[1] for a in args if a.startswith(flag + "=")
    ]


def _positionals(args: list[str]) -> list[str]:
    out = []
    for token in args:
        if token.startswith("-"):
            break
        out.append(token)
    return out


def validate_values(module: str, args: list[str]) -> None:
    """What a module would check first, checked here without running it; placeholders are left out."""

    def values(flag: str) -> list[str]:
        return [v for v in _values(args, flag) if not is_synopsis(v)]

    sets = values("--set")
    for recipe in values("--config") + values("--recipe"):
        from pretrain.config.train_config import load_config

        load_config(recipe, sets if module in ("pretrain.train", "cluster.launch") else ())
    for profile in values("--cluster"):
        from cluster.profiles import load_profile

        load_profile(profile)
    for suite in values("--suite"):
        from evals.suites import load_suite

        load_suite(suite)
    if module == "data_pipeline.builtin":
        from data_pipeline.builtin.sets import BUILTIN_NAMES, BuiltinConfig, _canonical, check_sizes, option_minimum

        overrides = {}
        for item in sets:
            key, _, value = item.partition("=")
            assert option_minimum(key) is not None, f"--set {item}: data_pipeline.builtin.sets has no field {key!r}"
            overrides[key] = int(value)
        name = _positionals(args)[0]
        if not is_synopsis(name):
            for each in BUILTIN_NAMES if name == "all" else (_canonical(name),):
                check_sizes(each, BuiltinConfig(**overrides))


def check_module(run: ModuleRun, synopsis: bool, where: str) -> None:
    if run.module.split(".")[0] not in PROJECT_PACKAGES:
        assert f"python -m {run.module}" in NOT_RUN, f"{where}: python -m {run.module} is not this project's module"
        return
    args = list(run.args)
    try:
        help_ = help_text(run.module, tuple(p for p in _positionals(args) if not is_synopsis(p)))
    except (AssertionError, ImportError, AttributeError) as error:  # a failed --help, a module gone or without main
        pytest.fail(f"{where}: {type(error).__name__}: {error}")
    missing = _missing_flags(_flags(args), help_)
    assert not missing, f"{where}: python -m {run.module} has no {missing}; its --help:\n{help_}"
    missing = _missing_flags(_flags(list(run.launcher_flags)), torchrun_help())
    assert not missing, f"{where}: torchrun has no {missing}"
    if not args or f"python -m {run.module}" in NOT_RUN:
        return
    if not synopsis and re.search(r"(?<![\w-])--dry-run(?![\w-])", help_):
        if "--dry-run" not in args:
            args.append("--dry-run")
        code, out = dry_run(ModuleRun(run.module, tuple(args), run.env))
        assert code == 0, f"{where}: python -m {run.module} {shlex.join(args)} exited {code}:\n{out[-4000:]}"
    else:
        try:
            validate_values(run.module, args)
        except (ValueError, KeyError, TypeError) as error:
            pytest.fail(f"{where}: python -m {run.module} {shlex.join(args)}: {error}")


def module_run(tokens: list[str]) -> ModuleRun:
    """``[VAR=v ...] python -m M args`` or ``torchrun FLAGS -m M args`` as a ModuleRun."""
    env, tokens = _env_words(tokens)
    m = tokens.index("-m")
    launcher = tokens[1:m] if Path(tokens[0]).name == "torchrun" else []
    if launcher:
        nproc = _values(launcher, "--nproc-per-node") + _values(launcher, "--nproc_per_node")
        if nproc and nproc[0].isdigit():
            env.setdefault("WORLD_SIZE", nproc[0])
    return ModuleRun(tokens[m + 1], tuple(tokens[m + 2 :]), tuple(sorted(env.items())), tuple(launcher))


@functools.cache
def make_dry(words: tuple[str, ...]) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k not in MAKE_VARIABLES}
    proc = subprocess.run(["make", "-n", *words], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr


def check_make(tokens: list[str], synopsis: bool, where: str) -> None:
    env, tokens = _env_words(tokens)
    words = tokens[1:]
    target = words[0]
    if target == "launch" and not any(w.startswith("DRY_RUN=") for w in words):
        words.append("DRY_RUN=1")
    code, out = make_dry(tuple(words))
    assert code == 0, f"{where}: make -n {shlex.join(words)} exited {code}:\n{out[-3000:]}"
    if f"make {target}" in NOT_RUN:
        return
    runs = []
    for line in out.splitlines():
        match = re.search(r"(\S*python3?)\s+-m\s+([\w.]+)(.*)", line)
        if match and match.group(2).split(".")[0] in PROJECT_PACKAGES:
            runs.append(module_run(shlex.split(f"python -m {match.group(2)} {match.group(3)}")))
    assert runs, f"{where}: make {target} runs no `python -m` of this project; add it to NOT_RUN with a reason"
    if target == "launch":
        assert len(runs) == 1 and "--dry-run" in runs[0].args, f"{where}: make -n gave {out}"
    for run in runs:
        check_module(run, synopsis, f"{where} (make runs: python -m {run.module} {shlex.join(run.args)})")


def check(command: DocCommand) -> None:
    synopsis = is_synopsis(command.text)
    for tokens in variants(command.text):
        _, rest = _env_words(list(tokens))
        if rest[0] == "make":
            check_make(tokens, synopsis, str(command))
        else:
            check_module(module_run(tokens), synopsis, str(command))


# --------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("command", DOC_COMMANDS, ids=str)
def test_doc_command_runs(command: DocCommand):
    check(command)


def test_commands_are_found():
    """The extractor finds the kinds of line the docs hold: fenced, inline, wrapped, alternatives, synopses."""
    texts = {(c.file, c.text) for c in DOC_COMMANDS}
    for expected in [
        ("README.md", "make launch"),  # fenced, and inline
        ("README.md", "make status"),  # `make status | make logs | make stop`
        ("README.md", "make stop"),
        ("README.md", "make compare [EXPERIMENT=local_demo] [RUNS=id1,id2]"),
        ("README.md", "python -m data_pipeline.validate /shards/i21k"),
        ("README.md", "python -m cluster.render --cluster a100x64"),  # an inline span
    ]:
        assert expected in texts, expected
    # a fenced line ending in "\\" joined to the next (docs/benchmarks/2026-12-02-compiled-zero3.md)
    assert any(
        c.text.startswith("python -m data_pipeline.builtin fractal") and "samples_per_shard=16" in c.text
        for c in DOC_COMMANDS
    )
    assert any("--set schedule.stop_at_step=200" in c.text for c in DOC_COMMANDS)  # a span wrapped onto a new line
    assert not any("──" in c.text for c in DOC_COMMANDS)  # diagrams are not commands


def test_not_run_entries_are_used():
    """Every NOT_RUN entry still names something the docs (or a make target they name) run."""
    used = set()
    for command in DOC_COMMANDS:
        for tokens in variants(command.text):
            _, rest = _env_words(list(tokens))
            if rest[0] == "make":
                used.add(f"make {rest[1]}")
                code, out = make_dry(tuple(rest[1:]))
                used.update(f"python -m {m}" for m in re.findall(r"python3?\s+-m\s+([\w.]+)", out))
            else:
                used.add(f"python -m {module_run(rest).module}")
    assert set(NOT_RUN) <= used, f"NOT_RUN entries no doc command needs: {sorted(set(NOT_RUN) - used)}"


def test_rules():
    assert _commands_in("make status | make logs | make stop   # the Ray job") == [
        "make status",
        "make logs",
        "make stop",
    ]
    assert _commands_in("raw images ──python -m data_pipeline.write──▶ shards") == []
    assert _commands_in("make launch ──cluster.launch──▶ plan") == []
    assert _commands_in("python -m x --flag | head") == ["python -m x --flag"]
    assert variants("make compare [EXPERIMENT=e] [RUNS=a,b]") == [
        ["make", "compare"],
        ["make", "compare", "EXPERIMENT=e", "RUNS=a,b"],
    ]
    assert is_synopsis("python -m pretrain.train --config NAME|PATH [--set k=v ...]")
    assert is_synopsis("python -m pretrain.weights convert IN.npz OUT_DIR")
    assert not is_synopsis("python -m evals.run --checkpoint ViT-B_16.npz --suite vtab1k --data-root /shards/vtab")
    assert not is_synopsis("make launch CLUSTER=a100x64 RECIPE=vit_h14_i21k DRY_RUN=1")
    assert _flags(["--checkpoint|--weights", "PATH", "--spot", "N|--full", "--x=1"]) == [
        "--checkpoint",
        "--weights",
        "--spot",
        "--full",
        "--x",
    ]
