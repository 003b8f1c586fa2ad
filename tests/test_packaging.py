"""pyproject.toml and the requirements locks name the same versions."""

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def lock(name):
    out = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            out |= lock(line[3:])
        elif line:
            req = Requirement(line)
            out[req.name.lower()] = req.specifier
    return out


def test_pyproject_agrees_with_locks():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    cpu, gpu = lock("cpu.txt"), lock("gpu.txt")
    for spec in project["dependencies"]:
        req = Requirement(spec)
        name = req.name.lower()
        assert not name.startswith("faiss"), "faiss belongs in the cpu or gpu extra"
        # every exact lock version (CPU and, where pinned, GPU) satisfies pyproject's specifier
        for env in (cpu, gpu):
            if name in env:
                (version,) = [s.version for s in env[name]]
                assert req.specifier.contains(version), (name, version, str(req.specifier))
        assert name in cpu, f"{name} is missing from requirements/cpu.txt"
    extras = project["optional-dependencies"]
    for spec in extras["gpu"]:
        req = Requirement(spec)
        assert gpu[req.name.lower()] == req.specifier
    for spec in extras["cpu"]:
        req = Requirement(spec)
        assert cpu[req.name.lower()] == req.specifier
    test = lock("test.txt")
    for spec in extras["test"]:
        req = Requirement(spec)
        assert test[req.name.lower()] == req.specifier
    # torch differs on purpose: the CPU wheel here, the CUDA build vllm needs on GPU nodes
    assert str(cpu["torch"]) == "==2.13.0" and str(gpu["torch"]) == "==2.14.0"
