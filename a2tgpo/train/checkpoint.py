"""Resumable training: atomic checkpoints, exact resume, SLURM preemption, resumable data order.

Training checkpoints are not Snakemake outputs (Snakemake deletes the outputs of failed jobs), so
a rerun finds its own progress under the run directory and continues from it:

    run_dir/checkpoints/step_000300/
        model/        HF format (config.json, model.safetensors, tokenizer files): loadable by
                      AutoModelForCausalLM / AutoTokenizer and by vLLM as it is
        state.pt      scheduler, RNG states (python, numpy, torch CPU and CUDA) and the trainer
                      state (step, data order, counters, selection metrics)
        backend/      the optimizer state, written by the training backend (every rank its
                      shard under DeepSpeed), with sha256.json, its files' hashes; only in the
                      newest `schedule.optimizer_states` checkpoints: older ones keep the
                      weights that selection needs
        meta.json     step, save time, file sizes and sha256 hashes, trainer state (readable
                      without torch; the trainer's includes the config and inputs the run
                      was trained from, a2tgpo/train/lineage.py)
        COMPLETE      written last; a directory without it is never used

A resume verifies the newest checkpoint's files against their recorded sizes and hashes
(`verify_checkpoint`): bytes damaged in place (same size) are caught, not trained on. A damaged
checkpoint is renamed `damaged_step_NNNNNN` (kept for inspection, never listed or pruned) with
a warning naming the file, and the run resumes from the previous one (`resume_checkpoint`),
which keeps its optimizer state while it is among the newest `optimizer_states`.

A checkpoint is built in a hidden temporary sibling and renamed into place only after COMPLETE
is written (`a2tgpo.io.atomic_path`), so a job killed mid-save leaves at most a hidden temporary
directory, which the next save removes. One process (rank 0) writes a run directory: pruning
deletes any temporary directory it finds, which would break a concurrent writer.

Preemption and time limits (a2tgpo/ops/preemption.py): the loop saves at a safe point and
exits with `EXIT_PREEMPTED`, and the rerun resumes from that checkpoint.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from a2tgpo.io import atomic_path, atomic_write_json

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
BACKEND_HASHES = "sha256.json"  # inside backend/
DAMAGED_PREFIX = "damaged_"
HASH_CHUNK = 4 * 2**20  # per hashing thread (sha256_files runs up to 8)
# the training backend's optimizer state (and DeepSpeed's fp32 weights) inside a checkpoint;
# only the newest checkpoint keeps it
BACKEND_DIR = "backend"
# the largest weights shard a save holds in host memory at once (`save_weights`)
SAVE_SHARD_BYTES = 2 * 2**30
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


# --------------------------------------------------------------------------------------------
# Listing


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_step(path: str | Path) -> int:
    """The step of a checkpoint directory named `step_NNNNNN`."""
    m = _STEP_DIR.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not a checkpoint directory (expected step_NNNNNN)")
    return int(m.group(1))


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete checkpoints of a run, oldest step first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if _STEP_DIR.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None for a fresh run."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


# --------------------------------------------------------------------------------------------
# RNG states


def rng_state() -> dict:
    import torch

    key = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        # as a tensor, so state.pt loads with torch.load(weights_only=True)
        "numpy": {**key, "state": {"key": torch.from_numpy(key["state"]["key"].astype(np.int64)),
                                   "pos": key["state"]["pos"]}},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    import torch

    random.setstate(state["python"])
    key = state["numpy"]
    np.random.set_state({**key, "state": {"key": key["state"]["key"].numpy().astype(np.uint32),
                                          "pos": key["state"]["pos"]}})
    torch.set_rng_state(state["torch"].cpu())
    cuda = state["cuda"]
    if not torch.cuda.is_available():
        if cuda is not None:
            log.warning("checkpoint has CUDA RNG states but no GPU is visible; not restored")
        return
    if cuda is None:
        log.warning("checkpoint was saved without a GPU; CUDA RNG states left as they are")
        return
    if len(cuda) != torch.cuda.device_count():
        log.warning("checkpoint has %d CUDA RNG states, %d devices visible; restoring the first %d",
                    len(cuda), torch.cuda.device_count(), min(len(cuda), torch.cuda.device_count()))
    for device, s in enumerate(cuda[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(s.cpu(), device)


# --------------------------------------------------------------------------------------------
# Save / load


class DamagedCheckpoint(ValueError):
    """A checkpoint's files do not match what its save recorded."""


def _file_sizes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size
            for p in sorted(root.rglob("*")) if p.is_file()}


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_files(paths) -> list[str]:
    """sha256 of each file, several files at once (hashlib releases the GIL on large buffers:
    a checkpoint's shards hash in parallel)."""
    from concurrent.futures import ThreadPoolExecutor

    paths = list(paths)
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(paths)))) as pool:
        return list(pool.map(_sha256, paths))


def _file_hashes(root: Path, names) -> dict[str, str]:
    """sha256 of each file `root/name`."""
    names = list(names)
    return dict(zip(names, sha256_files(root / n for n in names), strict=True))


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model,
    tokenizer,
    optimizer,
    scheduler=None,
    trainer_state: dict,
    keep_last: int,
    keep_steps: set[int] | frozenset[int] = frozenset(),
    extra_state=None,
    optimizer_states: int = 2,
    shard_bytes: int = SAVE_SHARD_BYTES,
) -> Path:
    """Write `run_dir/checkpoints/step_{step:06d}/` atomically, then prune old checkpoints.

    `model` is an unwrapped HF `PreTrainedModel` (not DDP/FSDP-wrapped). `trainer_state` must be
    JSON-serialisable (it is also written to meta.json, and this keeps state.pt loadable with
    `weights_only=True`). After the save, the last `keep_last` complete checkpoints, those whose
    step is in `keep_steps` (e.g. the ones checkpoint selection needs) and this one are kept;
    other checkpoints and leftovers of killed saves are deleted. Returns the checkpoint path.

    `optimizer` None: no optimizer state in state.pt (a training backend that shards it saves
    it through `extra_state(tmp_dir)`, called before the checkpoint is marked complete). Only
    the newest `optimizer_states` checkpoints keep backend/ (the optimizer state).
    The weights are written by `save_weights`, a shard of at most `shard_bytes` at a time.
    """
    import torch

    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if optimizer_states < 1:
        raise ValueError(f"optimizer_states must be >= 1, got {optimizer_states}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    # fail before writing anything rather than after the (large) model files
    json.dumps(trainer_state)

    path = checkpoints_dir(run_dir) / f"step_{step:06d}"
    started = time.time()
    with atomic_path(path, directory=True) as tmp:
        save_weights(model, tmp / "model", shard_bytes=shard_bytes)
        tokenizer.save_pretrained(tmp / "model")
        torch.save({
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rng_state(),
            "trainer_state": trainer_state,
        }, tmp / "state.pt")
        now = time.time()
        sizes = _file_sizes(tmp)
        atomic_write_json(tmp / "meta.json", {
            "step": step,
            "time": datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat(),
            "unix_time": now,
            "save_seconds": round(now - started, 3),
            "file_sizes": sizes,
            "sha256": _file_hashes(tmp, sizes),
            "trainer_state": trainer_state,
        })
        if extra_state is not None:
            extra_state(tmp)
        backend = tmp / BACKEND_DIR
        if backend.is_dir():
            files = [str(f.relative_to(backend)) for f in sorted(backend.rglob("*"))
                     if f.is_file()]
            atomic_write_json(backend / BACKEND_HASHES, {
                "file_sizes": {n: (backend / n).stat().st_size for n in files},
                "sha256": _file_hashes(backend, files)})
        (tmp / COMPLETE).write_text(f"{step}\n")
    log.info("saved checkpoint %s (%.1fs)", path, time.time() - started)
    prune_checkpoints(run_dir, keep_last=keep_last, keep_steps=set(keep_steps) | {step})
    for older in list_checkpoints(run_dir)[:-optimizer_states]:
        drop_optimizer_state(older)
    return path


def save_weights(model, directory: str | Path, *, shard_bytes: int = SAVE_SHARD_BYTES) -> None:
    """`model`'s weights in HF format (config.json, generation_config.json, safetensors
    shards with their index when there are several), loadable by `from_pretrained` and vLLM.

    Each shard's tensors are copied to host memory, written and dropped before the next: the
    save adds at most one shard (or the largest tensor) to the host, and nothing to the
    device the weights live on. `save_pretrained` on the live module would instead clone on
    that device every parameter that is a view of a shared storage, which every parameter
    is under DeepSpeed ZeRO-1/2 (one flat buffer): a second copy of the weights on GPU 0
    while the rollout engine holds the rest of it. Tied parameters (the output layer tied
    to the embedding) are written once, under the name transformers keeps.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)
    state = model.state_dict()
    # the names transformers leaves out of a save (tied to another parameter: key -> source)
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())
    seen: dict[tuple, str] = {}
    names = []
    for name, t in sorted(state.items(), key=lambda kv: kv[0] in tied):
        where = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if where not in seen:  # a tied parameter's second name holds the same tensor
            seen[where] = name
            names.append(name)
    names.sort(key=list(state).index)  # the module's order, as save_pretrained writes it
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = state[name].numel() * state[name].element_size()
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    files = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map, total = {}, 0
    for group, file in zip(groups, files, strict=True):
        shard = {n: state[n].detach().to("cpu", copy=True).contiguous() for n in group}
        save_file(shard, directory / file, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(group, file))
        del shard
    if len(files) > 1:
        atomic_write_json(directory / "model.safetensors.index.json",
                          {"metadata": {"total_size": total}, "weight_map": weight_map})


def drop_optimizer_state(path: str | Path) -> None:
    """Delete a checkpoint's backend/ (optimizer state): its weights, scheduler, RNG and trainer
    state stay, and the checkpoint stays complete (backend/ is not in meta.json's sizes)."""
    backend = Path(path) / BACKEND_DIR
    if backend.is_dir():
        # rename first, so a kill mid-delete leaves no half-deleted backend/ to resume from
        backend.rename(backend.with_name(f".{BACKEND_DIR}.{os.getpid()}.del"))
    for trash in Path(path).glob(f".{BACKEND_DIR}.*.del"):  # this one and killed deletes'
        shutil.rmtree(trash, ignore_errors=True)


def prune_checkpoints(run_dir: str | Path, *, keep_last: int,
                      keep_steps: set[int] | frozenset[int] = frozenset()) -> list[Path]:
    """Delete all but the last `keep_last` complete checkpoints and those in `keep_steps`.

    Also deletes what killed saves leave behind: hidden temporary directories and step
    directories without COMPLETE. Returns the deleted paths.
    """
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    complete = list_checkpoints(run_dir)
    keep = set(complete[-keep_last:]) | {p for p in complete if checkpoint_step(p) in keep_steps}
    doomed = [p for p in root.iterdir() if p.is_dir() and p not in keep
              and (_STEP_DIR.match(p.name) or p.name.startswith("."))]
    for p in doomed:
        # rename first: rmtree removes files in no set order and could otherwise be killed
        # while a directory still holds COMPLETE but no longer all of its model files
        trash = p if p.name.startswith(".") else p.with_name(f".{p.name}.{os.getpid()}.del")
        if trash != p:
            p.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
        log.info("pruned %s", p)
    return doomed


def _read_safetensors(model_dir: Path, device: str) -> dict:
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    weights = {}
    for shard in shards:
        weights.update(load_file(model_dir / shard, device=device))
    return weights


def _load_weights(model, model_dir: Path, map_location: str) -> None:
    """Copy the HF weights in `model_dir` into `model` in place (exact, same dtype on disk)."""
    weights = _read_safetensors(model_dir, map_location)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # save_pretrained leaves out tied parameters (lm_head tied to the embedding): a missing key
    # is fine only if its tensor is shared with one that was loaded
    params = model.state_dict(keep_vars=True)
    loaded_ptrs = {params[k].data_ptr() for k in weights if k in params}
    untied = [k for k in missing if params[k].data_ptr() not in loaded_ptrs]
    if untied or unexpected:
        raise ValueError(f"{model_dir} does not match the model: missing {untied[:5]}, "
                         f"unexpected {list(unexpected)[:5]}")


def _verify_files(root: Path, sizes: dict[str, int], hashes: dict[str, str] | None,
                  where: Path) -> None:
    for name, size in sizes.items():
        f = root / name
        if not f.is_file() or f.stat().st_size != size:
            raise DamagedCheckpoint(f"checkpoint {where} is damaged: {f.relative_to(where)} "
                                    f"missing or not {size} bytes")
    if hashes is None:  # saved before checkpoints recorded hashes: sizes only
        return
    got = _file_hashes(root, hashes)
    for name, want in hashes.items():
        if got[name] != want:
            raise DamagedCheckpoint(
                f"checkpoint {where} is damaged: {(root / name).relative_to(where)} has "
                f"sha256 {got[name][:16]}..., its save recorded {want[:16]}...")


def verify_checkpoint(path: str | Path) -> None:
    """Raise DamagedCheckpoint (naming the file) unless every file of the checkpoint has the
    size and sha256 its save recorded (meta.json; backend/sha256.json for the optimizer
    state, when the checkpoint still keeps it)."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise DamagedCheckpoint(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise DamagedCheckpoint(
            f"checkpoint {path} is damaged: meta.json unreadable ({e})") from e
    _verify_files(path, meta["file_sizes"], meta.get("sha256"), path)
    backend = path / BACKEND_DIR
    if backend.is_dir() and "sha256" in meta:
        try:
            record = json.loads((backend / BACKEND_HASHES).read_text())
        except (OSError, ValueError) as e:
            raise DamagedCheckpoint(f"checkpoint {path} is damaged: {BACKEND_DIR}/"
                                    f"{BACKEND_HASHES} unreadable ({e})") from e
        _verify_files(backend, record["file_sizes"], record["sha256"], path)


def resume_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest intact checkpoint of the run (None: a fresh run). Each newer one that fails
    `verify_checkpoint` is renamed damaged_step_NNNNNN (kept, never used) with a warning."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(ckpt)
            return ckpt
        except DamagedCheckpoint as e:
            aside = ckpt.with_name(DAMAGED_PREFIX + ckpt.name)
            shutil.rmtree(aside, ignore_errors=True)  # an older damaged copy of this step
            ckpt.rename(aside)
            log.warning("%s; moved aside to %s, resuming from the checkpoint before it", e,
                        aside)
    return None


def load_checkpoint(path: str | Path, *, model, optimizer=None, scheduler=None,
                    map_location: str = "cpu", verify: bool = True) -> dict[str, Any]:
    """Restore a checkpoint into existing objects; returns the saved trainer state.

    Weights are read from the HF files into `model` in place; optimizer and scheduler states
    (when given) and every RNG state are restored, so training continues as if uninterrupted
    (bit-identical on CPU). `verify`: check the files' sizes and hashes first (False: the
    caller has, e.g. through `resume_checkpoint`).
    """
    import torch

    path = Path(path)
    if verify:
        verify_checkpoint(path)
    elif not (path / COMPLETE).is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    _load_weights(model, path / "model", map_location)
    state = torch.load(path / "state.pt", map_location=map_location, weights_only=True)
    if optimizer is not None:
        if state["optimizer"] is None:
            raise ValueError(f"{path} holds no optimizer state (saved by a sharded backend)")
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        if state["scheduler"] is None:
            raise ValueError(f"{path} was saved without a scheduler state")
        scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    log.info("resumed from %s", path)
    return state["trainer_state"]


# --------------------------------------------------------------------------------------------
# Data order


class DataExhausted(Exception):
    """All epochs of a `DataOrder` are consumed.

    Not a StopIteration on purpose: inside a generator that would turn into a RuntimeError
    (PEP 479), and in a for loop it would end training silently instead of saying why.
    """


class DataOrder:
    """A seeded, resumable order over `n_items` items for `epochs` epochs.

    Each epoch is a permutation drawn from its own generator seeded `seed + epoch` (independent
    of the global RNGs). Batches never span two epochs: a remainder too small for the requested
    size is skipped (like `drop_last=True`), so the next batch is the next epoch's first one.
    The state is (epoch, position, batches served); a run resumed from it produces the same
    batches as one that was never interrupted, also when saved exactly at an epoch boundary.
    """

    def __init__(self, n_items: int, epochs: int, seed: int) -> None:
        if n_items < 1 or epochs < 1:
            raise ValueError(f"need n_items >= 1 and epochs >= 1, got {n_items}, {epochs}")
        self.n_items, self.epochs, self.seed = n_items, epochs, seed
        self.epoch = 0
        self.position = 0
        self.batches = 0
        self._perm: tuple[int, np.ndarray] | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng(self.seed + epoch).permutation(self.n_items))
        return self._perm[1]

    def next_batch(self, size: int) -> list[int]:
        """The next `size` item indices; raises `DataExhausted` after the last epoch."""
        if not 1 <= size <= self.n_items:
            raise ValueError(f"batch size must be in [1, {self.n_items}], got {size}")
        if self.position + size > self.n_items:
            self.epoch, self.position = self.epoch + 1, 0
        if self.epoch >= self.epochs:
            raise DataExhausted(
                f"data order exhausted after {self.batches} batches: all {self.epochs} epochs "
                f"of {self.n_items} items used ({self.n_items // size} batches of {size} per "
                f"epoch); lower total_steps or raise epochs")
        start = self.position
        self.position += size
        self.batches += 1
        return self._permutation(self.epoch)[start:self.position].tolist()

    def state_dict(self) -> dict[str, int]:
        return {"n_items": self.n_items, "epochs": self.epochs, "seed": self.seed,
                "epoch": self.epoch, "position": self.position, "batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position; the data size and seed must match the saved ones, and the
        epochs may grow (a run extended to more steps: each epoch's permutation depends on the
        seed and the epoch alone, so the earlier ones are unchanged)."""
        saved = (state["n_items"], state["epochs"], state["seed"])
        if (saved[0], saved[2]) != (self.n_items, self.seed) or saved[1] > self.epochs:
            raise ValueError(f"data order saved for (n_items, epochs, seed)={saved}, "
                             f"resumed with {(self.n_items, self.epochs, self.seed)}")
        self.epoch, self.position = state["epoch"], state["position"]
        self.batches = state["batches"]
