"""JSON Lines read line by line, with errors that name the file and the 1-based line.

QA files (FlashRAG layout) are read through `iter_jsonl` directly: they are small, and reading
them as Python values keeps every row's JSON types (an answer written as 1912 is not forced into
an Arrow column type inferred from other rows). The corpus is converted by `datasets` for
speed and memory-mapping (`a2tgpo.retrieval.docstore`); when that conversion fails, or its
checks find a bad row, the same reader locates the line.

Blank (whitespace-only) lines are skipped and not counted as rows, as `datasets` does; line
numbers count every line of the file. A UTF-8 byte order mark at the start of the file is
ignored. Gzipped files (`.gz`, detected by their magic bytes) are read transparently.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

_BOM = b"\xef\xbb\xbf"


class DataFileError(ValueError):
    """A data file (QA set, corpus) is unreadable or holds a bad row; the message names the file
    and, where there is one, the line or row."""


def _open(path: Path) -> BinaryIO:
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def iter_jsonl(path: str | Path, display: str | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line of `path`, in file order.

    Raises DataFileError naming `display` (default: the path) and the line when a line is not
    UTF-8, not valid JSON or not a JSON object, when gzip data is corrupt, and when the file
    holds no rows at all ("empty file").
    """
    path = Path(path)
    where = display or str(path)
    lineno, rows = 0, 0
    try:
        with _open(path) as f:
            for lineno, raw in enumerate(f, 1):
                if lineno == 1 and raw.startswith(_BOM):
                    raw = raw[len(_BOM):]
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    # e.start is a 0-based byte offset within the line; columns are 1-based
                    raise DataFileError(f"{where} line {lineno}: not UTF-8 (byte "
                                        f"0x{raw[e.start]:02x} at column {e.start + 1})") from None
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text.rstrip("\r\n"))  # columns of this line, not the next
                except json.JSONDecodeError as e:
                    raise DataFileError(f"{where} line {lineno}: not valid JSON: {e.msg} "
                                        f"(column {e.colno})") from None
                if not isinstance(obj, dict):
                    raise DataFileError(f"{where} line {lineno}: not a JSON object but a "
                                        f"{type(obj).__name__}: {text.strip()[:80]!r}")
                rows += 1
                yield lineno, obj
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataFileError(f"{where}: corrupt gzip data after {lineno} lines ({e})") from None
    if rows == 0:
        raise DataFileError(f"{where}: empty file (no JSON lines)")


def describe(value: Any) -> str:
    """A short description of a JSON value for error messages: `null`, `int 5`, `''`."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value[:60])
    return f"{type(value).__name__} {json.dumps(value)[:60]}"
