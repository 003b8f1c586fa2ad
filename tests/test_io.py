"""Atomic writes (a2tgpo/io.py): all or nothing, and a write the file system refuses says which
path and why. The full and read-only file systems are real (small tmpfs mounts; root only)."""

import subprocess
import uuid

import pytest
import torch

from a2tgpo.io import WriteFailed, atomic_path, atomic_write_json, atomic_write_text


@pytest.fixture
def mount(tmp_path):
    """mount(options) -> a fresh tmpfs mounted with `options` (unmounted at the end)."""
    mounted = []

    def make(options):
        where = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
        where.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"needs to mount a tmpfs (root): {r.stderr.strip()}")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_write_is_all_or_nothing(tmp_path):
    path = tmp_path / "out.json"
    atomic_write_json(path, {"a": 1})
    with pytest.raises(ZeroDivisionError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise ZeroDivisionError
    assert path.read_text().strip() == '{\n  "a": 1\n}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # no temporary left


def test_a_full_disk_names_the_path_and_says_it_is_full(mount):
    disk = mount("size=256k")
    # torch's own message on a full disk is "[enforce fail at inline_container.cc:...]"
    ckpt = disk / "checkpoints" / "step_000001" / "state.pt"
    with pytest.raises(WriteFailed) as e, atomic_path(ckpt) as tmp:
        torch.save(torch.zeros(1 << 20), tmp)  # 4 MiB into 256 KiB
    msg = str(e.value)
    assert f"cannot write {ckpt}: the file system holding {ckpt.parent} is full" in msg
    assert "free of 256.0 KiB" in msg
    assert list(ckpt.parent.iterdir()) == []  # the partial temporary is gone

    # a plain text write gets ENOSPC from the kernel: the same message
    with pytest.raises(WriteFailed, match=f"cannot write {disk / 'big.txt'}: .* is full"):
        atomic_write_text(disk / "big.txt", "x" * (1 << 20))


def test_a_read_only_disk_names_the_path_and_says_it_is_read_only(mount):
    disk = mount("ro,size=1m")
    with pytest.raises(WriteFailed, match=f"cannot write {disk / 'runs' / 'summary.json'}: the "
                       f"file system holding {disk} is mounted read-only"):
        atomic_write_json(disk / "runs" / "summary.json", {"a": 1})
