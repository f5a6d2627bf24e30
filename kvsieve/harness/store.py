"""The one results store every command reads and writes: a SQLite file with one row per evaluated cell.

A *cell* is one (model, task, context length, sample, policy, compression ratio, question-awareness)
combination. Cells are committed one at a time, so a run killed at any moment loses at most the cell it
was computing; a rerun asks :meth:`ResultsStore.missing` for the cells still to do.

The file uses WAL journaling, so readers (reports, dashboards) never block the writer and vice versa.

Each row records its provenance (``harness/provenance.py``: machine, threads, dtype, versions, code revision)
in the ``provenance`` column; stores written before that column existed gain it on their first write, and
their old rows read back with ``provenance=None`` (unknown). Reading never changes a store.

Each row keeps its point (:class:`~kvsieve.policies.label.Point`) in structured form beside its key (schema 2):
``spec`` (the policy spec, without the mode), ``chunk_size`` and ``evict_every`` (the mode; 0 and 1 for prefill)
and ``recall`` (its :class:`~kvsieve.recall.Recall`'s fields as a JSON object, NULL without one); with the
``ratio`` and ``question_aware`` columns they are the point, and every key read back carries it
(:attr:`CellKey.point`), so no report reads a label's text. The ``policy`` column still holds the stored label: the
key rows are matched by. A store written before (schema 1) gets its rows' points derived once from their labels,
by :meth:`ResultsStore.store_points` (``python -m kvsieve.harness.migrate``, or its first write); until then it is
read by deriving them in memory, the same way.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvsieve.harness.provenance import current as current_provenance
from kvsieve.policies.label import Mode, Point
from kvsieve.recall import Recall

__all__ = ["POINT_COLUMNS", "SCHEMA_VERSION", "TIMING_CONFIG_KEYS", "CellKey", "CellResult", "FailedCell",
           "ResultsStore", "SchemaVersionError", "read_stores"]

SCHEMA_VERSION = 2  # 2: each row's point in structured form (POINT_COLUMNS)
RATIO_DECIMALS = 6

KEY_COLUMNS = ("model", "task", "length", "sample_id", "policy", "ratio", "question_aware")
# a row's point besides its ratio and question-awareness (key columns): the spec and the mode (Point, Mode, Recall)
POINT_COLUMNS = ("spec", "chunk_size", "evict_every", "recall")
_POINT_TYPES = {"spec": "TEXT", "chunk_size": "INTEGER", "evict_every": "INTEGER", "recall": "TEXT"}
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
# both tables' point columns (nullable: a store written before them gains them by ALTER TABLE, then filled)
_POINT_DDL = "".join(f"    {col} {_POINT_TYPES[col]},\n" for col in POINT_COLUMNS)

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS schema_version (
    version INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS cells (
    id INTEGER PRIMARY KEY,
{_KEY_DDL}{_POINT_DDL}    prediction TEXT NOT NULL,
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
_INSERT = (f"INSERT OR IGNORE INTO cells ({', '.join(KEY_COLUMNS + POINT_COLUMNS + _VALUE_COLUMNS)}) "
           f"VALUES ({', '.join('?' * (len(KEY_COLUMNS) + len(POINT_COLUMNS) + len(_VALUE_COLUMNS)))})")
_MATCH_KEY = " AND ".join(f"c.{col} = k.{col}" for col in KEY_COLUMNS)


class SchemaVersionError(ValueError):
    """The store was written by a newer (or unknown) version of kvsieve."""


@lru_cache(maxsize=65536)
def _point_of_label(policy: str, ratio: float, question_aware: bool) -> Point:
    """A stored key's label, ratio and question-awareness read as a point: the one place a row's label is read as
    text, for the migration of a store written before rows kept their point (:meth:`ResultsStore.store_points`), for
    such a store read before it is migrated (in memory: reading never changes a store), and for a key written by hand
    from its text (``CellKey("m", "t", 1024, "s0", "tova@decode64", 0.5, False)``)."""
    return Point(policy, ratio, question_aware)


@lru_cache(maxsize=65536)
def _stored_point(spec: str, ratio: float, question_aware: bool, chunk_size: int, evict_every: int,
                  recall: str | None) -> Point:
    """A row's point from its structured columns (no label is read)."""
    mode = Mode(int(chunk_size), int(evict_every), Recall(**json.loads(recall)) if recall else None)
    return Point(spec, ratio, question_aware, mode)


def _point_columns(point: Point) -> tuple:
    """``point`` as its row keeps it (:data:`POINT_COLUMNS`)."""
    recall = point.mode.recall
    return (point.spec, point.chunk_size, point.evict_every,
            json.dumps(asdict(recall), sort_keys=True) if recall is not None else None)


@dataclass(frozen=True)
class CellKey:
    """Identifies one evaluated cell. Hashable, so it can live in sets and dict keys.

    ``policy`` is the point's stored label such as ``snapkv``, ``snapkv(window=32)`` or ``tova@decode64``;
    ``ratio`` is the compression ratio (fraction of the cache removed; ``0`` for the full cache) and is
    compared after rounding to 6 decimals. ``point`` is the cell's :class:`Point`: given by :meth:`of`, built from
    the row's structured columns when read back from a store (what reports use: they never read the label's text);
    a key written with its label alone gets its point read from the label. Keys are equal by the columns above.
    """

    model: str
    task: str
    length: int
    sample_id: str
    policy: str
    ratio: float
    question_aware: bool
    point: Point = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        point = self.point
        if point is None:
            object.__setattr__(self, "point", _point_of_label(str(self.policy), float(self.ratio),
                                                              bool(self.question_aware)))
        elif not isinstance(point, Point) or (point.stored, point.question_aware) != (self.policy,
                                                                                      bool(self.question_aware)) \
                or round(point.ratio, RATIO_DECIMALS) != round(float(self.ratio), RATIO_DECIMALS):
            raise ValueError(f"cell key {self.policy!r} at ratio {self.ratio!r} (question-aware: "
                             f"{self.question_aware!r}) was given another point: {point!r}")

    @classmethod
    def of(cls, model: str, task: str, length: int, sample_id: str, point: Point) -> CellKey:
        """The key of ``point`` evaluated on one sample: its stored label, ratio and question-awareness (the
        one place a key is built from a point; a key read back from a row is built from its columns)."""
        return cls(model, task, length, sample_id, point.stored, point.ratio, point.question_aware, point)

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
{_KEY_DDL}{_POINT_DDL}    reason TEXT NOT NULL,
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
    return result.key.as_row() + _point_columns(result.key.point) + (
        str(result.prediction), float(result.score), answers, int(result.kept_tokens), int(result.cache_bytes),
        int(result.cache_bytes_full), float(result.prefill_seconds), float(result.decode_seconds), config,
        time.time(), provenance,
    )


def _key_of(row: sqlite3.Row, structured: bool) -> CellKey:
    """A row's key with its point: from its point columns (``structured``), or from its label (a store not migrated,
    read in memory)."""
    question_aware = bool(row["question_aware"])
    if structured:
        point = _stored_point(row["spec"], row["ratio"], question_aware, row["chunk_size"], row["evict_every"],
                              row["recall"])
    else:
        point = _point_of_label(row["policy"], row["ratio"], question_aware)
    return CellKey(row["model"], row["task"], row["length"], row["sample_id"], row["policy"], row["ratio"],
                   question_aware, point)


def _from_row(row: sqlite3.Row, structured: bool) -> CellResult:
    key = _key_of(row, structured)
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
        columns = {r[1] for r in conn.execute("PRAGMA table_info(cells)")}
        self._has_provenance = "provenance" in columns
        self._has_points = set(POINT_COLUMNS) <= columns

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

    @property
    def points_stored(self) -> bool:
        """Whether the rows keep their points in structured form (schema 2); False: a store written before, read by
        deriving each row's point from its label until :meth:`store_points` migrates it."""
        return self._has_points

    def _tables(self) -> list[str]:
        found = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return [t for t in ("cells", "failed_cells") if t in found]

    def unstored_points(self) -> int:
        """Rows and failed cells whose point the store does not yet keep in structured form (0 once migrated)."""
        total = 0
        for table in self._tables():
            columns = {r[1] for r in self.conn.execute(f"PRAGMA table_info({table})")}
            where = " WHERE spec IS NULL" if "spec" in columns else ""
            total += self.conn.execute(f"SELECT COUNT(*) FROM {table}{where}").fetchone()[0]
        return total

    def store_points(self) -> int:
        """Migrate a store written before rows kept their point (schema 1): add the point columns and fill them, each
        distinct label, ratio and question-awareness read once from its text (the one place a stored label is
        parsed), then mark the store schema 2; all in one transaction. A label that does not read as a point stops
        it, naming the label, with nothing changed. Done by ``python -m kvsieve.harness.migrate`` and by the first
        write; a no-op on a migrated store. Returns the rows and failed cells given their point."""
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        filled = 0
        try:
            for table in self._tables():  # looked at under the write lock: another writer may have migrated it
                columns = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
                for col in POINT_COLUMNS:
                    if col not in columns:
                        conn.execute(f"ALTER TABLE {table} ADD COLUMN {col} {_POINT_TYPES[col]}")
                labels = conn.execute(f"SELECT DISTINCT policy, ratio, question_aware FROM {table} "
                                      "WHERE spec IS NULL").fetchall()
                for policy, ratio, question_aware in labels:
                    try:
                        point = _point_of_label(policy, ratio, bool(question_aware))
                    except ValueError as err:
                        raise ValueError(f"results store {self.path}: the label {policy!r} at ratio {ratio!r} "
                                         f"({table}) does not read as a point ({err}); nothing was migrated") from None
                    filled += conn.execute(
                        f"UPDATE {table} SET {', '.join(f'{col} = ?' for col in POINT_COLUMNS)} WHERE policy = ? "
                        "AND ratio = ? AND question_aware = ? AND spec IS NULL",
                        _point_columns(point) + (policy, ratio, question_aware)).rowcount
            if (conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] or 0) < SCHEMA_VERSION:
                conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        self._has_points = True
        return filled

    def _migrate_on_write(self) -> None:
        """What a write needs of a store written before: the provenance column, the rows' points."""
        self._add_provenance_column()
        if not self._has_points:
            self.store_points()

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
        self._migrate_on_write()
        cursor = self.conn.execute(_INSERT, _result_row(result))
        return cursor.rowcount == 1

    def add_many(self, results: Iterable[CellResult]) -> int:
        """Insert many cells in one transaction; keys already stored are skipped. Returns the number inserted."""
        rows = [_result_row(r) for r in results]
        self._migrate_on_write()
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
        rows = [f.key.as_row() + _point_columns(f.key.point)
                + (str(f.reason), json.dumps(f.config, sort_keys=True, default=str), time.time()) for f in failures]
        if not rows:
            return 0
        self._migrate_on_write()  # an old failed_cells table gains its points before this one is (not) made
        conn = self.conn
        conn.execute(_FAILED_SCHEMA)
        conn.execute("BEGIN IMMEDIATE")
        try:
            columns = KEY_COLUMNS + POINT_COLUMNS
            conn.executemany(f"INSERT OR REPLACE INTO failed_cells ({', '.join(columns)}, reason, config, "
                             f"created_at) VALUES ({', '.join('?' * (len(columns) + 3))})", rows)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return len(rows)

    def rename_policies(self, renames: dict[str, str]) -> int:
        """Store the rows and failed cells of each label ``old`` of ``renames`` under its ``new`` label, all in one
        transaction (a migration of keys, ``kvsieve/harness/migrate.py``); each row's config records its point under
        the new label and the key it had (``renamed_from``), and its stored point the new label's spec. Returns the rows
        renamed. ``ValueError``, changing nothing, when a cell would be stored twice under a new label."""
        self._migrate_on_write()
        conn = self.conn
        failed = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'failed_cells'").fetchone()
        same = " AND ".join(f"c.{col} = k.{col}" for col in KEY_COLUMNS if col != "policy")
        renamed = 0
        conn.execute("BEGIN IMMEDIATE")
        try:
            for old, new in renames.items():
                old_spec, new_spec = Point(old).spec, Point(new).spec  # labels a migration was given, read as text
                conn.execute("UPDATE cells SET config = json_set(config, '$.cell.policy', ?) "
                             "WHERE policy = ? AND json_extract(config, '$.cell.policy') = ?",
                             (new_spec, old, old_spec))
                renamed += conn.execute("UPDATE cells SET policy = ?, spec = ?, "
                                        "config = json_set(config, '$.renamed_from', ?) WHERE policy = ?",
                                        (new, new_spec, old, old)).rowcount
                if failed is not None:  # a cell failed under both labels: the new label's failure stays
                    conn.execute(f"DELETE FROM failed_cells AS k WHERE k.policy = ? AND EXISTS "
                                 f"(SELECT 1 FROM failed_cells AS c WHERE c.policy = ? AND {same})", (old, new))
                    conn.execute("UPDATE failed_cells SET policy = ?, spec = ? WHERE policy = ?", (new, new_spec, old))
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
            out.append(FailedCell(_key_of(r, self._has_points), r["reason"], json.loads(r["config"])))
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
        return [_from_row(r, self._has_points)
                for r in self.conn.execute(f"SELECT * FROM cells{where} ORDER BY id", params)]

    def keys(self, **filters: Any) -> list[CellKey]:
        """Stored keys in insertion order, with the same filters as :meth:`rows`."""
        where, params = self._where(filters)
        columns = KEY_COLUMNS + (POINT_COLUMNS if self._has_points else ())
        sql = f"SELECT {', '.join(columns)} FROM cells{where} ORDER BY id"
        return [_key_of(r, self._has_points) for r in self.conn.execute(sql, params)]

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
