"""Retrieval quality on the toy world: recall@k of the passage holding each question's first hop.

The query is the question text itself: the toy world is built so that the words of a question
find the passage of its first lookup, which is what a policy's first search copies. Every
question of the world's QA files carries `metadata.support` (passage id per hop).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from a2tgpo.retrieval.base import Retriever


def load_world_questions(world_dir: str | Path) -> list[dict]:
    """Every question of qa/<dataset>/<split>.jsonl with its dataset and split."""
    rows = []
    for path in sorted(Path(world_dir, "qa").glob("*/*.jsonl")):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                rows.append({**row, "dataset": path.parent.name, "split": path.stem})
    if not rows:
        raise FileNotFoundError(f"{world_dir}: no qa/<dataset>/<split>.jsonl files")
    return rows


def first_hop_recall(retriever: Retriever, questions: list[dict], ks: tuple[int, ...],
                     batch_size: int = 256) -> dict:
    """recall@k overall, per hop type and per dataset/split.

    Returns {"n", "recall": {k: r}, "by_hop_type": {t: {"n", "recall"}}, "by_set": {...}}.
    """
    kmax = max(ks)
    found_at: list[int | None] = []  # rank (0-based) of the first-hop passage, None if absent
    for s in range(0, len(questions), batch_size):
        batch = questions[s: s + batch_size]
        hits = retriever.search([q["question"] for q in batch], kmax)
        for q, hs in zip(batch, hits, strict=True):
            ids = [h.id for h in hs]
            target = q["metadata"]["support"][0]
            found_at.append(ids.index(target) if target in ids else None)

    def summarise(idx: list[int]) -> dict:
        n = len(idx)
        return {"n": n, "recall": {
            str(k): sum(1 for i in idx if found_at[i] is not None and found_at[i] < k) / n
            for k in ks}}

    groups: dict[str, dict[str, list[int]]] = {"by_hop_type": defaultdict(list),
                                               "by_set": defaultdict(list)}
    for i, q in enumerate(questions):
        groups["by_hop_type"][q["metadata"]["hop_type"]].append(i)
        groups["by_set"][f"{q['dataset']}/{q['split']}"].append(i)
    return {
        **summarise(list(range(len(questions)))),
        **{g: {name: summarise(idx) for name, idx in sorted(d.items())}
           for g, d in groups.items()},
    }
