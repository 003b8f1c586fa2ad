"""QA data preparation (`a2tgpo prepare-data`): hub or local QA files -> one normalised schema.

Two source layouts are read, both exactly as they lie on the Hugging Face hub (or in a local
directory with the same relative paths):

* `flashrag` (`RUC-NLPIR/FlashRAG_datasets`): one folder per dataset, one JSONL file per split,
  `<subset>/<split>.jsonl`, rows `{"id", "question", "golden_answers": [str], "metadata": {...}}`
  (`metadata` is absent for e.g. nq). Our toy world (`a2tgpo.data.world`) writes the same layout
  with `metadata.hop_type` / `metadata.hops`.
* `searchr1` (`PeterJinGo/nq_hotpotqa_train`): `<split>.parquet` at the repo root, the output of
  Search-R1's `scripts/data_process/qa_search_{train,test}_merge.py`: the FlashRAG columns (with
  the question already stripped and "?"-terminated) plus `data_source`, `prompt`, `ability`,
  `reward_model{style, ground_truth{target}}` and `extra_info{split, index}`. The answers are
  read from `reward_model.ground_truth.target`, the list Search-R1's reward scores.

Every row becomes (`row_schema()`): `id` (`<name>/<raw id>`, or `<name>/<data_source>/<raw id>` for
searchr1, whose raw ids repeat across data sources), `question` (stripped), `golden_answers`
(non-empty list of stripped, non-empty strings), `source` (dataset: the source name, or the
row's `data_source` for searchr1), `split` (the file's split), `group`, `hop_type`, `hops`.

Bounds, so that every prepared row can be scored and rolled out: a golden answer that
normalises to the empty string (e.g. "the": the EM normalisation drops case, punctuation and
the words a/an/the) is invalid, since no prediction could match it (a2tgpo/algo/rewards.py); a
question longer than `max_question_chars` characters is invalid, a bound that needs no
tokenizer (the exact check of the prompt's tokens against the prompt budget runs where the
backbone's tokenizer is known: a2tgpo/train/episodes.py).

Answers are text whatever their JSON type: a number or boolean answer becomes its JSON text
(`1912` -> "1912", `3.0` -> "3.0", `true` -> "true"; `answer_text`), so one numeric answer
neither fails nor drops other rows. A null, list, object or non-finite number among the answers
makes the row invalid. JSONL files are read line by line (`a2tgpo.data.jsonl`): a line that is
not UTF-8, not JSON or not an object, and an empty file, always stop with the file and line;
`on_invalid_row` applies to well-formed rows lacking a question, an id or valid answers.

`prepare_data` writes `train.parquet` (all training sources minus the dev holdout),
`dev.parquet`, `test/<name>.parquet` and, last, `summary.json`. Outputs are deterministic: the
same inputs and seed give byte-identical parquet files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from a2tgpo.algo.rewards import normalize_answer
from a2tgpo.config import SEED_LIMIT, ConfigError, file_name_error, load_config, option
from a2tgpo.data.jsonl import DataFileError, iter_jsonl
from a2tgpo.io import atomic_path, atomic_write_json

log = logging.getLogger(__name__)

MAX_QUESTION_CHARS = 2000  # the default of DataConfig.max_question_chars


@dataclasses.dataclass(frozen=True)
class DatasetSource:
    """One QA file: `<repo>/<subset>/<split>.jsonl` (flashrag) or `<repo>/<split>.parquet`."""

    name: str = option(doc="output name: test file `test/<name>.parquet` and the id prefix")
    loader: Literal["flashrag", "searchr1"] = option(
        doc="file layout: 'flashrag' (FlashRAG_datasets) or 'searchr1' (Search-R1 "
            "nq_hotpotqa_train parquet)")
    repo: str = option(doc="HF hub dataset id (e.g. RUC-NLPIR/FlashRAG_datasets) or a local "
                           "directory laid out exactly like that hub repo")
    group: Literal["single_hop", "multi_hop", "mixed"] = option(
        doc="benchmark group the rows are reported under")
    subset: str = option("", "flashrag dataset folder, e.g. nq, hotpotqa, 2wikimultihopqa "
                             "(must be empty for searchr1)")
    split: str = option("auto", "split file to read; 'auto' = test if it exists, else dev "
                                "(the Search-R1 / A2TGPO evaluation rule)")
    limit: int | None = option(None, "keep only the first N rows of the file (small runs)", ge=1)
    revision: str | None = option(None, "hub revision (branch, tag or commit) to pin; hub only")

    def __post_init__(self) -> None:
        # file names: test/<name>.parquet, <repo>/<subset>/<split>.jsonl
        if error := file_name_error(self.name):
            raise ValueError(f"name {error}")
        if self.loader == "flashrag" and file_name_error(self.subset):
            raise ValueError(f"subset {self.subset!r}: the flashrag loader needs a folder name")
        if self.loader == "searchr1" and self.subset:
            raise ValueError("subset is only used by the flashrag loader; leave it empty")
        if error := file_name_error(self.split):
            raise ValueError(f"split {error}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 or null, got {self.limit}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The `data` section: which QA files form the train, dev and test splits."""

    train: tuple[DatasetSource, ...] = option(doc="training sources, concatenated in this order")
    test: tuple[DatasetSource, ...] = option((), "evaluation sources, one test/<name>.parquet each")
    dev_size: int = option(0, "rows held out of the combined training rows (chosen by `seed`) "
                              "as the dev split for checkpoint selection; disjoint from train",
                           ge=0)
    seed: int = option(0, "seed of the dev holdout", ge=0, lt=SEED_LIMIT)
    on_invalid_row: Literal["error", "drop"] = option(
        "error", "a row without a question or golden answers: 'error' stops, 'drop' skips and "
                 "counts it (reported in summary.json)")
    max_question_chars: int = option(
        MAX_QUESTION_CHARS,
        "a longer question is an invalid row (see on_invalid_row): a bound on the prompt before "
        "any tokenizer is known (English takes several characters per token, so 2000 stays "
        "inside the papers' 2000-token prompt budget); training and evaluation then check the "
        "prompt's tokens against backbone.max_model_len - rollout.max_response_tokens", ge=1)

    def __post_init__(self) -> None:
        for role, sources in (("train", self.train), ("test", self.test)):
            names = Counter(s.name for s in sources)
            if dup := sorted(n for n, k in names.items() if k > 1):
                raise ValueError(f"{role}: duplicate source names {dup}")
        if self.dev_size < 0:
            raise ValueError(f"dev_size must be >= 0, got {self.dev_size}")


# --------------------------------------------------------------------------------------------
# file resolution


@dataclasses.dataclass(frozen=True)
class ResolvedFile:
    path: Path  # a local file (a hub file is downloaded into the HF cache)
    display: str  # what error messages and summary.json call the file
    split: str  # the concrete split ("auto" resolved)


def _filename(src: DatasetSource, split: str) -> str:
    if src.loader == "flashrag":
        return f"{src.subset}/{split}.jsonl"
    return f"{split}.parquet"


def _candidate_splits(src: DatasetSource) -> tuple[str, ...]:
    return ("test", "dev") if src.split == "auto" else (src.split,)


def resolve_file(src: DatasetSource) -> ResolvedFile:
    """Find the file of `src` locally or on the hub (downloading it); raise if it is missing."""
    local = Path(src.repo).expanduser()
    if local.exists() or src.repo.startswith(("/", ".", "~")):
        return _resolve_local(src, local)
    return _resolve_hub(src)


def _resolve_local(src: DatasetSource, root: Path) -> ResolvedFile:
    if not root.is_dir():
        raise FileNotFoundError(f"{src.name}: local dataset directory {root} not found")
    if src.revision is not None:
        raise ValueError(f"{src.name}: revision applies to hub repos only, {root} is local")
    for split in _candidate_splits(src):
        path = root / _filename(src, split)
        if path.is_file():
            return ResolvedFile(path, str(path), split)
    tried = ", ".join(str(root / _filename(src, s)) for s in _candidate_splits(src))
    raise FileNotFoundError(f"{src.name}: no such file: {tried}")


def _resolve_hub(src: DatasetSource) -> ResolvedFile:
    import huggingface_hub
    from huggingface_hub import constants

    def display(split: str) -> str:
        at = f"@{src.revision}" if src.revision else ""
        return f"hf://datasets/{src.repo}{at}/{_filename(src, split)}"

    split = src.split
    if split == "auto":
        split = _hub_auto_split(src, display, offline=constants.HF_HUB_OFFLINE)
    # Honours HF_HUB_OFFLINE itself: offline it only returns a cached file, else raises.
    path = huggingface_hub.hf_hub_download(
        src.repo, _filename(src, split), repo_type="dataset", revision=src.revision
    )
    return ResolvedFile(Path(path), display(split), split)


def _hub_auto_split(src: DatasetSource, display, *, offline: bool) -> str:
    import huggingface_hub

    if not offline:
        files = set(huggingface_hub.HfApi().list_repo_files(
            src.repo, repo_type="dataset", revision=src.revision))
        for split in ("test", "dev"):
            if _filename(src, split) in files:
                return split
        raise FileNotFoundError(
            f"{src.name}: neither {display('test')} nor {display('dev')} exists")
    # Offline the repo listing is unavailable; the cache knows a file (path), knows it is absent
    # (a sentinel object) or knows nothing (None). Guessing "dev" when "test" is merely
    # uncached would silently evaluate on the wrong split, so that case is an error.
    for split in ("test", "dev"):
        cached = huggingface_hub.try_to_load_from_cache(
            src.repo, _filename(src, split), revision=src.revision, repo_type="dataset")
        if isinstance(cached, str):
            return split
        if cached is None:
            raise FileNotFoundError(
                f"{src.name}: HF_HUB_OFFLINE is set and the cache does not know whether "
                f"{display(split)} exists, so split 'auto' cannot be resolved; set `split` "
                "explicitly or download the file first")
    raise FileNotFoundError(
        f"{src.name}: neither {display('test')} nor {display('dev')} exists")


# --------------------------------------------------------------------------------------------
# row normalisation

SINGLE_HOP_DATASETS = frozenset({"nq", "triviaqa", "popqa"})
# MuSiQue ids start with the question's shape, e.g. "2hop__", "3hop1__", "4hop3__".
_MUSIQUE_ID = re.compile(r"^(([234])hop\d*)__")
# the answer list of each layout (searchr1: the one its reward scores; flattened column name)
ANSWERS_COLUMN = {"flashrag": "golden_answers", "searchr1": "reward_model.ground_truth.target"}
# metadata keys hop_info reads (FlashRAG: type, question_decomposition; toy world: hop_type, hops)
_META_KEYS = ("hop_type", "hops", "type", "question_decomposition")


def hop_info(dataset: str, raw_id: str, meta: dict[str, Any]) -> tuple[str | None, int | None]:
    """(hop_type, hops) of a row, from what its dataset states; None where it states nothing."""
    if meta.get("hop_type") is not None:  # our toy world states both
        return str(meta["hop_type"]), meta.get("hops")
    if dataset in SINGLE_HOP_DATASETS:
        return "single", 1
    if dataset == "hotpotqa":  # type: bridge | comparison; two gold paragraphs by construction
        return meta.get("type"), 2
    if dataset == "2wikimultihopqa":  # compositional|comparison|inference|bridge_comparison
        return meta.get("type"), None
    if dataset == "musique":
        if m := _MUSIQUE_ID.match(raw_id):
            return m.group(1), int(m.group(2))
        if decomposition := meta.get("question_decomposition"):  # one sub-question per hop
            return f"{len(decomposition)}hop", len(decomposition)
        return None, None
    if dataset == "bamboogle":  # 125 two-hop questions by construction (Press et al., 2022)
        return None, 2
    return None, None


def _meta_of(row: dict[str, Any]) -> dict[str, Any]:
    # After Dataset.flatten() struct metadata arrives as "metadata.<key>" columns; a metadata
    # column whose rows disagree in type stays one decoded JSON value instead.
    if isinstance(row.get("metadata"), dict):
        return row["metadata"]
    return {k: row[f"metadata.{k}"] for k in _META_KEYS if f"metadata.{k}" in row}


def answer_text(value: Any) -> Any:
    """A golden answer as text: a string as is; a number or boolean as its JSON text
    (1912 -> "1912", 3.0 -> "3.0", true -> "true"); anything else (null, a list, NaN) unchanged,
    for the caller to reject."""
    if isinstance(value, bool | int) or (isinstance(value, float) and math.isfinite(value)):
        return json.dumps(value)
    return value


def _normalise(row: dict[str, Any], src: DatasetSource, split: str,
               max_question_chars: int) -> dict[str, Any]:
    """One raw (flattened) row -> a `row_schema()` dict; ValueError (no location) if invalid."""
    raw_id = row.get("id")
    if isinstance(raw_id, int) and not isinstance(raw_id, bool):
        raw_id = str(raw_id)
    if not isinstance(raw_id, str) or not raw_id.strip():
        raise ValueError("missing or empty id")
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"missing or empty question: {question!r}")
    if len(question.strip()) > max_question_chars:
        raise ValueError(f"question of {len(question.strip())} characters, over "
                         f"data.max_question_chars ({max_question_chars})")
    answers_key = ANSWERS_COLUMN[src.loader]
    answers = row.get(answers_key)
    if not isinstance(answers, list) or not answers:
        raise ValueError(f"{answers_key} must be a non-empty list, got {answers!r}")
    answers = [answer_text(a) for a in answers]
    if not all(isinstance(a, str) and a.strip() for a in answers):
        raise ValueError(f"{answers_key} must hold non-empty strings or numbers, got "
                         f"{row.get(answers_key)!r}")
    if empty := [a for a in answers if not normalize_answer(a)]:
        raise ValueError(f"golden answer {empty[0]!r} normalises to the empty string (the EM "
                         "normalisation drops case, punctuation and a/an/the), so no "
                         "prediction can match it")
    if src.loader == "flashrag":
        dataset, row_id = src.subset, f"{src.name}/{raw_id}"
        source = src.name
    else:
        dataset = row.get("data_source")
        if not isinstance(dataset, str) or not dataset:
            raise ValueError(f"missing data_source: {dataset!r}")
        row_id, source = f"{src.name}/{dataset}/{raw_id}", dataset
    hop_type, hops = hop_info(dataset, raw_id, _meta_of(row))
    if hops is not None and (not isinstance(hops, int) or isinstance(hops, bool)):
        raise ValueError(f"metadata.hops must be an int, got {hops!r}")
    return {
        "id": row_id,
        "question": question.strip(),
        "golden_answers": [a.strip() for a in answers],
        "source": source,
        "split": split,
        "group": src.group,
        "hop_type": None if hop_type is None else str(hop_type),
        "hops": hops,
    }


@dataclasses.dataclass(frozen=True)
class LoadedSource:
    source: DatasetSource
    file: ResolvedFile
    rows: list[dict[str, Any]]  # row_schema() dicts, file order
    dropped: int  # invalid rows skipped (on_invalid_row="drop")


def load_source(
    src: DatasetSource, on_invalid_row: Literal["error", "drop"] = "error",
    max_question_chars: int = MAX_QUESTION_CHARS,
) -> LoadedSource:
    """Resolve, read and normalise one source.

    An unreadable file (not UTF-8, a line that is not a JSON object, an empty JSONL file, a
    damaged parquet file) raises DataFileError naming the file and line. An invalid row raises
    DataFileError naming the file, the line (JSONL; 1-based) or row (parquet; 0-based) and the
    raw id, or with on_invalid_row="drop" is skipped, counted and logged.
    """
    file = resolve_file(src)
    read = _read_jsonl if src.loader == "flashrag" else _read_parquet
    rows, errors = [], []
    for where, raw in read(file, src):
        try:
            rows.append(_normalise(raw, src, file.split, max_question_chars))
        except ValueError as e:
            msg = f"{file.display} {where} (id {raw.get('id')!r}): {e}"
            if on_invalid_row == "error":
                raise DataFileError(msg) from None
            errors.append(msg)
    if errors:
        log.warning("%s: dropped %d invalid rows; first: %s", file.display, len(errors), errors[0])
    _check_unique_ids(rows, file.display)
    return LoadedSource(src, file, rows, len(errors))


def _read_jsonl(file: ResolvedFile, src: DatasetSource) -> Iterator[tuple[str, dict]]:
    # Read as Python values, not through an Arrow table: Arrow infers one type per column, so
    # an answer written as a number (1912) either fails the other rows' string answers or
    # turns the whole column into JSON values; here each row keeps its own types.
    for n, (lineno, row) in enumerate(iter_jsonl(file.path, file.display)):
        if src.limit is not None and n >= src.limit:
            return
        yield f"line {lineno}", row


def _read_parquet(file: ResolvedFile, src: DatasetSource) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(file.path)
    except (pa.ArrowException, OSError) as e:
        raise DataFileError(f"{file.display}: not a readable parquet file ({e})") from None
    if src.limit is not None:
        table = table.slice(0, src.limit)
    # nested columns -> "a.b" columns, so only the needed ones are converted to Python
    while any(pa.types.is_struct(f.type) for f in table.schema):
        table = table.flatten()
    answers_key = ANSWERS_COLUMN[src.loader]
    for col in ("id", "question", "data_source", answers_key):
        if col not in table.column_names:
            raise DataFileError(f"{file.display}: no column {col!r} (a Search-R1 parquet "
                                f"file has it); columns: {table.column_names}")
    wanted = {"id", "question", answers_key, "data_source", "metadata",
              *(f"metadata.{k}" for k in _META_KEYS)}
    table = table.select([c for c in table.column_names if c in wanted])
    for i, row in enumerate(table.to_pylist()):
        yield f"row {i}", row


def _check_unique_ids(rows: list[dict[str, Any]], where: str) -> None:
    counts = Counter(r["id"] for r in rows)
    if dup := sorted(i for i, k in counts.items() if k > 1):
        raise ValueError(f"{where}: duplicate ids {dup[:5]}{' ...' if len(dup) > 5 else ''}")


# --------------------------------------------------------------------------------------------
# output


def row_schema():
    """The pyarrow schema of every prepared parquet file (see the module docstring)."""
    import pyarrow as pa

    return pa.schema([
        pa.field("id", pa.string(), nullable=False),
        pa.field("question", pa.string(), nullable=False),
        pa.field("golden_answers", pa.list_(pa.string()), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
        pa.field("group", pa.string(), nullable=False),
        pa.field("hop_type", pa.string()),
        pa.field("hops", pa.int32()),
    ])


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # A fixed schema (not one inferred from the rows) keeps empty and all-null columns typed.
    pq.write_table(pa.Table.from_pylist(rows, schema=row_schema()), path)


def load_split(path: str | Path) -> list[dict[str, Any]]:
    """Read a prepared parquet file back as `row_schema()` dicts (file order)."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if not table.schema.remove_metadata().equals(row_schema()):
        raise ValueError(f"{path}: not a prepared QA file; schema is {table.schema}")
    return table.to_pylist()


def dev_holdout(ids: list[str], dev_size: int, seed: int) -> set[str]:
    """The `dev_size` ids with the smallest sha256("<seed>:<id>").

    Hashing the id (not drawing from an RNG over positions) makes the choice independent of
    row order and Python version: the same id with the same seed is always held out.
    """
    if dev_size > len(ids):
        raise ValueError(f"dev_size {dev_size} exceeds the {len(ids)} training rows")
    ranked = sorted(ids, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())
    return set(ranked[:dev_size])


def dev_size_error(dev_size: int, rows: int, files: list[str]) -> str | None:
    """Why holding `dev_size` of `rows` training rows out is refused (None: it is not): it
    must leave at least one row to train on (an empty train.parquet trains nothing)."""
    if dev_size < rows:
        return None
    return (f"{dev_size} dev rows held out of {rows} training rows leave none to train on "
            f"({', '.join(files) or 'no training sources'}); set it below {rows}")


def known_rows(src: DatasetSource) -> int | None:
    """At most how many rows `src` gives, when its file is local and on disk (None: not known
    before it is read): non-blank JSONL lines, or the parquet footer's row count, capped by
    `limit`. An upper bound: invalid rows may be dropped."""
    root = Path(src.repo)
    if not root.is_dir():
        return None
    try:
        file = _resolve_local(src, root)
    except (OSError, ValueError):
        return None
    if src.loader == "flashrag":
        with open(file.path, "rb") as f:
            n = sum(1 for line in f if line.strip())
    else:
        import pyarrow.parquet as pq

        try:
            n = pq.ParquetFile(file.path).metadata.num_rows
        except Exception:  # a damaged file: prepare-data names it
            return None
    return n if src.limit is None else min(n, src.limit)


def _counts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_source: dict[str, Counter] = {}
    for r in rows:
        by_source.setdefault(r["source"], Counter())[r["hop_type"] or "none"] += 1
    return {
        "rows": len(rows),
        "by_source": {s: dict(sorted(c.items())) for s, c in sorted(by_source.items())},
    }


def prepare_data(cfg: DataConfig, out_dir: str | Path, *, source: str = "data config",
                 key: str = "dev_size") -> dict[str, Any]:
    """Load every source and write train/dev/test parquet files and summary.json (last).

    Returns the summary: per output file its row count and rows per source and hop_type, per
    input its resolved file, split, loaded and dropped rows. `source` and `key` (the config
    file, the dotted key of dev_size) name the setting a refusal is about.
    """
    out = Path(out_dir)
    loaded = {
        role: [load_source(s, cfg.on_invalid_row, cfg.max_question_chars) for s in sources]
        for role, sources in (("train", cfg.train), ("test", cfg.test))
    }
    train_all = [r for part in loaded["train"] for r in part.rows]
    _check_unique_ids(train_all, "training sources combined")
    if error := dev_size_error(cfg.dev_size, len(train_all),
                               [p.file.display for p in loaded["train"]]):
        raise ConfigError(f"{source}: {key}: {error}")  # before anything is written
    dev_ids = dev_holdout([r["id"] for r in train_all], cfg.dev_size, cfg.seed)
    outputs = {
        "train.parquet": [r for r in train_all if r["id"] not in dev_ids],
        "dev.parquet": [r for r in train_all if r["id"] in dev_ids],
    }
    outputs |= {f"test/{part.source.name}.parquet": part.rows for part in loaded["test"]}

    for name in ("train.parquet", "dev.parquet"):
        with atomic_path(out / name) as tmp:
            _write_rows(tmp, outputs[name])
    # The test folder is replaced whole, so a source removed from the config leaves no file.
    with atomic_path(out / "test", directory=True) as tmp_dir:
        for part in loaded["test"]:
            _write_rows(tmp_dir / f"{part.source.name}.parquet", part.rows)

    summary = {
        "seed": cfg.seed,
        "dev_size": cfg.dev_size,
        "on_invalid_row": cfg.on_invalid_row,
        "inputs": [
            {"role": role, "name": p.source.name, "loader": p.source.loader, "file": p.file.display,
             "split": p.file.split, "rows": len(p.rows), "dropped": p.dropped}
            for role, parts in loaded.items() for p in parts
        ],
        "dropped": {f"{role}/{p.source.name}": p.dropped
                    for role, parts in loaded.items() for p in parts},
        "files": {name: _counts(rows) for name, rows in outputs.items()},
    }
    atomic_write_json(out / "summary.json", summary)
    print_summary(summary)
    return summary


# how many hex digits of a file's sha256 name its MLflow dataset (MLflow allows 36)
DIGEST_CHARS = 16


def dataset_input(path: str | Path, context: str, *, sha256: str | None = None) -> dict[str, Any]:
    """A prepared file (train.parquet, dev.parquet, test/<name>.parquet) as an MLflow dataset
    input (`a2tgpo.tracking.Tracker.log_inputs`): name `<data folder>/<file stem>` (e.g.
    multi_hop/train, multi_hop/hotpotqa), digest the file's sha256 (its first DIGEST_CHARS hex
    digits; `sha256` when the caller hashed it already), source the file, and a profile with
    its rows and where they came from (the hub file with its revision, or the local file, from
    the data folder's summary.json). `context`: training, validation or test."""
    path = Path(path).resolve()
    data = path.parent.parent if path.parent.name == "test" else path.parent
    if sha256 is None:
        sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    rel = path.relative_to(data).as_posix()
    profile: dict[str, Any] = {"file": rel}
    summary_file = data / "summary.json"
    if summary_file.is_file():  # a prepared folder: rows and origins
        summary = json.loads(summary_file.read_text())
        files, inputs = summary.get("files", {}), summary.get("inputs", [])
        if rel in files:
            profile["rows"] = files[rel]["rows"]
        if rel.startswith("test/"):
            origins = [i for i in inputs if i["role"] == "test" and i["name"] == path.stem]
        else:
            origins = [i for i in inputs if i["role"] == "train"]
        profile["from"] = [f"{i['file']} ({i['split']}, {i['rows']} rows)" for i in origins]
    return {"name": f"{data.name}/{path.stem}", "digest": sha256[:DIGEST_CHARS],
            "source_type": "local", "source": json.dumps({"uri": str(path)}),
            "profile": json.dumps(profile), "context": context}


def print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("file", "source", "hop types", "rows", title="prepared QA data")
    for name, info in summary["files"].items():
        if not info["by_source"]:
            table.add_row(name, "-", "-", "0")
        for source, hops in info["by_source"].items():
            kinds = ", ".join(f"{h} {n}" for h, n in hops.items())
            table.add_row(name, source, kinds, str(sum(hops.values())))
    console = Console()
    console.print(table)
    if dropped := {k: n for k, n in summary["dropped"].items() if n}:
        console.print("[yellow]dropped invalid rows:[/] "
                      + ", ".join(f"{k} {n}" for k, n in dropped.items()))


def main(config_path: str, overrides: list[str], out_dir: str, section: str | None = "data") -> int:
    """CLI entry: load the `data` section of `config_path` and prepare the data into `out_dir`."""
    cfg = load_config(DataConfig, config_path, overrides, section=section)
    prepare_data(cfg, Path(out_dir), source=config_path,
                 key=f"{section}.dev_size" if section else "dev_size")
    return 0
