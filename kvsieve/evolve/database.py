"""The program database: every candidate of a run in SQLite, islands and a MAP-Elites grid on top.

One row per attempt, keyed by its slot ``(generation, island, slot)``, so a killed run resumes where
it stopped: the loop recomputes the children of an unfinished generation from the same seeded
choices and skips the slots already stored. Order and ties follow slots; nothing depends on
wall-clock time, random ids or the order in which an executor finishes. The MAP-Elites grid is a
view: the best program of each behaviour cell (which signals it reads x code length), per island.
"""

from __future__ import annotations

import ast
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from kvsieve.language.program_features import HELPERS_VERSION, TENSOR_FIELDS
from kvsieve.language.program_source import Program, fields_read

__all__ = ["ProgramRecord", "ProgramDatabase", "behaviour_cell", "rank_key"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS programs (
    id INTEGER PRIMARY KEY,
    generation INTEGER NOT NULL, island INTEGER NOT NULL, slot INTEGER NOT NULL,
    parent_id INTEGER, inspiration_ids TEXT NOT NULL DEFAULT '[]',
    mutator TEXT NOT NULL, operation TEXT NOT NULL DEFAULT '',
    source TEXT, code_hash TEXT,
    status TEXT NOT NULL, stage INTEGER NOT NULL, reason TEXT NOT NULL DEFAULT '',
    proxy REAL, score REAL, cells TEXT NOT NULL DEFAULT '{}', degenerate INTEGER NOT NULL DEFAULT 0,
    cell TEXT NOT NULL DEFAULT '', seconds REAL NOT NULL DEFAULT 0, sandbox_seconds REAL NOT NULL DEFAULT 0,
    kept_hash TEXT NOT NULL DEFAULT '',
    UNIQUE (generation, island, slot)
);
"""


@dataclass
class ProgramRecord:
    id: int
    generation: int
    island: int
    slot: int
    parent_id: int | None
    inspiration_ids: list[int]
    mutator: str
    operation: str
    source: str | None
    code_hash: str | None
    status: str
    stage: int
    reason: str
    proxy: float | None
    score: float | None
    cells: dict
    degenerate: bool
    cell: str
    seconds: float
    sandbox_seconds: float
    kept_hash: str = ""  # the entries its compressed dev cells keep (cascade.kept_fingerprint); "" if unknown

    @property
    def evaluated(self) -> bool:
        """Reached the sandbox (duplicates and unusable proposals did not)."""
        return self.status not in ("duplicate", "no_proposal", "migrated")


def behaviour_cell(source: str) -> str:
    """MAP-Elites coordinates: how many of the feature tensors the program reads, and its size bucket."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # a candidate's text: null bytes, deep nesting
        return "invalid"
    read = fields_read(tree, TENSOR_FIELDS)
    nodes = sum(1 for _ in ast.walk(tree))
    size = 0 if nodes < 40 else 1 if nodes < 80 else 2 if nodes < 160 else 3
    return f"signals{len(read)}-size{size}"


class ProgramDatabase:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise ValueError(f"program database {str(self.path)!r} is a folder, not an SQLite file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(str(self.path))
        try:
            self.conn.executescript(SCHEMA)
            columns = {row[1] for row in self.conn.execute("PRAGMA table_info(programs)")}
            if "kept_hash" not in columns:  # a database from before the column: its rows are "" (unknown)
                self.conn.execute("ALTER TABLE programs ADD COLUMN kept_hash TEXT NOT NULL DEFAULT ''")
            self.conn.commit()
        except sqlite3.DatabaseError as err:
            self.conn.close()
            raise ValueError(f"program database {str(self.path)!r} is not a kvsieve SQLite database ({err}); "
                             "give a new path with --db") from None

    def close(self) -> None:
        self.conn.close()

    # --- run configuration: a resumed run must be the same run --------------------------------------

    def check_config(self, config: dict) -> None:
        """Store ``config`` and the helpers' semantics (``features.HELPERS_VERSION``) on first use; refuse to
        resume a database made with another config or under other helpers (its scores are not what its
        programs compute now)."""
        row = self.conn.execute("SELECT value FROM meta WHERE key = 'config'").fetchone()
        text = json.dumps(config, sort_keys=True)
        if row is None or self.conn.execute("SELECT COUNT(*) FROM programs").fetchone()[0] == 0:
            # new, or nothing evaluated under the stored config (a run that failed before its first row,
            # e.g. on a typo): this config takes its place instead of being refused
            with self.conn:
                self.conn.execute("INSERT OR REPLACE INTO meta VALUES ('config', ?)", (text,))
            self.set_meta("helpers_version", HELPERS_VERSION)
            return
        recorded = self.meta("helpers_version") or 1  # databases before the version was recorded: 1
        if recorded != HELPERS_VERSION:
            raise ValueError(f"{self.path} was evaluated with version {recorded} of the program helpers and this "
                             f"kvsieve interprets version {HELPERS_VERSION} (kvsieve/language/program_features.py: "
                             "HELPERS_VERSION), so its stored scores may not be what its programs compute now; start "
                             "another db (reports and `benchmarks/evolve_compare.py` still read this one)")
        stored = json.loads(row[0])
        # keys the stored run does not know came with a newer kvsieve; they cannot have shaped its rows
        changed = sorted(k for k in stored if stored[k] != config.get(k) and k not in RESUMABLE_KEYS)
        if changed:
            diff = ", ".join(f"{k}: {stored.get(k)!r} -> {config.get(k)!r}" for k in changed)
            raise ValueError(f"{self.path} holds a run with another configuration ({diff}); use a new database")

    def check_numerics(self, dtype: str, threads: int) -> None:
        """Record the dtype the run's model computes in (``"float32"``, ``"bfloat16"``) and the torch thread count
        its dev set is built and its candidates scored with (``--threads``; one on Ray's executor) on first use;
        refuse to resume under others: ``dtype="auto"`` picks per machine, and the thread count sets the order of
        float sums, so the last bits of every score (a resumed run's rows then differ from an uninterrupted run's).
        A database from before either was recorded takes this run's."""
        recorded = self.meta("dtype")
        if recorded is not None and recorded != dtype:
            raise ValueError(f"the evolution database {self.path} was evaluated in {recorded}, and this run's model "
                             f"computes in {dtype}: set dtype = \"{recorded}\" in the config to resume it, or start "
                             "another db")
        recorded_threads = self.meta("torch_threads")
        if recorded_threads is not None and recorded_threads != threads:
            raise ValueError(f"the evolution database {self.path} was evaluated with {recorded_threads} torch "
                             f"thread(s), and this run computes with {threads}: run kvsieve --threads "
                             f"{recorded_threads} (the local executor; Ray's computes with 1) to resume it (the "
                             "count orders float sums, so it changes scores), or start another db")
        self.set_meta("dtype", dtype)
        self.set_meta("torch_threads", threads)

    def meta(self, key: str) -> object:
        """A JSON value stored under ``key`` in the meta table (``None`` if absent)."""
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def set_meta(self, key: str, value: object) -> None:
        with self.conn:
            self.conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))

    def add(self, record: dict) -> int:
        columns = ", ".join(record)
        marks = ", ".join("?" for _ in record)
        values = [json.dumps(v) if isinstance(v, (list, dict)) else v for v in record.values()]
        with self.conn:
            cur = self.conn.execute(f"INSERT INTO programs ({columns}) VALUES ({marks})", values)
        return int(cur.lastrowid)

    def has_slot(self, generation: int, island: int, slot: int) -> bool:
        return self.conn.execute("SELECT 1 FROM programs WHERE generation = ? AND island = ? AND slot = ?",
                                 (generation, island, slot)).fetchone() is not None

    def records(self, where: str = "1", params: tuple = ()) -> list[ProgramRecord]:
        rows = self.conn.execute(f"SELECT * FROM programs WHERE {where} ORDER BY generation, island, slot",
                                 params).fetchall()
        out = []
        for row in rows:
            r = list(row)
            r[5] = json.loads(r[5])
            r[15] = json.loads(r[15])
            r[16] = bool(r[16])
            out.append(ProgramRecord(*r))
        return out

    def by_hash(self, code_hash: str, before_generation: int | None = None) -> ProgramRecord | None:
        """The first evaluated program with this code (before a generation: siblings never count, so the
        answer does not depend on which of them an interrupted run had stored)."""
        where = "code_hash = ? AND status NOT IN ('duplicate', 'migrated', 'no_proposal')"
        params: tuple = (code_hash,)
        if before_generation is not None:
            where += " AND generation < ?"
            params += (before_generation,)
        found = self.records(where, params)
        return found[0] if found else None

    def score_of(self, program: Program) -> float | None:
        """The dev score of ``program``'s code, None if it was never evaluated (what LLM mutators show in prompts)."""
        record = self.by_hash(program.code_hash)
        return None if record is None else record.score

    def by_kept_hash(self, before_generation: int) -> dict[str, ProgramRecord]:
        """The first program before ``before_generation`` that reached stage 2 with each kept-entries hash."""
        found: dict[str, ProgramRecord] = {}
        for record in self.records("kept_hash != '' AND proxy IS NOT NULL AND generation < ? AND status NOT IN "
                                   "('duplicate', 'migrated', 'no_proposal')", (before_generation,)):
            found.setdefault(record.kept_hash, record)
        return found

    def get(self, program_id: int) -> ProgramRecord:
        found = self.records("id = ?", (program_id,))
        if not found:
            raise KeyError(f"no program {program_id}")
        return found[0]

    def scored(self, island: int | None = None, before_generation: int | None = None) -> list[ProgramRecord]:
        """Programs with a task score (they passed every stage), optionally of one island, up to a generation."""
        clauses, params = ["score IS NOT NULL"], []
        if island is not None:
            clauses.append("island = ?")
            params.append(island)
        if before_generation is not None:
            clauses.append("generation < ?")
            params.append(before_generation)
        return self.records(" AND ".join(clauses), tuple(params))

    def elites(self, island: int, before_generation: int) -> list[ProgramRecord]:
        """The best program of each behaviour cell of an island (ties: the earlier slot)."""
        best: dict[str, ProgramRecord] = {}
        for record in self.scored(island, before_generation):
            current = best.get(record.cell)
            if current is None or rank_key(record) > rank_key(current):
                best[record.cell] = record
        return sorted(best.values(), key=lambda r: (r.generation, r.island, r.slot))

    def best(self, island: int | None = None, before_generation: int | None = None) -> ProgramRecord | None:
        scored = self.scored(island, before_generation)
        return max(scored, key=rank_key) if scored else None

    def last_generation(self) -> int:
        row = self.conn.execute("SELECT MAX(generation) FROM programs").fetchone()
        return -1 if row[0] is None else int(row[0])

    def evaluated_count(self) -> int:
        row = self.conn.execute(
            "SELECT COUNT(*) FROM programs WHERE status NOT IN ('duplicate', 'no_proposal', 'migrated')").fetchone()
        return int(row[0])


RESUMABLE_KEYS = ("candidates", "time_budget_s")  # a resumed run may be given more budget


def rank_key(record: ProgramRecord) -> tuple:
    """Higher is better: task score, then a smaller proxy gap, then the earlier slot (never the insertion
    order, which a parallel executor does not fix)."""
    proxy = record.proxy if record.proxy is not None else float("inf")
    return (record.score, -proxy, -record.generation, -record.island, -record.slot)
