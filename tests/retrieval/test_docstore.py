"""The corpus store refuses a bad corpus at open, naming the file and the first bad line."""

import gzip
import json

import pytest

from a2tgpo.data.jsonl import DataFileError
from a2tgpo.retrieval.docstore import DocStore

GOOD = [{"id": "0", "contents": '"Veaora"\nVeaora is a country.'},
        {"id": "1", "contents": '"Stuton"\nStuton is a city.'}]


def lines(rows) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def open_store(tmp_path, data: bytes, name: str = "c.jsonl") -> DocStore:
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return DocStore(path, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("bad, problem", [
    ({"id": "2", "contents": None}, "'contents' is not a string but null"),
    ({"id": "2"}, "no 'contents'"),
    ({"id": "2", "contents": 5}, "'contents' is not a string but int 5"),  # mixed JSON types
    ({"id": "2", "contents": ["a"]}, "'contents' is not a string but list [\"a\"]"),
    ({"id": "2", "contents": ""}, "'contents' is empty or whitespace only ('')"),
    ({"id": "2", "contents": " \n\t"}, "'contents' is empty or whitespace only (' \\n\\t')"),
    ({"contents": "text"}, "'id' is missing or not a string (null)"),
])
@pytest.mark.parametrize("name", ["c.jsonl", "c.jsonl.gz"])
def test_bad_row_is_refused_with_its_line(tmp_path, bad, problem, name):
    with pytest.raises(DataFileError) as e:
        open_store(tmp_path, lines(GOOD + [bad] + GOOD), name)
    assert str(e.value) == f"{tmp_path / name} line 3: {problem}"  # GOOD is two lines


@pytest.mark.parametrize("data, message", [
    # the object is not closed: after its 27 characters json expects a ',' (or '}')
    (lines(GOOD) + b'{"id": "2", "contents": "x"\n',
     " line 3: not valid JSON: Expecting ',' delimiter (column 28)"),
    # '{"id": "2", "contents": "' is 25 bytes, so the bad byte is at column 26
    (lines(GOOD) + b'{"id": "2", "contents": "\xff"}\n',
     " line 3: not UTF-8 (byte 0xff at column 26)"),
    (b"", ": empty file (no JSON lines)"),
])
def test_unreadable_corpus_names_file_and_line(tmp_path, data, message):
    with pytest.raises(DataFileError) as e:
        open_store(tmp_path, data)
    assert str(e.value) == f"{tmp_path / 'c.jsonl'}{message}"


def test_blank_lines_are_not_rows_but_count_as_lines(tmp_path):
    docs = open_store(tmp_path, lines(GOOD[:1]) + b"\n" + lines(GOOD[1:]))
    assert len(docs) == 2 and docs.get([1]) == [GOOD[1]]
    with pytest.raises(DataFileError, match=r"c\.jsonl line 4: 'contents' is empty"):
        open_store(tmp_path, lines(GOOD[:1]) + b"\n" + lines(GOOD[1:] + [{"id": "2",
                                                                           "contents": ""}]))
