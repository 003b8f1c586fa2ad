"""What a run was started from, so that a job given a changed config trains afresh.

A training job resumes its run folder's newest checkpoint. That is right after a preemption or
a time limit (same config, same inputs) and wrong after the study config or an input changed:
Snakemake reruns the cell, and resuming would pass off the old run as the new one. So every
checkpoint records the run's identity (`run_identity`): its resolved config, and the sha256 of
the inputs that decide what is learned, the training and dev questions and the starting
policy's weights where they are local files (a hub backbone is named by its pinned revision,
which is in the config). The rule: a run resumes only where the result will be what a straight
run of the new config gives.

A job whose identity differs from its newest checkpoint's moves the old run aside (every file
but the cell's config.yaml, which is the job's input) to where `a2tgpo rerun` puts it,
<results>/archive/<cell>/<time>/, with the old config beside it, logs the keys that differ and
trains from step 0. Nothing is deleted.

Not compared (`OPERATIONAL`): keys that change where results go or how the job uses its
machine, never what it learns. `schedule.steps` may grow (`EXTENDABLE`): training longer
resumes. The corpus and index are compared by their paths only (hashing
the 21M-passage corpus at every start would cost minutes).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from a2tgpo.config import dump_yaml, to_dict
from a2tgpo.train.checkpoint import sha256_files

log = logging.getLogger(__name__)

# dotted config keys that may differ between a checkpoint and the job resuming it
OPERATIONAL = frozenset({
    "run_dir", "results_dir", "study", "tracking", "stop_margin_s", "schedule.keep_last",
    "schedule.optimizer_states", "engine_memory_share", "engine_kv_cache_gb", "engine_sleep",
    "weight_sync", "offload_optimizer",
    # the stock path gives the fast path's ids and log-probs, and a transformers upgrade
    # switches it without any config change (model/fast_decode.py)
    "backbone.fast_path",
})
# keys that may grow: a run extended to more steps goes on from where it stopped (the data
# order's epochs are seeded one by one and the learning rate is constant after warm-up, so its
# first steps are those of the shorter run)
EXTENDABLE = frozenset({"schedule.steps"})
WEIGHT_SUFFIXES = (".safetensors", ".bin")
KEY = "identity"  # the trainer state's key (checkpoint meta.json and state.pt)


def run_identity(cfg) -> dict:
    """{"config": the resolved TrainConfig as a dict, "inputs": {name: sha256}}."""
    files = {"train_file": Path(cfg.train_file), "dev_file": Path(cfg.dev_file)}
    policy = Path(cfg.backbone.path)
    if policy.is_dir():
        files.update({f"backbone/{f.name}": f for f in sorted(policy.iterdir())
                      if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES)})
    started = time.perf_counter()
    hashes = sha256_files(files.values())  # 16 GB of weights: ~10-20 s (est., 1-2 GB/s)
    log.info("hashed the run's %d input files in %.1f s", len(files),
             time.perf_counter() - started)
    # through JSON, as a checkpoint stores it (tuples become lists)
    return {"config": json.loads(json.dumps(to_dict(cfg))),
            "inputs": dict(zip(files, hashes, strict=True))}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def identity_changes(saved: dict, now: dict) -> list[str]:
    """"key: old -> new" for every compared config key and input that differs (sorted)."""
    changes = []
    old_cfg, new_cfg = _flatten(saved["config"]), _flatten(now["config"])
    for key in sorted(old_cfg.keys() | new_cfg.keys()):
        if key in OPERATIONAL or key.split(".")[0] in OPERATIONAL:
            continue
        a, b = old_cfg.get(key, _ABSENT), new_cfg.get(key, _ABSENT)
        if key in EXTENDABLE and a is not _ABSENT and b is not _ABSENT and b >= a:
            continue
        if a != b:
            changes.append(f"{key}: {_short(a)} -> {_short(b)}")
    old_in, new_in = saved["inputs"], now["inputs"]
    for name in sorted(old_in.keys() | new_in.keys()):
        a, b = old_in.get(name, "<absent>"), new_in.get(name, "<absent>")
        if a != b:
            changes.append(f"input {name}: sha256 {a[:12]} -> {b[:12]}")
    return changes


_ABSENT = object()  # a key one of the two configs does not have


def _short(value, limit: int = 60) -> str:
    if value is _ABSENT:
        return "<absent>"
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def archive_superseded(run_dir: Path, archive: Path, saved: dict, changes: list[str]) -> Path:
    """Move every entry of `run_dir` but config.yaml to `archive`, and write the old run's
    config (config.yaml) and the reasons (superseded.json) there. Returns `archive`."""
    archive.mkdir(parents=True, exist_ok=False)
    for entry in sorted(run_dir.iterdir()):
        if entry.name != "config.yaml":
            shutil.move(str(entry), str(archive / entry.name))
    (archive / "config.yaml").write_text(dump_yaml(saved["config"]))
    (archive / "superseded.json").write_text(json.dumps({"changes": changes}, indent=1) + "\n")
    return archive
