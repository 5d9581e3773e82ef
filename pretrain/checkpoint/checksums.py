"""Each checkpoint file's size and CRC-32, recorded at save and checked before load (`verify`). Torch-free.

``checksums.json``, the last file a save writes before the rename and ``COMPLETE``:

    {"algorithm": "crc32", "files": {"deepspeed/step_00000120/mp_rank_00_model_states.pt": [size, "1a2b3c4d"], ...}}

Files added later (``COMPLETE``, ``PINNED``, ``evals/``, ``universal/``) are not covered; a checkpoint without the
record is *unverified* and still loads. CRC-32 catches accidents, not edits (docs/contracts.md, "Checkpoints").
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pretrain.checkpoint import run_folder
from pretrain.checkpoint.run_folder import CHECKSUMS, CONFIG_FILE, TRAINER_STATE, WEIGHTS_FILE, write_durably

ALGORITHM = "crc32"
CHUNK_BYTES = 8 << 20
# What an eval (or init_from) reads, checked without reading the optimizer state
WEIGHT_FILES = (WEIGHTS_FILE, CONFIG_FILE, TRAINER_STATE)

Entries = dict[str, tuple[int, str]]  # relative path -> (size in bytes, checksum)


def entry(path: Path) -> tuple[int, str]:
    """(size, CRC-32 as 8 hex digits)."""
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, f"{crc:08x}"


def write(folder: Path, entries: Mapping[str, tuple[int, str]]) -> None:
    """Write ``folder/checksums.json``, sorted."""
    files = {name: [size, crc] for name, (size, crc) in sorted(entries.items())}
    write_durably(folder / CHECKSUMS, json.dumps({"algorithm": ALGORITHM, "files": files}, indent=0) + "\n")


def expected(folder: Path) -> Entries | None:
    """What ``folder``'s save recorded; None without a record; ValueError if the record is damaged or unreadable."""
    path = folder / CHECKSUMS
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data["algorithm"] != ALGORITHM:
            raise ValueError(f"algorithm {data['algorithm']!r} is not {ALGORITHM!r}")
        entries = {str(name): (int(size), str(crc)) for name, (size, crc) in data["files"].items()}
    except OSError as error:  # failing storage: as for the files it lists (`check`)
        raise ValueError(f"{CHECKSUMS} cannot be read ({error.strerror or error})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as error:  # JSONDecodeError and UnicodeError included
        raise ValueError(f"{CHECKSUMS} is unreadable ({type(error).__name__}: {error})") from None
    return entries


def check(folder: Path, entries: Mapping[str, tuple[int, str]]) -> list[str]:
    """One line per file of ``entries`` that is missing or differs."""
    problems = []
    for name, (size, crc) in sorted(entries.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        if (actual := path.stat().st_size) != size:
            problems.append(f"{name} has {actual} bytes, {size} were written")
            continue
        try:
            _, got = entry(path)
        except OSError as error:
            problems.append(f"{name} cannot be read ({error.strerror or error})")
            continue
        if got != crc:
            problems.append(f"{name} has {ALGORITHM} {got}, {crc} was written (its bytes changed)")
    return problems


def share(entries: Mapping[str, tuple[int, str]], part: int, parts: int) -> Entries:
    """Rank ``part`` of ``parts``'s files: largest first, each to the least-loaded part. Deterministic."""
    loads = [0] * parts
    mine: Entries = {}
    for name, (size, crc) in sorted(entries.items(), key=lambda item: (-item[1][0], item[0])):
        target = loads.index(min(loads))
        loads[target] += size
        if target == part:
            mine[name] = (size, crc)
    return mine


@dataclass(frozen=True)
class Verdict:
    """One checkpoint's check: ``status`` "verified", "unverified" (no record; it loads) or "damaged" (``problems``)."""

    folder: Path
    status: str
    problems: tuple[str, ...] = ()
    files: int = 0
    size: int = 0  # bytes the record lists

    @property
    def ok(self) -> bool:
        return self.status != "damaged"

    @property
    def problem(self) -> str:
        """The first file's damage, and how many more."""
        more = len(self.problems) - 1
        return self.problems[0] + (f" (and {more} more file{'s' * (more > 1)})" if more > 0 else "")

    def line(self) -> str:
        """``<folder>: verified (12 files, 265.3 MB)``, ``unverified (...)`` or ``DAMAGED: <problem>``."""
        if self.status == "verified":
            return f"{self.folder}: verified ({self.files} files, {self.size / 1e6:.1f} MB)"
        if self.status == "unverified":
            return f"{self.folder}: unverified (no {CHECKSUMS}: written before checkpoints recorded checksums)"
        return f"{self.folder}: DAMAGED: {self.problem}"


def verify(folder: Path, only: Iterable[str] | None = None, part: tuple[int, int] = (0, 1)) -> Verdict:
    """Check ``folder`` against its record. ``only``: these files; ``part=(rank, world_size)``: this rank's `share`
    (`combine` joins the ranks' verdicts)."""
    folder = Path(folder)
    try:
        entries = expected(folder)
    except ValueError as error:
        return Verdict(folder, "damaged", (str(error),))
    if entries is None:
        return Verdict(folder, "unverified")
    if only is not None:
        wanted = set(only)
        entries = {name: value for name, value in entries.items() if name in wanted}
    entries = share(entries, *part) if part[1] > 1 else entries
    problems = check(folder, entries)
    size = sum(s for s, _ in entries.values())
    return Verdict(folder, "damaged" if problems else "verified", tuple(problems), len(entries), size)


def combine(folder: Path, parts: Iterable[Verdict]) -> Verdict:
    """Damaged if any is, else unverified if any is, else verified."""
    parts = list(parts)
    problems = tuple(sorted({p for v in parts for p in v.problems}))  # a damaged record is everyone's
    statuses = {v.status for v in parts}
    status = next(s for s in ("damaged", "unverified", "verified") if s in statuses)
    return Verdict(Path(folder), status, problems, sum(v.files for v in parts), sum(v.size for v in parts))


def checkpoints_to_verify(path: Path) -> list[Path]:
    """One checkpoint, or every COMPLETE one of a run folder (or its ``checkpoints/``); ValueError for none."""
    accepted = f"pass a run folder (checkpoint.dir) or one checkpoint, <run>/{run_folder.CHECKPOINTS}/step_XXXXXXXX"
    if not path.exists():
        raise ValueError(f"{path} does not exist; {accepted}")
    if run_folder.looks_like_checkpoint(path):
        return [run_folder.require_complete(path)]  # without COMPLETE its save never finished
    run = path.parent if path.name == run_folder.CHECKPOINTS else path
    if not run_folder.checkpoints_dir(run).is_dir():
        raise ValueError(
            f"{path} is neither a run folder (it has no {run_folder.CHECKPOINTS}/) nor a checkpoint; {accepted}"
        )
    found = run_folder.complete_checkpoints(run)
    if not found:
        raise ValueError(f"{run_folder.checkpoints_dir(run)} holds no COMPLETE checkpoint; {accepted}")
    return found


def verify_command(path: Path) -> int:
    """``verify DIR``: one line per checkpoint; 2 if any is damaged."""
    verdicts = []
    for folder in checkpoints_to_verify(path):
        verdicts.append(verify(folder))
        print(verdicts[-1].line(), flush=True)
    return 0 if all(v.ok for v in verdicts) else 2
