"""The one results store every command reads and writes: a SQLite file with one row per evaluated cell.

A *cell* is one (model, task, context length, sample, policy, compression ratio, question-awareness)
combination. Cells are committed one at a time, so a run killed at any moment loses at most the cell it
was computing; a rerun asks :meth:`ResultsStore.missing` for the cells still to do.

The file uses WAL journaling, so readers (reports, dashboards) never block the writer and vice versa.

Each row records its provenance (``harness/provenance.py``: machine, threads, dtype, versions, code revision)
in the ``provenance`` column; stores written before that column existed gain it on their first write, and
their old rows read back with ``provenance=None`` (unknown). Reading never changes a store.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsieve.harness.provenance import current as current_provenance
from kvsieve.policies.label import Point

__all__ = ["SCHEMA_VERSION", "TIMING_CONFIG_KEYS", "CellKey", "CellResult", "FailedCell", "ResultsStore",
           "SchemaVersionError", "read_stores"]

SCHEMA_VERSION = 1
RATIO_DECIMALS = 6

KEY_COLUMNS = ("model", "task", "length", "sample_id", "policy", "ratio", "question_aware")
# timings a shared-grid cell records in its config, beside the prefill/decode columns: the prefill its
# sample's cells share and the cell's own compression, both timed in one process (the headline's overhead)
TIMING_CONFIG_KEYS = ("prefill_only_seconds", "compress_seconds")

# the columns that identify a cell, as both tables declare them (in KEY_COLUMNS' order)
_KEY_DDL = """    model TEXT NOT NULL,
    task TEXT NOT NULL,
    length INTEGER NOT NULL,
    sample_id TEXT NOT NULL,
    policy TEXT NOT NULL,
    ratio REAL NOT NULL,
    question_aware INTEGER NOT NULL,
"""

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS schema_version (
    version INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS cells (
    id INTEGER PRIMARY KEY,
{_KEY_DDL}    prediction TEXT NOT NULL,
    score REAL NOT NULL,
    answers TEXT NOT NULL,
    kept_tokens INTEGER NOT NULL,
    cache_bytes INTEGER NOT NULL,
    cache_bytes_full INTEGER NOT NULL,
    prefill_seconds REAL NOT NULL,
    decode_seconds REAL NOT NULL,
    config TEXT NOT NULL,
    created_at REAL NOT NULL,
    provenance TEXT,
    UNIQUE ({", ".join(KEY_COLUMNS)})
);
CREATE INDEX IF NOT EXISTS cells_policy ON cells (policy, ratio);
"""

_VALUE_COLUMNS = ("prediction", "score", "answers", "kept_tokens", "cache_bytes", "cache_bytes_full",
                  "prefill_seconds", "decode_seconds", "config", "created_at", "provenance")
_INSERT = (f"INSERT OR IGNORE INTO cells ({', '.join(KEY_COLUMNS + _VALUE_COLUMNS)}) "
           f"VALUES ({', '.join('?' * (len(KEY_COLUMNS) + len(_VALUE_COLUMNS)))})")
_MATCH_KEY = " AND ".join(f"c.{col} = k.{col}" for col in KEY_COLUMNS)


class SchemaVersionError(ValueError):
    """The store was written by a newer (or unknown) version of kvsieve."""


@dataclass(frozen=True)
class CellKey:
    """Identifies one evaluated cell. Hashable, so it can live in sets and dict keys.

    ``policy`` is a canonical policy spec string such as ``snapkv`` or ``snapkv(window=32)``;
    ``ratio`` is the compression ratio (fraction of the cache removed; ``0`` for the full cache) and is
    compared after rounding to 6 decimals.
    """

    model: str
    task: str
    length: int
    sample_id: str
    policy: str
    ratio: float
    question_aware: bool

    @classmethod
    def of(cls, model: str, task: str, length: int, sample_id: str, point: Point) -> CellKey:
        """The key of ``point`` evaluated on one sample: its stored label, ratio and question-awareness (the
        one place a key is built from a point; a key read back from a row is built from its columns)."""
        return cls(model, task, length, sample_id, point.stored, point.ratio, point.question_aware)

    def as_row(self) -> tuple:
        """The key as stored: ratio rounded, booleans as integers."""
        return (str(self.model), str(self.task), int(self.length), str(self.sample_id), str(self.policy),
                round(float(self.ratio), RATIO_DECIMALS), int(bool(self.question_aware)))


@dataclass
class CellResult:
    """The outcome of one cell. ``config`` is the exact run configuration (must be JSON serialisable;
    tuples come back as lists)."""

    key: CellKey
    prediction: str
    score: float
    answers: list[str]
    kept_tokens: int
    cache_bytes: int
    cache_bytes_full: int
    prefill_seconds: float
    decode_seconds: float
    config: dict
    # machine, threads, dtype, versions, revision (harness/provenance.py); None on writing: this process's
    # (a row computed elsewhere, on a Ray worker, brings its own); None on reading: an old row, unknown
    provenance: dict | None = None


@dataclass
class FailedCell:
    """A cell whose policy failed: it raised, exceeded a budget, scored NaN, or its selection did not fit the
    cell's budget. It has no score, only the ``reason``; the store keeps it apart from scored rows (table
    ``failed_cells``, made on the first failure written), so no mean ever includes it, and a rerun retries it."""

    key: CellKey
    reason: str
    config: dict = field(default_factory=dict)


# made on the first failure written (never on opening: a report does not change the file it reads)
_FAILED_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS failed_cells (
    id INTEGER PRIMARY KEY,
{_KEY_DDL}    reason TEXT NOT NULL,
    config TEXT NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE ({", ".join(KEY_COLUMNS)})
)
"""


def _result_row(result: CellResult) -> tuple:
    try:
        config = json.dumps(result.config, sort_keys=True)
        answers = json.dumps([str(a) for a in result.answers])
        provenance = json.dumps(result.provenance or current_provenance(result.config.get("dtype")), sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"config of cell {result.key} is not JSON serialisable: {exc}") from exc
    return result.key.as_row() + (
        str(result.prediction), float(result.score), answers, int(result.kept_tokens), int(result.cache_bytes),
        int(result.cache_bytes_full), float(result.prefill_seconds), float(result.decode_seconds), config,
        time.time(), provenance,
    )


def _from_row(row: sqlite3.Row) -> CellResult:
    key = CellKey(model=row["model"], task=row["task"], length=row["length"], sample_id=row["sample_id"],
                  policy=row["policy"], ratio=row["ratio"], question_aware=bool(row["question_aware"]))
    return CellResult(key=key, prediction=row["prediction"], score=row["score"], answers=json.loads(row["answers"]),
                      kept_tokens=row["kept_tokens"], cache_bytes=row["cache_bytes"],
                      cache_bytes_full=row["cache_bytes_full"], prefill_seconds=row["prefill_seconds"],
                      decode_seconds=row["decode_seconds"], config=json.loads(row["config"]),
                      provenance=json.loads(row["provenance"]) if "provenance" in row.keys() and row["provenance"]
                      else None)


def _normalise_filter(column: str, value: Any) -> Any:
    if column == "ratio":
        return round(float(value), RATIO_DECIMALS)
    if column == "question_aware":
        return int(bool(value))
    if column == "length":
        return int(value)
    return str(value)


class ResultsStore:
    """A SQLite results store at ``path`` (created, with its parent folders, if absent).

    Raises ``ValueError`` naming the path if the file is not a SQLite database or not a results store,
    and :class:`SchemaVersionError` (a ``ValueError``) if it was written with a newer schema version.
    One instance holds one connection; use one instance per thread / process.
    """

    def __init__(self, path: str | Path, timeout: float = 60.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn: sqlite3.Connection | None = None
        try:
            conn = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
        except sqlite3.Error as exc:
            raise ValueError(f"cannot open results store {self.path}: {exc}") from exc
        conn.row_factory = sqlite3.Row
        try:
            self._init(conn)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, sqlite3.OperationalError):  # locked, unreadable, ...: not a format problem
                raise sqlite3.OperationalError(f"results store {self.path}: {exc}") from exc
            if isinstance(exc, sqlite3.DatabaseError):  # not a database, malformed image
                raise ValueError(f"{self.path} is not a valid kvsieve results store (SQLite error: {exc})") from exc
            raise
        self._conn = conn

    def _init(self, conn: sqlite3.Connection) -> None:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if tables and "schema_version" not in tables:
                raise ValueError(f"{self.path} is a SQLite database but not a kvsieve results store "
                                 f"(tables: {', '.join(sorted(tables))})")
            if "schema_version" in tables:
                row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
                version = row[0]
                if version is not None and version > SCHEMA_VERSION:
                    raise SchemaVersionError(
                        f"results store {self.path} has schema version {version}, but this kvsieve only "
                        f"understands versions <= {SCHEMA_VERSION}; upgrade kvsieve to read it")
                if version is not None and version < 1:
                    raise SchemaVersionError(f"results store {self.path} has unknown schema version {version}")
            # executescript() would commit the open transaction, so run the statements one by one
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            if conn.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == 0:
                conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        self._has_provenance = "provenance" in {r[1] for r in conn.execute("PRAGMA table_info(cells)")}

    def _add_provenance_column(self) -> None:
        """Migrate a store written before rows recorded provenance: the column, NULL (unknown) for old rows.
        Done on the first write, not on opening, so a report never changes the file it reads."""
        if not self._has_provenance:
            try:
                self.conn.execute("ALTER TABLE cells ADD COLUMN provenance TEXT")
            except sqlite3.OperationalError as exc:  # another writer added it first
                if "duplicate column" not in str(exc):
                    raise
            self._has_provenance = True

    # -- connection management -------------------------------------------------------------------------

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise ValueError(f"results store {self.path} is closed")
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> ResultsStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._conn is None else "open"
        return f"ResultsStore({str(self.path)!r}, {state})"

    @property
    def schema_version(self) -> int:
        return self.conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0]

    # -- writing ------------------------------------------------------------------------------------------

    def add(self, result: CellResult) -> bool:
        """Insert one cell and commit. Returns ``False`` (and changes nothing) if the key is already stored."""
        self._add_provenance_column()
        cursor = self.conn.execute(_INSERT, _result_row(result))
        return cursor.rowcount == 1

    def add_many(self, results: Iterable[CellResult]) -> int:
        """Insert many cells in one transaction; keys already stored are skipped. Returns the number inserted."""
        rows = [_result_row(r) for r in results]
        self._add_provenance_column()
        conn = self.conn
        before = conn.total_changes
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(_INSERT, rows)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return conn.total_changes - before

    def add_failed(self, failures: Iterable[FailedCell]) -> int:
        """Record failed cells (one transaction; a key failed before gets the newer reason). Returns how many."""
        rows = [f.key.as_row() + (str(f.reason), json.dumps(f.config, sort_keys=True, default=str), time.time())
                for f in failures]
        if not rows:
            return 0
        conn = self.conn
        conn.execute(_FAILED_SCHEMA)
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(f"INSERT OR REPLACE INTO failed_cells ({', '.join(KEY_COLUMNS)}, reason, config, "
                             f"created_at) VALUES ({', '.join('?' * (len(KEY_COLUMNS) + 3))})", rows)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return len(rows)

    def rename_policies(self, renames: dict[str, str]) -> int:
        """Store the rows and failed cells of each label ``old`` of ``renames`` under its ``new`` label, all in one
        transaction (a migration of keys, ``kvsieve/harness/migrate.py``); each row's config records its point under
        the new label and the key it had (``renamed_from``). Returns the rows renamed. ``ValueError``, changing
        nothing, when a cell would be stored twice under a new label."""
        conn = self.conn
        failed = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'failed_cells'").fetchone()
        same = " AND ".join(f"c.{col} = k.{col}" for col in KEY_COLUMNS if col != "policy")
        renamed = 0
        conn.execute("BEGIN IMMEDIATE")
        try:
            for old, new in renames.items():
                conn.execute("UPDATE cells SET config = json_set(config, '$.cell.policy', ?) "
                             "WHERE policy = ? AND json_extract(config, '$.cell.policy') = ?",
                             (Point(new).spec, old, Point(old).spec))
                renamed += conn.execute("UPDATE cells SET policy = ?, config = json_set(config, '$.renamed_from', ?) "
                                        "WHERE policy = ?", (new, old, old)).rowcount
                if failed is not None:  # a cell failed under both labels: the new label's failure stays
                    conn.execute(f"DELETE FROM failed_cells AS k WHERE k.policy = ? AND EXISTS "
                                 f"(SELECT 1 FROM failed_cells AS c WHERE c.policy = ? AND {same})", (old, new))
                    conn.execute("UPDATE failed_cells SET policy = ? WHERE policy = ?", (new, old))
            conn.execute("COMMIT")
        except sqlite3.IntegrityError as exc:
            conn.execute("ROLLBACK")
            raise ValueError(f"results store {self.path}: a cell of {old!r} is already stored under {new!r} ({exc}); "
                             "nothing was renamed") from None
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return renamed

    # -- reading ------------------------------------------------------------------------------------------

    def failed(self, **filters: Any) -> list[FailedCell]:
        """Failed cells not since stored with a score, in insertion order, with the same filters as :meth:`rows`."""
        if self.conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'failed_cells'"
                             ).fetchone() is None:
            return []
        where, params = self._where(filters)
        scored = " AND ".join(f"c.{col} = k.{col}" for col in KEY_COLUMNS)
        where = (where + " AND" if where else " WHERE") + f" NOT EXISTS (SELECT 1 FROM cells AS c WHERE {scored})"
        out = []
        for r in self.conn.execute(f"SELECT * FROM failed_cells AS k{where} ORDER BY id", params):
            key = CellKey(model=r["model"], task=r["task"], length=r["length"], sample_id=r["sample_id"],
                          policy=r["policy"], ratio=r["ratio"], question_aware=bool(r["question_aware"]))
            out.append(FailedCell(key, r["reason"], json.loads(r["config"])))
        return out

    def has(self, key: CellKey) -> bool:
        where = " AND ".join(f"{col} = ?" for col in KEY_COLUMNS)
        return self.conn.execute(f"SELECT 1 FROM cells WHERE {where} LIMIT 1", key.as_row()).fetchone() is not None

    def missing(self, keys: Iterable[CellKey]) -> list[CellKey]:
        """The keys not yet stored, in input order (a key repeated in the input is returned once)."""
        unique: dict[CellKey, None] = dict.fromkeys(keys)
        if not unique:
            return []
        ordered = list(unique)
        conn = self.conn
        conn.execute("BEGIN")
        try:
            conn.execute("DROP TABLE IF EXISTS temp.wanted")
            conn.execute(f"CREATE TEMP TABLE wanted (idx INTEGER PRIMARY KEY, {', '.join(KEY_COLUMNS)})")
            conn.executemany(f"INSERT INTO temp.wanted VALUES (?, {', '.join('?' * len(KEY_COLUMNS))})",
                             ((i,) + key.as_row() for i, key in enumerate(ordered)))
            found = conn.execute(
                f"SELECT k.idx FROM temp.wanted AS k WHERE NOT EXISTS "
                f"(SELECT 1 FROM cells AS c WHERE {_MATCH_KEY}) ORDER BY k.idx").fetchall()
            conn.execute("DROP TABLE temp.wanted")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return [ordered[row[0]] for row in found]

    def _where(self, filters: dict[str, Any]) -> tuple[str, list]:
        clauses, params = [], []
        for column, value in filters.items():
            if column not in KEY_COLUMNS:
                raise TypeError(f"unknown filter {column!r}; filters must be key columns: {', '.join(KEY_COLUMNS)}")
            if isinstance(value, (list, tuple, set, frozenset)):
                values = [_normalise_filter(column, v) for v in value]
                if not values:
                    clauses.append("0")
                    continue
                clauses.append(f"{column} IN ({', '.join('?' * len(values))})")
                params.extend(values)
            else:
                clauses.append(f"{column} = ?")
                params.append(_normalise_filter(column, value))
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", params

    def rows(self, **filters: Any) -> list[CellResult]:
        """Stored cells in insertion order. Each filter is equality on a key column
        (``model=``, ``task=``, ``length=``, ``sample_id=``, ``policy=``, ``ratio=``, ``question_aware=``);
        a list / tuple / set value matches any of its elements."""
        where, params = self._where(filters)
        return [_from_row(r) for r in self.conn.execute(f"SELECT * FROM cells{where} ORDER BY id", params)]

    def keys(self, **filters: Any) -> list[CellKey]:
        """Stored keys in insertion order, with the same filters as :meth:`rows`."""
        where, params = self._where(filters)
        sql = f"SELECT {', '.join(KEY_COLUMNS)} FROM cells{where} ORDER BY id"
        return [CellKey(model=r[0], task=r[1], length=r[2], sample_id=r[3], policy=r[4], ratio=r[5],
                        question_aware=bool(r[6])) for r in self.conn.execute(sql, params)]

    def dtypes(self, **filters: Any) -> set[str]:
        """The dtypes the stored cells were computed in (their config's ``dtype``), with the same filters as
        :meth:`rows`; rows that recorded none, or only the ``"auto"`` that asked for one, are left out."""
        where, params = self._where(filters)
        sql = f"SELECT DISTINCT json_extract(config, '$.dtype') FROM cells{where}"
        return {r[0] for r in self.conn.execute(sql, params)} - {None, "auto"}

    def count(self, **filters: Any) -> int:
        """Number of stored cells (optionally filtered like :meth:`rows`)."""
        where, params = self._where(filters)
        return self.conn.execute(f"SELECT COUNT(*) FROM cells{where}", params).fetchone()[0]


def read_stores(paths: Sequence[str | Path], **filters: Any) -> tuple[list[CellResult], list[FailedCell]]:
    """The rows and failed cells of several existing stores pooled, filtered like :meth:`ResultsStore.rows`:
    replicate test sets scored into stores of their own are reported as one. A cell stored in two of them
    is refused (it would count twice), naming the cell and both stores."""
    if not paths:
        raise ValueError("no results store given")
    rows: list[CellResult] = []
    failures: list[FailedCell] = []
    seen: dict[CellKey, Path] = {}
    for path in map(Path, paths):
        if not path.is_file():
            raise ValueError(f"results store {path} does not exist")
        with ResultsStore(path) as store:
            these, failed = store.rows(**filters), store.failed(**filters)
        for row in these:
            if row.key in seen:
                raise ValueError(f"cell {row.key} is in both {seen[row.key]} and {path}; pooled stores must hold "
                                 "disjoint cells (one request scored once)")
            seen[row.key] = path
        rows += these
        failures += failed
    return rows, [f for f in failures if f.key not in seen]  # failed in one store, scored in another
