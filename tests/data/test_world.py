"""The toy world: deterministic, disjoint splits, answerable by following the passages."""

import hashlib
import json
from collections import Counter

import pytest

from a2tgpo.data.world import HOP_TYPES, QASetSpec, WorldConfig, generate_world, write_world

SMALL = dict(countries=4, cities=8, people=30, films=12, bands=6, companies=8, distractors=10)


def small_cfg(**kw):
    sets = (
        QASetSpec("s", "single_hop", {"train": 20, "test": 10}, {"single": 1.0}),
        QASetSpec("m", "multi_hop", {"dev": 20},
                  {"bridge": 0.5, "composition": 0.25, "comparison": 0.25}),
    )
    return WorldConfig(**{**SMALL, "qa_sets": sets, **kw})


def digest(d):
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    write_world(small_cfg(seed=1), tmp_path / "a")
    write_world(small_cfg(seed=1), tmp_path / "b")
    write_world(small_cfg(seed=2), tmp_path / "c")
    a, b, c = digest(tmp_path / "a"), digest(tmp_path / "b"), digest(tmp_path / "c")
    assert a == b
    assert set(a) == {"corpus.jsonl", "entities.jsonl", "summary.json", "qa/s/train.jsonl",
                      "qa/s/test.jsonl", "qa/m/dev.jsonl"}
    assert a["corpus.jsonl"] != c["corpus.jsonl"]


def test_corpus_is_wiki18_format_and_counts(tmp_path):
    s = write_world(small_cfg(), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "corpus.jsonl").open()]
    # one passage per entity (4+8+30+12+6+8 = 68) plus 10 distractors
    assert len(rows) == s["passages"] == 78 and s["distractor_passages"] == 10
    assert [r["id"] for r in rows] == [str(i) for i in range(78)]
    for r in rows:
        assert set(r) == {"id", "contents"}
        title, text = r["contents"].split("\n", 1)
        assert title.startswith('"') and title.endswith('"') and text


def test_splits_sizes_mix_and_disjointness(tmp_path):
    s = write_world(small_cfg(), tmp_path)
    q = s["questions"]
    # m/dev: 20 questions, mix 0.5/0.25/0.25 -> 10 bridge, 5 composition, 5 comparison
    assert q["m"]["dev"] == {"single": 0, "bridge": 10, "composition": 5, "comparison": 5}
    assert q["s"]["train"]["single"] == 20 and q["s"]["test"]["single"] == 10
    seen = Counter()
    for path in (tmp_path / "qa").glob("*/*.jsonl"):
        for line in path.open():
            row = json.loads(line)
            assert set(row) == {"id", "question", "golden_answers", "metadata"}
            assert row["golden_answers"] and all(row["golden_answers"])
            seen[row["question"]] += 1
    assert sum(seen.values()) == 50 and max(seen.values()) == 1  # no question in two splits


def test_every_question_is_answerable_by_following_passages():
    """Independent of the generator's bookkeeping: read the passages as text.

    A question names its first lookup; each support passage is titled by its lookup and names
    the next lookup; the last passage (or, for comparisons, the passages' years) gives the
    answer.
    """
    world, qa = generate_world(small_cfg())
    text = {p["id"]: p["contents"] for p in world.passages}
    for splits in qa.values():
        for rows in splits.values():
            for row in rows:
                m = row["metadata"]
                assert m["hops"] == len(m["support"]) == len(m["lookups"])
                assert m["lookups"][0] in row["question"]
                for sid, name in zip(m["support"], m["lookups"], strict=True):
                    assert text[sid].startswith(f'"{name}"\n')
                # the last support passage has no next lookup
                for sid, nxt in zip(m["support"], m["lookups"][1:], strict=False):
                    if m["hop_type"] != "comparison":
                        assert nxt in text[sid]
                if m["hop_type"] == "comparison":
                    years = [int(text[s].split("in the year ")[1][:4]) for s in m["support"]]
                    assert years[0] != years[1]
                    earlier = m["lookups"][years.index(min(years))]
                    assert row["golden_answers"][0] == earlier
                else:
                    assert row["golden_answers"][0] in text[m["support"][-1]].split("\n", 1)[1]


def test_hop_types_cover_all_four_in_default_world():
    _, qa = generate_world(WorldConfig())
    kinds = {r["metadata"]["hop_type"] for s in qa.values() for rows in s.values() for r in rows}
    assert kinds == set(HOP_TYPES)
    # names are a few tokens: people are two words, films/bands three
    names = [r["metadata"]["lookups"][0] for s in qa.values() for rows in s.values() for r in rows]
    assert max(len(n.split()) for n in names) <= 3


def test_too_many_questions_is_a_clear_error():
    sets = (QASetSpec("s", "single_hop", {"train": 10_000}, {"single": 1.0}),)
    with pytest.raises(ValueError, match="not enough distinct single questions for s/train"):
        generate_world(small_cfg(qa_sets=sets))


def test_bad_mix_rejected():
    with pytest.raises(ValueError, match="mix fractions sum"):
        QASetSpec("x", "multi_hop", {"dev": 1}, {"bridge": 0.5})
    with pytest.raises(ValueError, match="unknown hop types"):
        QASetSpec("x", "multi_hop", {"dev": 1}, {"bridgee": 1.0})
