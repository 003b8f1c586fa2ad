"""A released model fetched once, on the submitting host, at a pinned revision.

    a2tgpo fetch-backbone config/backbones/qwen3-8b.yaml --out results/paper/models/qwen3-8b
    a2tgpo fetch-model intfloat/e5-base-v2 --out results/paper/models/encoder

The DAG's `fetch_backbone` rule runs this for every backbone whose `path` is a hub id, and its
`fetch_encoder` rule for a retrieval encoder given by hub id; training, evaluation and index
jobs then load `results/<study>/models/<id>` (the encoder: `models/encoder`) with
HF_HUB_OFFLINE=1. So GPU nodes need no internet, N jobs never race the hub (or its rate
limits), and every job of a study runs the same commit.

What is fetched: `huggingface_hub.snapshot_download` of `path` at `revision` (a commit pins it;
a branch or tag is resolved to its commit once, here), only the files a model is loaded from
(ALLOW: configs, tokenizer files, the chat template, safetensors weights; no .bin/.gguf/.onnx
duplicates). Files go to a hidden temporary sibling (huggingface_hub's own metadata, its
`.cache/`, stays inside it, not in $HOME), are checked (config.json, every safetensors shard of
the index, the sizes the hub listed), and the folder is renamed into place with fetch.json
written last: {repo, revision, commit, files: {name: bytes}}. A folder with a fetch.json for
the same repo and pinned commit is kept as it is.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

from a2tgpo.io import atomic_write_json
from a2tgpo.model.backbone import BackboneConfig

log = logging.getLogger(__name__)

FETCHED = "fetch.json"
ALLOW = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "tokenizer*",
         "vocab*", "merges*"]
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class FetchError(RuntimeError):
    """A backbone could not be fetched, or what came is incomplete."""


def is_hub_id(cfg: BackboneConfig) -> bool:
    """Whether the DAG fetches this backbone: released (not built) and `path` is no local
    directory."""
    return not cfg.needs_build and not Path(cfg.path).is_dir()


def encoder_is_hub_id(model: str) -> bool:
    """Whether the DAG fetches this retrieval encoder (`retrieval.encoder.model`): neither the
    offline MiniLM package nor a local directory."""
    from a2tgpo.retrieval.encoders import MINILM

    return model != MINILM and not Path(model).is_dir()


LOCAL_PREFIXES = ("/", "./", "../", "~")


def model_id_error(value: str, *, builtin: tuple[str, ...] = ()) -> str | None:
    """Why `value` (a backbone's `path`, a retrieval encoder's `model`) names no model a job
    could load (None: it does), checked without the network: a local directory with a
    config.json; a name in `builtin` (the offline MiniLM); else a hub id `owner/name` by the
    hub's own rules (huggingface_hub's validate_repo_id), with an owner: an id without one
    (`e5-base-v2` for `intfloat/e5-base-v2`) would only fail at job time, as a network error.
    A path that looks local (starts with /, ./, ../ or ~) must exist: it is never a hub id; ~
    is refused, as the loaders read it literally."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if value in builtin:
        return None
    if value.startswith("~"):
        return f"{value}: ~ is not expanded (the loaders read it literally); write the full path"
    local = Path(value)
    if local.is_dir():
        if not (local / "config.json").is_file():
            return f"local directory {value} has no config.json (not a saved model)"
        return None
    if value.startswith(LOCAL_PREFIXES):
        return f"no such local directory: {value}"
    try:
        validate_repo_id(value)
    except HFValidationError as e:
        return f"neither a local directory nor a hub id: {e}"
    if "/" not in value:
        return ("neither a local directory nor a hub id of the form owner/name (the hub's "
                "models have an owner, e.g. intfloat/e5-base-v2)")
    return None


def fetched(out: str | Path) -> dict | None:
    """The fetch.json of a fetched folder, or None."""
    path = Path(out) / FETCHED
    return json.loads(path.read_text()) if path.is_file() else None


def _check(folder: Path, repo: str, revision: str | None) -> dict[str, int]:
    """Every file's size; FetchError if the folder cannot be loaded as a model."""
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
             if p.is_file() and ".cache" not in p.relative_to(folder).parts}
    if "config.json" not in files:
        raise FetchError(f"{repo}: no config.json in the fetched files ({sorted(files)})")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        missing = sorted(shards - set(files))
        if missing:
            raise FetchError(f"{repo}: shards listed in model.safetensors.index.json were "
                             f"not fetched: {missing}")
    elif not any(f.endswith(".safetensors") for f in files):
        raise FetchError(f"{repo}: no safetensors weights at revision {revision} "
                         "(other formats are not fetched)")
    return files


def fetch_backbone(cfg: BackboneConfig, out: str | Path, *, endpoint: str | None = None
                   ) -> dict:
    """Fetch `cfg.path` at `cfg.revision` into `out` (module docstring); returns fetch.json."""
    return fetch_model(cfg.path, cfg.revision, out, name=cfg.id, endpoint=endpoint,
                       pin_hint="revision: {commit} in the backbone file")


def fetch_model(repo: str, revision: str | None, out: str | Path, *, name: str | None = None,
                endpoint: str | None = None, pin_hint: str = "revision {commit}") -> dict:
    """Fetch model repo `repo` at `revision` (None = main) into `out` (module docstring);
    returns fetch.json. `name` labels the log lines, `pin_hint` the advice for an unpinned
    revision."""
    from huggingface_hub import HfApi, snapshot_download

    out, name = Path(out), name or repo
    have = fetched(out)
    if have is not None and have["repo"] == repo and (
            revision in (have["commit"], have["revision"])):
        log.info("%s: already fetched at %s (%s)", name, have["commit"], out)
        return have
    wanted = revision or "main"
    if not _COMMIT.match(wanted):
        commit = HfApi(endpoint=endpoint).model_info(repo, revision=wanted).sha
        log.warning("%s: revision %r is not a commit: fetched its current commit %s; pin it "
                    "(%s) so reruns get the same weights", name, wanted, commit,
                    pin_hint.format(commit=commit))
    else:
        commit = wanted
    tmp = out.parent / f".{out.name}.fetching"
    shutil.rmtree(tmp, ignore_errors=True)  # a fetch killed before
    log.info("%s: fetching %s at %s into %s", name, repo, commit, out)
    snapshot_download(repo, revision=commit, local_dir=tmp, allow_patterns=ALLOW,
                      endpoint=endpoint)
    files = _check(tmp, repo, wanted)
    shutil.rmtree(tmp / ".cache", ignore_errors=True)  # huggingface_hub's download metadata
    record = {"repo": repo, "revision": wanted, "commit": commit, "files": files}
    if out.exists():  # an empty folder (Snakemake makes the output's parent) or an old fetch
        shutil.rmtree(out)
    tmp.rename(out)
    atomic_write_json(out / FETCHED, record)
    total = sum(files.values())
    log.info("%s: %d files, %.2f GB at commit %s -> %s", name, len(files), total / 1e9,
             commit, out)
    return record
