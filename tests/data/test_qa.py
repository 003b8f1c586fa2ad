"""QA data preparation: hub-shaped local files -> normalised rows -> parquet splits.

Fixtures mirror the hub files: FlashRAG_datasets is `<subset>/<split>.jsonl` with rows
`{"id", "question", "golden_answers", "metadata"}` (nq rows carry no metadata, as in
RUC-NLPIR/FlashRAG examples/dataset/nq/test.jsonl); Search-R1's nq_hotpotqa_train is
`<split>.parquet` holding the FlashRAG columns plus data_source, prompt, ability,
reward_model{style, ground_truth{target}} and extra_info{split, index}
(scripts/data_process/qa_search_train_merge.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from a2tgpo.config import ConfigError, from_dict, load_config
from a2tgpo.data import qa
from a2tgpo.data.jsonl import DataFileError
from a2tgpo.data.qa import DataConfig, DatasetSource, load_source, load_split, prepare_data


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def flashrag(repo: Path, subset: str, group: str = "multi_hop", **kw) -> DatasetSource:
    return DatasetSource(name=kw.pop("name", subset), loader="flashrag", repo=str(repo),
                         subset=subset, group=group, **kw)


NQ_TEST = [
    {"id": "test_0", "question": "who got the first nobel prize in physics",
     "golden_answers": ["Wilhelm Conrad Röntgen"]},
    {"id": "test_1", "question": "  which mode is used for short wave broadcast service \n",
     "golden_answers": [" Olivia", "MFSK "]},
]
HOTPOT_DEV = [
    {"id": "dev_0", "question": "Were Scott Derrickson and Ed Wood of the same nationality?",
     "golden_answers": ["yes"],
     "metadata": {"type": "comparison", "level": "hard",
                  "supporting_facts": {"title": ["Scott Derrickson", "Ed Wood"], "sent_id": [0, 0]},
                  "context": {"title": ["Ed Wood"], "sentences": [["Edward Davis Wood Jr."]]}}},
    {"id": "dev_1", "question": "What government position was held by the woman who portrayed "
                                "Corliss Archer in the film Kiss and Tell?",
     "golden_answers": ["Chief of Protocol"],
     "metadata": {"type": "bridge", "level": "hard",
                  "supporting_facts": {"title": ["Kiss and Tell (1945 film)"], "sent_id": [0]},
                  "context": {"title": ["Meet Corliss Archer"], "sentences": [["A sitcom."]]}}},
]


@pytest.fixture
def flashrag_repo(tmp_path: Path) -> Path:
    """nq has train + dev + test, hotpotqa train + dev (no test), as on the hub."""
    repo = tmp_path / "FlashRAG_datasets"
    write_jsonl(repo / "nq/test.jsonl", NQ_TEST)
    write_jsonl(repo / "nq/dev.jsonl", [{"id": "dev_0", "question": "q", "golden_answers": ["x"]}])
    write_jsonl(repo / "nq/train.jsonl", [
        {"id": f"train_{i}", "question": f"nq question {i}", "golden_answers": [f"a{i}"]}
        for i in range(12)])
    write_jsonl(repo / "hotpotqa/dev.jsonl", HOTPOT_DEV)
    write_jsonl(repo / "hotpotqa/train.jsonl", [
        {"id": f"train_{i}", "question": f"hotpot question {i}", "golden_answers": [f"h{i}"],
         "metadata": {"type": "bridge" if i % 2 else "comparison", "level": "easy"}}
        for i in range(8)])
    return repo


# --------------------------------------------------------------------------------------------
# normalisation


def test_flashrag_nq_test_rows_are_normalised(flashrag_repo):
    loaded = load_source(flashrag(flashrag_repo, "nq", group="single_hop"))
    assert loaded.file.split == "test"  # "auto": nq has test.jsonl
    assert loaded.dropped == 0
    # ids get the source name prefix; question and answers are stripped; nq is single-hop.
    assert loaded.rows == [
        {"id": "nq/test_0", "question": "who got the first nobel prize in physics",
         "golden_answers": ["Wilhelm Conrad Röntgen"], "source": "nq", "split": "test",
         "group": "single_hop", "hop_type": "single", "hops": 1},
        {"id": "nq/test_1", "question": "which mode is used for short wave broadcast service",
         "golden_answers": ["Olivia", "MFSK"], "source": "nq", "split": "test",
         "group": "single_hop", "hop_type": "single", "hops": 1},
    ]


def test_flashrag_hotpotqa_auto_picks_dev_and_reads_metadata_type(flashrag_repo):
    loaded = load_source(flashrag(flashrag_repo, "hotpotqa"))
    assert loaded.file.split == "dev"  # no hotpotqa/test.jsonl
    assert loaded.file.path == flashrag_repo / "hotpotqa/dev.jsonl"
    # metadata.type is the HotpotQA question type; every HotpotQA question has two gold hops.
    assert [(r["id"], r["hop_type"], r["hops"], r["split"]) for r in loaded.rows] == [
        ("hotpotqa/dev_0", "comparison", 2, "dev"),
        ("hotpotqa/dev_1", "bridge", 2, "dev"),
    ]


def test_explicit_split_and_missing_split(flashrag_repo):
    assert load_source(flashrag(flashrag_repo, "nq", split="dev")).file.split == "dev"
    with pytest.raises(FileNotFoundError, match=r"hotpotqa/test\.jsonl"):
        load_source(flashrag(flashrag_repo, "hotpotqa", split="test"))
    with pytest.raises(FileNotFoundError, match=r"triviaqa/test\.jsonl.*triviaqa/dev\.jsonl"):
        load_source(flashrag(flashrag_repo, "triviaqa"))
    with pytest.raises(FileNotFoundError, match="directory"):
        load_source(flashrag(flashrag_repo / "nowhere", "nq"))


def test_musique_and_2wiki_hop_types(tmp_path):
    write_jsonl(tmp_path / "musique/dev.jsonl", [
        {"id": "2hop__460946_294723", "question": "Who is the spouse of the Green performer?",
         "golden_answers": ["Miquette Giraudy"], "metadata": {"answerable": True}},
        {"id": "3hop1__9_8_7", "question": "q2", "golden_answers": ["x"]},
        # no shape prefix in the id: the decomposition has one entry per hop (here 4)
        {"id": "dev_2", "question": "q3", "golden_answers": ["b"],
         "metadata": {"question_decomposition": [{"id": k, "question": "s", "answer": "t"}
                                                 for k in range(4)]}},
    ])
    write_jsonl(tmp_path / "2wikimultihopqa/dev.jsonl", [
        {"id": "dev_0", "question": "q", "golden_answers": ["x"],
         "metadata": {"type": "compositional"}},
        {"id": "dev_1", "question": "q", "golden_answers": ["x"],
         "metadata": {"type": "bridge_comparison"}},
    ])
    musique = load_source(flashrag(tmp_path, "musique")).rows
    assert [(r["hop_type"], r["hops"]) for r in musique] == [("2hop", 2), ("3hop1", 3), ("4hop", 4)]
    wiki = load_source(flashrag(tmp_path, "2wikimultihopqa", name="2wiki")).rows
    assert [(r["id"], r["source"], r["hop_type"], r["hops"]) for r in wiki] == [
        ("2wiki/dev_0", "2wiki", "compositional", None),
        ("2wiki/dev_1", "2wiki", "bridge_comparison", None),
    ]


def test_toy_world_layout_uses_metadata_hop_type(tmp_path):
    # a2tgpo.data.world writes qa/<dataset>/<split>.jsonl with metadata.hop_type/hops; its
    # dataset names mirror the benchmarks, so metadata must win over the per-dataset rules
    # (here "musique" ids carry no hop prefix and "nq" would otherwise say single/1).
    qa_dir = tmp_path / "world/qa"
    write_jsonl(qa_dir / "musique/train.jsonl", [
        {"id": "train_0", "question": "Who directed the film made in Vorland?",
         "golden_answers": ["Ada Kest"],
         "metadata": {"hop_type": "bridge", "hops": 2, "support": ["p1", "p2"],
                      "lookups": ["Vorland", "Film"]}},
        {"id": "train_1", "question": "Which is older, Ana or Bo?", "golden_answers": ["Ana"],
         "metadata": {"hop_type": "comparison", "hops": 2, "support": ["p3", "p4"],
                      "lookups": ["Ana", "Bo"]}},
    ])
    write_jsonl(qa_dir / "nq/train.jsonl", [
        {"id": "train_0", "question": "Where was Ada Kest born?", "golden_answers": ["Vorland"],
         "metadata": {"hop_type": "composition", "hops": 3, "support": [], "lookups": []}}])
    rows = load_source(flashrag(qa_dir, "musique", split="train", group="mixed")).rows
    assert [(r["id"], r["hop_type"], r["hops"], r["group"]) for r in rows] == [
        ("musique/train_0", "bridge", 2, "mixed"), ("musique/train_1", "comparison", 2, "mixed")]
    (row,) = load_source(flashrag(qa_dir, "nq", split="train")).rows
    assert (row["hop_type"], row["hops"]) == ("composition", 3)


def searchr1_row(source: str, index: int, question: str, answers: list[str]) -> dict:
    """One row as qa_search_train_merge.py writes it (question stripped and "?"-terminated)."""
    return {
        "id": f"train_{index}", "question": question, "golden_answers": answers,
        "data_source": source,
        "prompt": [{"role": "user",
                    "content": f"Answer the given question. ... Question: {question}\n"}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
        "extra_info": {"split": "train", "index": index},
    }


@pytest.fixture
def searchr1_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "nq_hotpotqa_train"
    repo.mkdir()
    rows = [searchr1_row("nq", 0, "total number of death row inmates in the us?", ["2,718"]),
            searchr1_row("nq", 1, "big little lies season 2 how many episodes?", ["seven"]),
            # raw ids restart per data source, so "train_0" appears twice
            searchr1_row("hotpotqa", 0, "Which magazine was started first?", ["Arthur's Magazine"])]
    pq.write_table(pa.Table.from_pylist(rows), repo / "train.parquet")
    return repo


def test_searchr1_parquet_rows(searchr1_repo):
    src = DatasetSource(name="nqhp", loader="searchr1", repo=str(searchr1_repo),
                        split="train", group="mixed")
    rows = load_source(src).rows
    # ids carry the data source (raw ids repeat across sources); source = data_source;
    # answers come from reward_model.ground_truth.target; hotpotqa has no type column here.
    assert rows == [
        {"id": "nqhp/nq/train_0", "question": "total number of death row inmates in the us?",
         "golden_answers": ["2,718"], "source": "nq", "split": "train", "group": "mixed",
         "hop_type": "single", "hops": 1},
        {"id": "nqhp/nq/train_1", "question": "big little lies season 2 how many episodes?",
         "golden_answers": ["seven"], "source": "nq", "split": "train", "group": "mixed",
         "hop_type": "single", "hops": 1},
        {"id": "nqhp/hotpotqa/train_0", "question": "Which magazine was started first?",
         "golden_answers": ["Arthur's Magazine"], "source": "hotpotqa", "split": "train",
         "group": "mixed", "hop_type": None, "hops": 2},
    ]
    with pytest.raises(FileNotFoundError, match=r"test\.parquet.*dev\.parquet"):
        load_source(DatasetSource(name="x", loader="searchr1", repo=str(searchr1_repo),
                                  group="mixed"))


def test_searchr1_file_without_reward_model_is_rejected(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"id": "train_0", "question": "q", "data_source": "nq",
                                          "golden_answers": ["x"]}]), tmp_path / "train.parquet")
    src = DatasetSource(name="x", loader="searchr1", repo=str(tmp_path), split="train",
                        group="mixed")
    with pytest.raises(ValueError, match="reward_model.ground_truth.target"):
        load_source(src)


def test_limit_takes_first_rows(flashrag_repo):
    rows = load_source(flashrag(flashrag_repo, "nq", split="train", limit=3)).rows
    assert [r["id"] for r in rows] == ["nq/train_0", "nq/train_1", "nq/train_2"]


# --------------------------------------------------------------------------------------------
# invalid rows


@pytest.mark.parametrize("bad, problem", [
    ({"id": "test_1", "golden_answers": ["x"]}, "question"),  # question missing
    ({"id": "test_1", "question": "   ", "golden_answers": ["x"]}, "question"),
    ({"id": "test_1", "question": "q", "golden_answers": []}, "golden_answers"),
    ({"id": "test_1", "question": "q", "golden_answers": "a"}, "golden_answers"),  # not a list
    ({"id": "test_1", "question": "q", "golden_answers": ["x", " "]}, "golden_answers"),
    ({"id": "test_1", "question": "q"}, "golden_answers"),  # golden_answers missing
])
def test_invalid_row_error_names_file_row_and_id(tmp_path, bad, problem):
    path = write_jsonl(tmp_path / "nq/test.jsonl",
                       [{"id": "test_0", "question": "q", "golden_answers": ["x"]}, bad])
    with pytest.raises(ValueError) as e:
        load_source(flashrag(tmp_path, "nq"))
    assert f"{path} line 2 (id 'test_1'): " in str(e.value)  # the second line of the file
    assert problem in str(e.value)


@pytest.mark.parametrize("answers, refused", [
    (["the"], "'the'"), (["A."], "'A.'"), (["Paris", "an"], "'an'"),  # "", "" and "" normalised
])
def test_golden_answer_that_normalises_to_nothing_is_refused(tmp_path, answers, refused):
    # no prediction can match such an answer (rewards.py scores it 0 everywhere); the sources'
    # EM would count any empty-normalising prediction as correct while F1 says 0
    path = write_jsonl(tmp_path / "nq/test.jsonl", [
        {"id": "test_0", "question": "q", "golden_answers": ["x"]},
        {"id": "test_1", "question": "Which vitamin?", "golden_answers": answers}])
    with pytest.raises(DataFileError, match=rf"{path} line 2 \(id 'test_1'\): golden answer "
                                            rf"{refused} normalises to the empty string"):
        load_source(flashrag(tmp_path, "nq"))
    kept = load_source(flashrag(tmp_path, "nq"), "drop")
    assert [r["id"] for r in kept.rows] == ["nq/test_0"] and kept.dropped == 1


def test_question_over_max_question_chars_is_refused_at_prepare_time(tmp_path):
    # 100,000 characters would take an evaluation job down (80k prompt tokens against 2,048)
    write_jsonl(tmp_path / "nq/test.jsonl", [
        {"id": "test_0", "question": "q" * 2000, "golden_answers": ["x"]},   # the bound: kept
        {"id": "test_1", "question": "Why " * 25_000, "golden_answers": ["x"]}])
    write_jsonl(tmp_path / "nq/train.jsonl",
                [{"id": "t", "question": "q", "golden_answers": ["x"]}])
    train = (flashrag(tmp_path, "nq", split="train", group="single_hop"),)
    src = flashrag(tmp_path, "nq", group="single_hop")
    cfg = DataConfig(train=train, test=(src,))
    assert cfg.max_question_chars == 2000
    out = tmp_path / "out"
    # the question is stripped first: "Why " * 25000 -> 99,999 characters
    with pytest.raises(DataFileError, match=r"nq/test.jsonl line 2 \(id 'test_1'\): question "
                                            r"of 99999 characters, over "
                                            r"data.max_question_chars \(2000\)"):
        prepare_data(cfg, out)
    assert not out.exists()
    summary = prepare_data(DataConfig(train=train, test=(src,), on_invalid_row="drop"), out)
    assert summary["dropped"] == {"train/nq": 0, "test/nq": 1}
    assert [len(r["question"]) for r in load_split(out / "test/nq.parquet")] == [2000]
    # a lower bound from the config refuses the first one too
    with pytest.raises(DataFileError, match=r"line 1 .* over data.max_question_chars \(1999\)"):
        prepare_data(DataConfig(train=train, test=(src,), max_question_chars=1999), out)


def test_duplicate_ids_in_a_file_are_an_error(tmp_path):
    row = {"id": "test_0", "question": "q", "golden_answers": ["x"]}
    write_jsonl(tmp_path / "nq/test.jsonl", [row, row])
    with pytest.raises(ValueError, match=r"duplicate ids \['nq/test_0'\]"):
        load_source(flashrag(tmp_path, "nq"))


def test_drop_mode_counts_and_reports(tmp_path, caplog):
    write_jsonl(tmp_path / "nq/train.jsonl", [
        {"id": "train_0", "question": "q0", "golden_answers": ["x"]},
        {"id": "train_1", "question": "", "golden_answers": ["x"]},   # dropped
        {"id": "train_2", "question": "q2", "golden_answers": []},    # dropped
        {"id": "train_3", "question": "q3", "golden_answers": ["c"]},
    ])
    write_jsonl(tmp_path / "nq/test.jsonl", [
        {"id": "test_0", "question": "q", "golden_answers": None},    # dropped
        {"id": "test_1", "question": "q", "golden_answers": ["b"]},
    ])
    cfg = DataConfig(train=(flashrag(tmp_path, "nq", split="train", group="single_hop"),),
                     test=(flashrag(tmp_path, "nq", group="single_hop"),), on_invalid_row="drop")
    with caplog.at_level(logging.WARNING, logger="a2tgpo.data.qa"):
        summary = prepare_data(cfg, tmp_path / "out")
    # 4 train rows - 2 dropped = 2 kept (dev_size 0); 2 test rows - 1 = 1.
    assert summary["dropped"] == {"train/nq": 2, "test/nq": 1}
    assert summary["files"]["train.parquet"]["rows"] == 2
    assert summary["files"]["dev.parquet"]["rows"] == 0
    assert summary["files"]["test/nq.parquet"] == {"rows": 1, "by_source": {"nq": {"single": 1}}}
    assert json.loads((tmp_path / "out/summary.json").read_text()) == summary
    kept = [r["id"] for r in load_split(tmp_path / "out/train.parquet")]
    assert kept == ["nq/train_0", "nq/train_3"]
    assert "dropped 2 invalid rows" in caplog.text and "line 2 (id 'train_1')" in caplog.text


@pytest.mark.parametrize("on_invalid_row", ["error", "drop"])
def test_numeric_and_boolean_answers_are_read_as_text(tmp_path, on_invalid_row):
    # The number comes first: an Arrow reader infers the column's type from it, then either
    # rejects the valid string rows or the numeric one; read as JSON values, every row is kept.
    write_jsonl(tmp_path / "nq/test.jsonl", [
        {"id": "test_0", "question": "When did the Titanic sink?", "golden_answers": [1912]},
        {"id": "test_1", "question": "q1", "golden_answers": ["x"]},
        {"id": "test_2", "question": "q2", "golden_answers": ["three", 3.0, True, 0]},
    ])
    cfg = DataConfig(train=(), test=(flashrag(tmp_path, "nq", group="single_hop"),),
                     on_invalid_row=on_invalid_row)
    (loaded,) = [load_source(s, cfg.on_invalid_row) for s in cfg.test]
    assert loaded.dropped == 0
    # JSON text of each value: 3.0 stays "3.0" (not "3"), true is "true" (not Python's "True")
    assert [r["golden_answers"] for r in loaded.rows] == [
        ["1912"], ["x"], ["three", "3.0", "true", "0"]]


@pytest.mark.parametrize("answers", [[None], ["a", None], [["a"]], [{"a": 1}], [float("nan")]])
def test_null_or_nested_answer_is_an_invalid_row(tmp_path, answers):
    path = write_jsonl(tmp_path / "nq/test.jsonl", [
        {"id": "test_0", "question": "q", "golden_answers": ["x"]},
        {"id": "test_1", "question": "q", "golden_answers": answers},  # json writes nan as NaN
    ])
    with pytest.raises(ValueError, match=f"{path} line 2 \\(id 'test_1'\\): golden_answers"):
        load_source(flashrag(tmp_path, "nq"))
    loaded = load_source(flashrag(tmp_path, "nq"), "drop")
    assert loaded.dropped == 1 and [r["id"] for r in loaded.rows] == ["nq/test_0"]


def write_lines(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


GOOD = b'{"id": "test_0", "question": "q", "golden_answers": ["x"]}\n'


@pytest.mark.parametrize("data, message", [
    # line 3 lacks the comma after "q": '{"id": "test_1", ' is 17 characters, '"question":
    # "q" ' 16 more, so json expects the delimiter at column 34
    (GOOD + b"\n" + b'{"id": "test_1", "question": "q" "golden_answers": ["x"]}\n',
     "line 3: not valid JSON: Expecting ',' delimiter (column 34)"),
    (GOOD + b'{"id": "test_1", "question": "q", "golden_ans\n', "line 2: not valid JSON"),
    # 0xff is the 19th byte of line 2: '{"id": "x", "q": "' is 18 bytes
    (GOOD + b'{"id": "x", "q": "\xff"}\n', "line 2: not UTF-8 (byte 0xff at column 19)"),
    (GOOD + b"[1, 2]\n", "line 2: not a JSON object but a list"),
    (b"", ": empty file"),
    (b"\n  \n", ": empty file"),
])
@pytest.mark.parametrize("on_invalid_row", ["error", "drop"])
def test_unreadable_jsonl_names_file_and_line(tmp_path, data, message, on_invalid_row):
    path = write_lines(tmp_path / "nq/test.jsonl", data)
    with pytest.raises(DataFileError) as e:  # malformed lines stop even with "drop"
        load_source(flashrag(tmp_path, "nq"), on_invalid_row)
    assert str(e.value).startswith(f"{path}")
    assert message in str(e.value)


def test_blank_lines_and_a_bom_are_skipped_and_lines_still_counted(tmp_path):
    path = write_lines(tmp_path / "nq/test.jsonl", b"\xef\xbb\xbf" + GOOD + b"\n\n"
                       + b'{"id": "test_1", "question": "", "golden_answers": ["x"]}\n')
    loaded = load_source(flashrag(tmp_path, "nq"), "drop")
    assert [r["id"] for r in loaded.rows] == ["nq/test_0"] and loaded.dropped == 1
    # lines 2 and 3 are blank: the bad row is line 4, though it is the second row
    with pytest.raises(DataFileError, match=f"{path} line 4 \\(id 'test_1'\\): missing"):
        load_source(flashrag(tmp_path, "nq"))


def test_unreadable_parquet_names_the_file(tmp_path):
    path = write_lines(tmp_path / "train.parquet", b"PAR1 not really parquet")
    src = DatasetSource(name="x", loader="searchr1", repo=str(tmp_path), split="train",
                        group="mixed")
    with pytest.raises(DataFileError, match=f"{path}: not a readable parquet file"):
        load_source(src)


def test_searchr1_numeric_targets_are_text(tmp_path):
    # a parquet column of integer answers (list<int64>): every row, not only some, is numeric
    row = searchr1_row("nq", 0, "In which year did the Titanic sink?", ["1912"])
    row["reward_model"]["ground_truth"]["target"] = [1912]
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "train.parquet")
    src = DatasetSource(name="x", loader="searchr1", repo=str(tmp_path), split="train",
                        group="mixed")
    assert load_source(src).rows[0]["golden_answers"] == ["1912"]


# --------------------------------------------------------------------------------------------
# prepare_data: dev holdout, layout, determinism


def data_config(repo: Path, dev_size: int = 5, seed: int = 0) -> DataConfig:
    return DataConfig(
        train=(flashrag(repo, "nq", split="train", group="single_hop"),
               flashrag(repo, "hotpotqa", split="train")),
        test=(flashrag(repo, "nq", group="single_hop"), flashrag(repo, "hotpotqa")),
        dev_size=dev_size, seed=seed)


def test_prepare_data_layout_and_dev_holdout(flashrag_repo, tmp_path):
    out = tmp_path / "out"
    summary = prepare_data(data_config(flashrag_repo, dev_size=5), out)
    train, dev = load_split(out / "train.parquet"), load_split(out / "dev.parquet")
    all_ids = [f"nq/train_{i}" for i in range(12)] + [f"hotpotqa/train_{i}" for i in range(8)]
    # 12 nq + 8 hotpotqa = 20 training rows: 5 held out, 15 left, disjoint, nothing lost,
    # and both keep the sources' order.
    assert len(dev) == 5 and len(train) == 15
    assert {r["id"] for r in train}.isdisjoint(r["id"] for r in dev)
    assert sorted(r["id"] for r in train + dev) == sorted(all_ids)
    assert [r["id"] for r in train] == [i for i in all_ids if i in {r["id"] for r in train}]
    # the 5 ids with the smallest sha256("0:<id>"), ranked once by hand with hashlib; pinned so
    # a change of the holdout rule (which would reshuffle dev across versions) fails here
    assert [r["id"] for r in dev] == [
        "nq/train_6", "nq/train_8", "hotpotqa/train_3", "hotpotqa/train_4", "hotpotqa/train_5"]
    nq_test = load_source(flashrag(flashrag_repo, "nq", group="single_hop")).rows
    assert load_split(out / "test/nq.parquet") == nq_test
    assert [r["split"] for r in load_split(out / "test/hotpotqa.parquet")] == ["dev", "dev"]
    assert sorted(p.name for p in out.iterdir()) == [
        "dev.parquet", "summary.json", "test", "train.parquet"]
    assert summary["files"]["test/hotpotqa.parquet"] == {
        "rows": 2, "by_source": {"hotpotqa": {"bridge": 1, "comparison": 1}}}
    assert [(i["name"], i["split"], i["rows"]) for i in summary["inputs"]] == [
        ("nq", "train", 12), ("hotpotqa", "train", 8), ("nq", "test", 2), ("hotpotqa", "dev", 2)]


def test_dev_holdout_depends_on_seed_and_ids_only():
    ids = [f"nq/train_{i}" for i in range(50)]
    dev = qa.dev_holdout(ids, 10, seed=3)
    assert len(dev) == 10 and dev <= set(ids)
    assert qa.dev_holdout(list(reversed(ids)), 10, seed=3) == dev  # row order does not matter
    assert qa.dev_holdout(ids, 10, seed=4) != dev  # hashes differ per seed
    # a smaller holdout is a subset of a larger one with the same seed (same ranking)
    assert qa.dev_holdout(ids, 4, seed=3) <= dev
    with pytest.raises(ValueError, match="exceeds the 50 training rows"):
        qa.dev_holdout(ids, 51, seed=3)


def test_same_inputs_give_identical_bytes(flashrag_repo, tmp_path):
    prepare_data(data_config(flashrag_repo, seed=7), tmp_path / "a")
    prepare_data(data_config(flashrag_repo, seed=7), tmp_path / "b")
    prepare_data(data_config(flashrag_repo, seed=8), tmp_path / "c")
    names = ["train.parquet", "dev.parquet", "test/nq.parquet", "test/hotpotqa.parquet"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a/dev.parquet").read_bytes() != (tmp_path / "c/dev.parquet").read_bytes()


def test_rerun_replaces_test_folder(flashrag_repo, tmp_path):
    out = tmp_path / "out"
    prepare_data(data_config(flashrag_repo), out)
    cfg = DataConfig(train=(flashrag(flashrag_repo, "nq", split="train"),),
                     test=(flashrag(flashrag_repo, "nq"),))
    prepare_data(cfg, out)
    assert sorted(p.name for p in (out / "test").iterdir()) == ["nq.parquet"]


def test_empty_split_keeps_schema(flashrag_repo, tmp_path):
    prepare_data(data_config(flashrag_repo, dev_size=0), tmp_path)
    assert load_split(tmp_path / "dev.parquet") == []
    assert pq.read_schema(tmp_path / "dev.parquet").remove_metadata().equals(qa.row_schema())
    pq.write_table(pa.table({"id": ["x"]}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match="not a prepared QA file"):
        load_split(tmp_path / "other.parquet")


@pytest.mark.parametrize("dev_size", [20, 21])
def test_dev_size_that_leaves_no_training_row_is_refused_before_writing(flashrag_repo, tmp_path,
                                                                       dev_size):
    # training rows: nq/train.jsonl 12 + hotpotqa/train.jsonl 8 = 20; holding out all 20 would
    # write an empty train.parquet
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as e:
        prepare_data(data_config(flashrag_repo, dev_size=dev_size), out, source="study.yaml",
                     key="data.dev_size")
    assert str(e.value) == (
        f"study.yaml: data.dev_size: {dev_size} dev rows held out of 20 training rows leave "
        f"none to train on ({flashrag_repo}/nq/train.jsonl, {flashrag_repo}/hotpotqa/train.jsonl"
        "); set it below 20")
    assert not out.exists()  # nothing written
    assert prepare_data(data_config(flashrag_repo, dev_size=19), out)["files"][
        "train.parquet"]["rows"] == 1


def test_known_rows_counts_local_files_only(flashrag_repo, searchr1_repo, tmp_path):
    from a2tgpo.data.qa import known_rows

    assert known_rows(flashrag(flashrag_repo, "nq", split="train")) == 12
    assert known_rows(flashrag(flashrag_repo, "nq", split="train", limit=5)) == 5
    # blank lines are no rows: 2 rows, 3 lines around them blank
    blank = write_jsonl(tmp_path / "b/x/train.jsonl", [])
    blank.write_text("\n" + json.dumps(NQ_TEST[0]) + "\n  \n" + json.dumps(NQ_TEST[1]) + "\n\n")
    assert known_rows(flashrag(tmp_path / "b", "x", split="train")) == 2
    searchr1 = DatasetSource(name="s", loader="searchr1", repo=str(searchr1_repo), split="train",
                             group="mixed")
    assert known_rows(searchr1) == 3  # the fixture's three rows, from the parquet footer
    # not known before reading: a hub id, a missing file
    assert known_rows(flashrag("RUC-NLPIR/FlashRAG_datasets", "nq", split="train")) is None
    assert known_rows(flashrag(flashrag_repo, "nq", split="nosuch")) is None


def test_same_name_in_two_train_sources_collides(flashrag_repo, tmp_path):
    cfg = DataConfig(train=(flashrag(flashrag_repo, "nq", split="train"),
                            flashrag(flashrag_repo, "nq", split="dev", name="nq2")))
    prepare_data(cfg, tmp_path / "ok")  # distinct names -> distinct id prefixes
    with pytest.raises(ConfigError, match=r"data: train: duplicate source names \['nq'\]"):
        entry = {"name": "nq", "loader": "flashrag", "repo": "r", "subset": "nq",
                 "group": "single_hop"}
        from_dict(DataConfig, {"train": [entry, entry]}, path="data")


# --------------------------------------------------------------------------------------------
# config


def write_config(tmp_path: Path, train: list[dict]) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps({"data": {"train": train, "dev_size": 2}}))  # JSON is YAML
    return path


def test_config_unknown_key_names_dotted_path(tmp_path):
    path = write_config(tmp_path, [{"name": "nq", "lodaer": "flashrag", "repo": "r",
                                    "subset": "nq", "group": "single_hop"}])
    expected = r"data\.train\[0\]\.lodaer: unknown key \(did you mean 'loader'\?\)"
    with pytest.raises(ConfigError, match=expected):
        load_config(DataConfig, path, section="data")


NQ = {"loader": "flashrag", "subset": "nq", "group": "single_hop"}


@pytest.mark.parametrize("entry, message", [
    ({"loader": "flashrag", "group": "single_hop"},
     r"data\.train\[0\]: subset '': the flashrag loader"),
    ({"loader": "searchr1", "subset": "nq", "group": "mixed"}, r"data\.train\[0\]: subset is only"),
    ({**NQ, "group": "singlehop"}, r"data\.train\[0\]\.group: expected one of"),
    ({**NQ, "limit": 0}, r"data\.train\[0\]\.limit: 0 is out of range: must be >= 1"),
    ({**NQ, "split": "../x"}, r"data\.train\[0\]: split '\.\./x'"),
])
def test_config_value_errors(tmp_path, entry, message):
    path = write_config(tmp_path, [{"name": "nq", "repo": "r", **entry}])
    with pytest.raises(ConfigError, match=message):
        load_config(DataConfig, path, section="data")


def test_main_reads_config_with_overrides(flashrag_repo, tmp_path):
    path = write_config(tmp_path, [{"name": "nq", "loader": "flashrag", "repo": str(flashrag_repo),
                                    "subset": "nq", "split": "train", "group": "single_hop"}])
    assert qa.main(str(path), ["dev_size=3", "seed=1"], str(tmp_path / "out")) == 0
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    assert (summary["dev_size"], summary["seed"]) == (3, 1)
    assert summary["files"]["train.parquet"]["rows"] == 12 - 3


# --------------------------------------------------------------------------------------------
# hub resolution (huggingface_hub calls replaced: no network in tests)


def test_hub_auto_split_lists_repo_then_downloads(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub import constants

    local = write_jsonl(tmp_path / "cache/hotpotqa/dev.jsonl", HOTPOT_DEV)
    calls = []

    class FakeApi:
        def list_repo_files(self, repo_id, *, repo_type=None, revision=None):
            calls.append(("list", repo_id, repo_type, revision))
            return ["README.md", "hotpotqa/train.jsonl", "hotpotqa/dev.jsonl", "nq/test.jsonl"]

    def fake_download(repo_id, filename, *, repo_type=None, revision=None):
        calls.append(("download", repo_id, filename, repo_type, revision))
        return str(local)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    src = DatasetSource(name="hotpotqa", loader="flashrag", repo="RUC-NLPIR/FlashRAG_datasets",
                        subset="hotpotqa", group="multi_hop", revision="abc123")
    loaded = load_source(src)
    assert calls == [
        ("list", "RUC-NLPIR/FlashRAG_datasets", "dataset", "abc123"),
        ("download", "RUC-NLPIR/FlashRAG_datasets", "hotpotqa/dev.jsonl", "dataset", "abc123"),
    ]
    assert loaded.file.display == (
        "hf://datasets/RUC-NLPIR/FlashRAG_datasets@abc123/hotpotqa/dev.jsonl")
    assert [r["id"] for r in loaded.rows] == ["hotpotqa/dev_0", "hotpotqa/dev_1"]


def test_hub_auto_split_offline_refuses_to_guess(monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    seen = []

    def fake_cache(repo_id, filename, *, revision=None, repo_type=None):
        seen.append(filename)  # and returns None: the cache knows nothing about this file

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", fake_cache)
    src = DatasetSource(name="hotpotqa", loader="flashrag", repo="RUC-NLPIR/FlashRAG_datasets",
                        subset="hotpotqa", group="multi_hop")
    with pytest.raises(FileNotFoundError, match=r"HF_HUB_OFFLINE.*hotpotqa/test\.jsonl"):
        load_source(src)
    assert seen == ["hotpotqa/test.jsonl"]  # did not go on to dev
