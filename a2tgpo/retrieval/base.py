"""The retriever interface every search tool call goes through.

A retriever maps a batch of query strings to, per query, the top-k passages with scores. The
in-process retrievers (dense faiss, BM25) and the HTTP client (Search-R1's `/retrieve` API)
implement the same `search`, so the agent loop never knows which one it talks to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Hit:
    """One retrieved passage: the corpus row `{"id", "contents"}` plus its score."""

    id: str
    contents: str
    score: float

    @property
    def title(self) -> str:
        """wiki-18 contents are '"Title"\\ntext'; the title without its quotes."""
        return self.contents.split("\n", 1)[0].strip().strip('"')

    @property
    def text(self) -> str:
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) > 1 else ""


class Retriever(Protocol):
    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """Top-`topk` hits per query, best first; one list per query, in query order."""
        ...

    def close(self) -> None:
        """Release resources (threads, sessions, GPU memory)."""
        ...
