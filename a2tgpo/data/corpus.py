"""`a2tgpo download-corpus`: fetch and verify the retrieval corpus and, optionally, its index.

Defaults are Search-R1's: the wiki-18 corpus (`PeterJinGo/wiki-18-corpus`, `wiki-18.jsonl.gz`,
21,015,324 JSONL passages `{"id", "contents"}`) and its e5 Flat index
(`PeterJinGo/wiki-18-e5-index`, parts `part_aa` + `part_ab` concatenated into `e5_Flat.index`,
about 65 GB).

Layout of `out_dir`:

    wiki-18.jsonl.gz   the corpus, moved here only after it passed every check
    e5_Flat.index      the index parts concatenated in order (when `index.enabled`)
    manifest.json      what was verified: commit, etag, sizes, line count, sha256
    .download/         huggingface_hub `local_dir` where files are downloaded and checked

Checks: size against the size the hub reports and the configured `expected_bytes`; sha256
against the hub's etag when the file is LFS/Xet (the etag is then its sha256); the corpus's line
count (after gunzip) against `expected_lines`. A file that fails never reaches its final path. If
its bytes differ from the hub's it is deleted; if they match the hub but not the config, it stays
in `.download/`, so a re-run with the config corrected does not download it again.

A re-run checks the manifest against the config and the file sizes on disk (a cheap check: delete
manifest.json to verify everything again) and, when they match, makes no network call. Otherwise
a corpus file at its final path goes back to `.download/`, where huggingface_hub reuses it if the
hub's etag still matches (a damaged copy fails verification and is downloaded afresh once).

Resuming: huggingface_hub 2.4.0 resumes (HTTP Range, from the last complete 10 MiB chunk) only
within one call, when the connection drops mid-transfer. A killed process leaves a partial file
under a per-process name that is never reused, so the next run deletes such leftovers.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import json
import logging
import os
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.file_download import HfFileMetadata

from a2tgpo.config import InvalidKey, file_name_error, load_config, option
from a2tgpo.io import atomic_path, atomic_write_json
from a2tgpo.progress import progress_bar

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STAGING = ".download"
_CHUNK = 16 * 1024 * 1024
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CorpusError(RuntimeError):
    """A download failed verification, or another download is using the same output folder."""


@dataclass(frozen=True)
class PrebuiltIndexConfig:
    """A prebuilt faiss index published as parts to concatenate (`cat part_* > index`)."""

    enabled: bool = option(False, "Download the prebuilt index too (the e5 Flat index is ~65 GB).")
    repo_id: str = option(
        "PeterJinGo/wiki-18-e5-index", "Hub dataset repo holding the index parts."
    )
    parts: tuple[str, ...] = option(
        ("part_aa", "part_ab"), "Part files in the repo, in concatenation order."
    )
    combined_name: str = option(
        "e5_Flat.index", "File name of the concatenated index in the output folder."
    )
    expected_bytes: int | None = option(
        None,
        "Size of the concatenated index in bytes; null = only check that it equals the sum of the "
        "part sizes the hub reports.", ge=1
    )

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("parts: name at least one part file")
        # each a file of the output folder (the parts while they download)
        for key, name in [*((f"parts[{i}]", p) for i, p in enumerate(self.parts)),
                          ("combined_name", self.combined_name)]:
            if error := file_name_error(name):
                raise InvalidKey(key, error)
        if len(set(self.parts)) != len(self.parts):
            raise ValueError(f"parts: duplicate names in {list(self.parts)}")
        if self.expected_bytes is not None and self.expected_bytes <= 0:
            raise ValueError(f"expected_bytes: must be positive, got {self.expected_bytes}")


@dataclass(frozen=True)
class CorpusConfig:
    """Where the retrieval corpus and its optional prebuilt index come from; how to check them."""

    repo_id: str = option("PeterJinGo/wiki-18-corpus", "Hub dataset repo of the corpus.")
    filename: str = option(
        "wiki-18.jsonl.gz",
        "Corpus file in the repo (JSONL {id, contents}, gzip or plain); also its name in the "
        "output folder.",
    )
    revision: str | None = option(
        None,
        "Branch, tag or commit of the corpus repo; null = main. The index parts always come "
        "from main. The commits actually used are recorded in manifest.json.",
    )
    expected_lines: int | None = option(
        21015324,
        "Number of lines (passages) the corpus must have, counted after gunzip; null = no check. "
        "21,015,324 for wiki-18 (DPR Dec-2018 Wikipedia in 100-word passages).", ge=1
    )
    expected_bytes: int | None = option(
        None,
        "Exact size of the corpus file in bytes, checked besides the size the hub reports; "
        "null = only the hub's size.", ge=1
    )
    index: PrebuiltIndexConfig = option(
        doc="The prebuilt dense index (off by default).", factory=PrebuiltIndexConfig
    )
    endpoint: str | None = option(
        None,
        "Hub endpoint URL, e.g. a mirror; null = huggingface_hub's default (HF_ENDPOINT, else "
        "https://huggingface.co).",
    )

    def __post_init__(self) -> None:
        if error := file_name_error(self.filename):  # <out>/<filename>
            raise InvalidKey("filename", error)
        if self.endpoint is not None and not re.fullmatch(r"https?://[^\s/]+(/\S*)?",
                                                          self.endpoint):
            raise InvalidKey("endpoint", f"expected an http(s):// URL, got {self.endpoint!r}")
        if self.revision is not None and not self.revision.strip():
            raise InvalidKey("revision", "empty: write null for the default branch")
        if self.expected_lines is not None and self.expected_lines < 0:
            raise ValueError(f"expected_lines: must be >= 0, got {self.expected_lines}")
        if self.expected_bytes is not None and self.expected_bytes <= 0:
            raise ValueError(f"expected_bytes: must be positive, got {self.expected_bytes}")
        names = [self.filename] + ([self.index.combined_name] if self.index.enabled else [])
        if MANIFEST in names or len(set(names)) != len(names):
            raise ValueError(
                f"filename and index.combined_name must differ from each other and from {MANIFEST}"
            )


# --------------------------------------------------------------------------------------------
# entry points


def download_corpus(cfg: CorpusConfig, out_dir: Path) -> dict:
    """Download and verify the corpus (and the index when enabled) into `out_dir`.

    Returns a summary: `{"out_dir", "corpus": entry, "index": entry or None}`, where each entry
    holds the manifest record plus `path` and `status` ("present": verified earlier, nothing
    fetched; "fetched": downloaded or re-verified now). Raises `CorpusError` on a failed check.
    """
    out_dir = Path(out_dir)
    staging = out_dir / STAGING
    staging.mkdir(parents=True, exist_ok=True)
    # huggingface_hub joins the endpoint and the path with "/", so a trailing slash would double it.
    endpoint = cfg.endpoint.rstrip("/") if cfg.endpoint else None
    with _exclusive(staging / ".lock", out_dir):
        _remove_orphaned_partials(staging)
        manifest = _read_manifest(out_dir / MANIFEST)
        summary: dict = {"out_dir": str(out_dir), "corpus": None, "index": None}
        corpus_source = {
            "repo_id": cfg.repo_id,
            "revision": cfg.revision,
            "filename": cfg.filename,
            "expected_bytes": cfg.expected_bytes,
            "expected_lines": cfg.expected_lines,
        }
        summary["corpus"] = _ensure(
            manifest,
            out_dir,
            cfg.filename,
            corpus_source,
            lambda: _fetch_corpus(cfg, endpoint, out_dir, staging),
        )
        if cfg.index.enabled:
            index_source = {
                "repo_id": cfg.index.repo_id,
                "parts": list(cfg.index.parts),
                "expected_bytes": cfg.index.expected_bytes,
            }
            summary["index"] = _ensure(
                manifest,
                out_dir,
                cfg.index.combined_name,
                index_source,
                lambda: _fetch_index(cfg.index, endpoint, out_dir, staging),
            )
    return summary


def format_summary(summary: dict) -> str:
    """A few human-readable lines describing `download_corpus`'s result."""
    lines = []
    for kind in ("corpus", "index"):
        entry = summary.get(kind)
        if entry is None:
            continue
        text = f"{kind:<6} {entry['path']}  {entry['bytes']:,} bytes"
        if entry.get("lines") is not None:
            text += f"  {entry['lines']:,} lines"
        text += f"  sha256 {entry['sha256'][:16]}…  [{entry['status']}]"
        lines.append(text)
    return "\n".join(lines)


def main(
    config_path: str, overrides: list[str], out_dir: str, section: str | None = "corpus"
) -> int:
    """`a2tgpo download-corpus`: load the config section, download, print a summary.

    Returns 0 on success and 1 when a downloaded file fails verification.
    """
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = load_config(CorpusConfig, config_path, overrides, section=section)
    try:
        summary = download_corpus(cfg, Path(out_dir))
    except CorpusError as e:
        log.error("%s", e)
        return 1
    print(format_summary(summary))
    return 0


# --------------------------------------------------------------------------------------------
# one artifact: skip when the manifest vouches for it, else fetch, verify and record


def _ensure(
    manifest: dict, out_dir: Path, name: str, source: dict, fetch: Callable[[], dict]
) -> dict:
    manifest_path = out_dir / MANIFEST
    path = out_dir / name
    entry = manifest["files"].get(name)
    if (
        entry is not None
        and entry.get("source") == source
        and path.is_file()
        and path.stat().st_size == entry.get("bytes")
    ):
        log.info("%s: present and verified earlier (%s); nothing to download", path, manifest_path)
        return {**entry, "path": str(path), "status": "present"}
    if entry is not None:
        # The file is about to be replaced: the manifest must never vouch for a file in flux.
        log.info("%s: manifest entry does not match the config or the file; fetching again", name)
        del manifest["files"][name]
        atomic_write_json(manifest_path, manifest)
    entry = {"source": source, **fetch()}
    manifest["files"][name] = entry
    atomic_write_json(manifest_path, manifest)
    return {**entry, "path": str(path), "status": "fetched"}


def _fetch_corpus(cfg: CorpusConfig, endpoint: str | None, out_dir: Path, staging: Path) -> dict:
    final = out_dir / cfg.filename
    staged_name = staging / cfg.filename
    if final.is_file():
        # Not vouched for by the manifest: it returns to its final path only after verification,
        # and in staging huggingface_hub reuses it instead of downloading when the etag matches.
        staged_name.parent.mkdir(parents=True, exist_ok=True)
        os.replace(final, staged_name)
    local_copy = staged_name.is_file()
    while True:
        staged, meta = _download(cfg.repo_id, cfg.filename, cfg.revision, endpoint, staging)
        size = staged.stat().st_size
        try:
            _check_size(cfg.filename, size, meta.size, "the hub")
            log.info("%s: hashing and counting lines", cfg.filename)
            sha256, lines = _hash_and_count_lines(staged, meta.etag)
            break
        except CorpusError as e:
            staged.unlink(missing_ok=True)
            if not local_copy:
                raise CorpusError(f"{e}; deleted it, run again to download it afresh") from None
            # huggingface_hub reused a damaged local copy (its etag bookkeeping still matched).
            log.warning("%s; deleted the local copy, downloading afresh", e)
            local_copy = False
    # The bytes are the hub's now, so a mismatch below is the config's: keep the file in staging,
    # where a re-run with a corrected config finds it without downloading again.
    name, kept = cfg.filename, f"; kept it in {staging}, not at {final}"
    if cfg.expected_bytes is not None and size != cfg.expected_bytes:
        raise CorpusError(
            f"{name}: is {size:,} bytes but expected_bytes says {cfg.expected_bytes:,}{kept}"
        )
    if cfg.expected_lines is not None and lines != cfg.expected_lines:
        raise CorpusError(
            f"{name}: has {lines:,} lines but expected_lines is {cfg.expected_lines:,}{kept}"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staged, final)
    log.info("%s: verified, %s bytes, %s lines", final, f"{size:,}", f"{lines:,}")
    return {
        "commit": meta.commit_hash,
        "etag": meta.etag,
        "bytes": size,
        "lines": lines,
        "sha256": sha256,
    }


def _fetch_index(
    icfg: PrebuiltIndexConfig, endpoint: str | None, out_dir: Path, staging: Path
) -> dict:
    final = out_dir / icfg.combined_name
    # Not vouched for by the manifest; its parts are gone, so it cannot be reused.
    final.unlink(missing_ok=True)
    parts = []
    for name in icfg.parts:
        path, meta = _download(icfg.repo_id, name, None, endpoint, staging)
        size = path.stat().st_size
        try:
            _check_size(name, size, meta.size, "the hub")
        except CorpusError:
            path.unlink(missing_ok=True)
            raise
        parts.append((name, path, meta, size))
    total = sum(size for *_, size in parts)
    if icfg.expected_bytes is not None and total != icfg.expected_bytes:
        # The parts match the hub, so the config is the likelier culprit: keep them for a re-run.
        raise CorpusError(
            f"{icfg.combined_name}: the parts add up to {total:,} bytes but index.expected_bytes "
            f"is {icfg.expected_bytes:,}; kept the parts in {staging}"
        )
    log.info("%s: concatenating %d parts (%s bytes)", final, len(parts), f"{total:,}")
    combined = hashlib.sha256()
    records = []
    with atomic_path(final) as tmp:
        with open(tmp, "wb") as out, _bytes_bar(total, f"concatenate {icfg.combined_name}") as bar:
            for name, path, meta, size in parts:
                part_sha = hashlib.sha256()
                with open(path, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        out.write(chunk)
                        part_sha.update(chunk)
                        combined.update(chunk)
                        bar.update(len(chunk))
                try:
                    _check_sha256(name, part_sha.hexdigest(), meta.etag)
                except CorpusError:
                    path.unlink(missing_ok=True)
                    raise
                records.append(
                    {
                        "name": name,
                        "commit": meta.commit_hash,
                        "etag": meta.etag,
                        "bytes": size,
                        "sha256": part_sha.hexdigest(),
                    }
                )
        written = tmp.stat().st_size
        if written != total:
            raise CorpusError(
                f"{icfg.combined_name}: wrote {written:,} bytes but the parts add up to {total:,}"
            )
    # The parts are as large as the index itself; keeping them would double the disk use.
    for _, path, _, _ in parts:
        path.unlink()
    log.info("%s: verified, %s bytes", final, f"{total:,}")
    return {"parts": records, "bytes": total, "sha256": combined.hexdigest()}


# --------------------------------------------------------------------------------------------
# helpers


def _download(
    repo_id: str, filename: str, revision: str | None, endpoint: str | None, staging: Path
) -> tuple[Path, HfFileMetadata]:
    """Download one dataset file into `staging`, pinned to the commit the hub resolves now."""
    url = hf_hub_url(repo_id, filename, repo_type="dataset", revision=revision, endpoint=endpoint)
    meta = get_hf_file_metadata(url, endpoint=endpoint, retry_on_errors=True)
    size = "size unknown" if meta.size is None else f"{meta.size:,} bytes"
    log.info("%s: %s@%s, %s", filename, repo_id, (meta.commit_hash or "?")[:12], size)
    path = hf_hub_download(
        repo_id,
        filename,
        repo_type="dataset",
        # Pin the commit we just read the size and etag of, so both describe the same file.
        revision=meta.commit_hash or revision,
        local_dir=staging,
        endpoint=endpoint,
    )
    return Path(path), meta


def _check_size(name: str, actual: int, want: int | None, who: str) -> None:
    if want is not None and actual != want:
        raise CorpusError(f"{name}: is {actual:,} bytes but {who} says {want:,}")


def _check_sha256(name: str, sha256: str, etag: str | None) -> None:
    # Only LFS/Xet files have a sha256 etag; small git files have a sha1 one, not comparable.
    if etag is not None and _SHA256.fullmatch(etag) and etag != sha256:
        raise CorpusError(f"{name}: sha256 is {sha256} but the hub's etag says {etag}")


class _HashingReader:
    """Read-only file wrapper that hashes and reports every byte read through it."""

    def __init__(self, raw: BinaryIO, digest: hashlib._Hash, bar: Any) -> None:
        self.raw, self.digest, self.bar = raw, digest, bar

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.digest.update(data)
        self.bar.update(len(data))
        return data


def _hash_and_count_lines(path: Path, etag: str | None) -> tuple[str, int]:
    """sha256 of the file (checked against `etag`) and its line count after gunzip, in one pass."""
    digest = hashlib.sha256()
    lines, last, gzip_error = 0, b"\n", None
    with open(path, "rb") as raw, _bytes_bar(path.stat().st_size, f"verify {path.name}") as bar:
        is_gzip = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        reader = _HashingReader(raw, digest, bar)
        stream = gzip.GzipFile(fileobj=reader, mode="rb") if is_gzip else reader
        try:
            while chunk := stream.read(_CHUNK):
                lines += chunk.count(b"\n")
                last = chunk[-1:]
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            gzip_error = e
        while reader.read(_CHUNK):  # hash whatever decompression did not read
            pass
    sha256 = digest.hexdigest()
    # A hash mismatch says more (wrong or damaged bytes) than the gzip error it usually causes.
    _check_sha256(path.name, sha256, etag)
    if gzip_error is not None:
        raise CorpusError(f"{path.name}: corrupt gzip data ({gzip_error})")
    return sha256, lines + (last != b"\n")  # a last line without its newline still counts


def _bytes_bar(total: int, desc: str):
    return progress_bar(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)


def _read_manifest(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {"files": {}}
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable (%s); verifying everything again", path, e)
        return {"files": {}}
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        log.warning("%s: unexpected content; verifying everything again", path)
        return {"files": {}}
    return data


@contextlib.contextmanager
def _exclusive(lock_path: Path, out_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock, so two runs never download into the same folder at once."""
    with open(lock_path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CorpusError(f"{out_dir}: another download-corpus is running here") from None
        yield


def _remove_orphaned_partials(staging: Path) -> None:
    # huggingface_hub names partial files per process and deletes them on errors it sees, but a
    # killed job leaves them behind (up to tens of GB each); no later call reuses them.
    for path in (staging / ".cache" / "huggingface" / "download").rglob("*.incomplete"):
        log.warning(
            "removing a partial download left by an interrupted run: %s (%s bytes)",
            path,
            f"{path.stat().st_size:,}",
        )
        path.unlink()
