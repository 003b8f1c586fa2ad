"""The corpus as a row-addressable store: faiss id i is corpus row i.

wiki-18 has 21M passages (~13 GB gzipped); like Search-R1's server we go through `datasets`,
which converts the JSONL once into Arrow files that are memory-mapped, so looking up the top-k
rows of a batch costs neither a full load into Python objects nor a re-parse per start.

Every open checks every row with Arrow compute (a few seconds for wiki-18): `contents` must be
a non-empty, not whitespace-only, valid UTF-8 string and `id` present, since a bad passage
would otherwise surface only when encoding or search reaches it. When the conversion or the
check fails, the file is read again line by line (`a2tgpo.data.jsonl`) to name the first bad
line; rows are its non-blank lines, in order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

from a2tgpo.data.jsonl import DataFileError, describe, iter_jsonl

log = logging.getLogger(__name__)


def row_problem(row: dict) -> str | None:
    """What is wrong with one parsed corpus row, or None."""
    if "contents" not in row:
        return "no 'contents'"
    contents = row["contents"]
    if not isinstance(contents, str):
        return f"'contents' is not a string but {describe(contents)}"
    if not contents.strip():
        return f"'contents' is empty or whitespace only ({describe(contents)})"
    raw_id = row.get("id")
    if raw_id is None or isinstance(raw_id, bool) or not isinstance(raw_id, str | int):
        return f"'id' is missing or not a string ({describe(raw_id)})"
    return None


def first_bad_row(path: str | Path) -> None:
    """Read the corpus line by line; raise DataFileError at the first bad line (not UTF-8, not
    JSON, not an object, a bad row) or for an empty file; return if every row is good."""
    for lineno, row in iter_jsonl(path):
        if problem := row_problem(row):
            raise DataFileError(f"{path} line {lineno}: {problem}")


class DocStore:
    """Rows `{"id", "contents"}` of a wiki-18-format JSONL corpus (plain or gzipped)."""

    def __init__(self, corpus_path: str | Path, cache_dir: str | Path | None = None):
        import datasets

        self.path = Path(corpus_path)
        if not self.path.is_file():
            raise FileNotFoundError(f"corpus {self.path} not found")
        log.info("opening corpus %s", self.path)
        try:
            ds = datasets.Dataset.from_json(
                str(self.path), cache_dir=None if cache_dir is None else str(cache_dir)
            )
        except Exception as e:  # datasets names neither the file nor the line
            log.warning("%s: could not be converted (%s); locating the first bad line", self.path,
                      e)
            first_bad_row(self.path)
            raise DataFileError(f"{self.path}: not readable as JSON lines ({e!r})") from e
        missing = {"id", "contents"} - set(ds.column_names)
        if missing:
            raise DataFileError(f"{self.path}: corpus rows need 'id' and 'contents'; "
                                f"missing {sorted(missing)} (columns: {ds.column_names})")
        self.ds = ds.select_columns(["id", "contents"])
        self._check_rows()

    def _check_rows(self) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        start = time.perf_counter()
        table = self.ds.data.table  # memory-mapped; pyarrow compute reads it in place
        ids, contents = table.column("id"), table.column("contents")
        problem = None
        # datasets gives a column whose rows mix JSON types (a number among the strings) its
        # JSON extension type, so a string type means every present value is a string
        if not (pa.types.is_string(contents.type) or pa.types.is_large_string(contents.type)):
            problem = f"'contents' is not a string in every row (column type {contents.type})"
        elif contents.null_count or ids.null_count:
            problem = "'contents' or 'id' is missing or null in some row"
        else:
            try:
                contents.validate(full=True)  # UTF-8 of every string
            except pa.ArrowInvalid as e:
                problem = f"'contents' is not valid UTF-8 somewhere ({e})"
            else:
                # utf8_is_space is false for "" (hence the length test) and stops at the first
                # non-space character, so a passage costs a byte or two
                empty = pc.or_(pc.equal(pc.binary_length(contents), 0),
                               pc.utf8_is_space(contents))
                if pc.any(empty).as_py():
                    problem = "'contents' is empty or whitespace only in some row"
        if problem is not None:
            log.warning("%s: %s; locating the first bad line", self.path, problem)
            first_bad_row(self.path)
            raise DataFileError(f"{self.path}: {problem}")
        log.info("corpus %s: %d rows, every 'contents' a non-empty UTF-8 string (checked in "
                 "%.1f s)", self.path, len(self), time.perf_counter() - start)

    def __len__(self) -> int:
        return len(self.ds)

    def get(self, rows: list[int]) -> list[dict]:
        """Rows by position; ids come back as strings (wiki-18 ids are numeric strings)."""
        if not rows:
            return []
        batch = self.ds[list(rows)]
        return [{"id": str(i), "contents": c}
                for i, c in zip(batch["id"], batch["contents"], strict=True)]

    def contents(self, start: int, end: int, chunk: int = 10_000) -> Iterator[list[str]]:
        """`contents` of rows [start, end) in chunks of at most `chunk` rows."""
        for s in range(start, end, chunk):
            yield self.ds[s: min(end, s + chunk)]["contents"]
