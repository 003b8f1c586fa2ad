"""The corpus as a row-addressable store: faiss id i is corpus line i.

wiki-18 has 21M passages (~13 GB gzipped); like Search-R1's server we go through `datasets`,
which converts the JSONL once into Arrow files that are memory-mapped, so looking up the top-k
rows of a batch costs neither a full load into Python objects nor a re-parse per start.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


class DocStore:
    """Rows `{"id", "contents"}` of a wiki-18-format JSONL corpus (plain or gzipped)."""

    def __init__(self, corpus_path: str | Path, cache_dir: str | Path | None = None):
        import datasets

        self.path = Path(corpus_path)
        if not self.path.is_file():
            raise FileNotFoundError(f"corpus {self.path} not found")
        log.info("opening corpus %s", self.path)
        ds = datasets.Dataset.from_json(
            str(self.path), cache_dir=None if cache_dir is None else str(cache_dir)
        )
        missing = {"id", "contents"} - set(ds.column_names)
        if missing:
            raise ValueError(f"{self.path}: corpus rows need 'id' and 'contents'; "
                             f"missing {sorted(missing)} (columns: {ds.column_names})")
        self.ds = ds.select_columns(["id", "contents"])

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
