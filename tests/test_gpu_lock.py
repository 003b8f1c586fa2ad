"""The GPU environment resolves: pip's resolver runs on exactly the layers that
scripts/setup_gpu_env.sh installs (its DRY_RUN mode: `pip install --dry-run --report`, nothing but
pip itself installed), and the environment those layers add up to holds requirements/gpu.txt's
pins and meets every requirement of every package in it, except the one the override layer breaks
on purpose. Needs PyPI: skipped, with the reason, where its index does not answer within seconds.

Resolved for this machine's platform: a GPU node is Linux x86_64 CPython 3.11 like this one.
(`--platform`/`--only-binary=:all:` would model another one, but refuse deepspeed, an sdist.)
The machine's own pip configuration (local wheel folders and mirrors, a torch cap) is left out,
so the answer is PyPI's, as on a GPU node; PIP_INDEX_URL, where set, names another index."""

import json
import os
import platform
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from test_packaging import lock

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "setup_gpu_env.sh"
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
# The layers' packages (scripts/setup_gpu_env.sh's OVERRIDE) and the one requirement the final
# environment breaks on purpose: every mistral-common release vllm 0.33.0 accepts caps
# numpy<2.4, snakemake-executor-plugin-slurm 2.8.0 needs numpy>=2.4.5 (requirements/gpu.txt).
OVERRIDE = {"numpy", "snakemake-executor-plugin-slurm"}
BROKEN_ON_PURPOSE = {("mistral-common", "numpy")}
# pip configuration of this machine that a GPU node does not have
MACHINE_PIP = ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX",
               "PIP_REQUIREMENT", "PIP_REQUIRE_VIRTUALENV")


def index_unreachable():
    """None when the package index answers within 5 s, else why not."""
    try:
        with urllib.request.urlopen(f"{INDEX}/pip/", timeout=5) as r:
            r.read(1)
    except Exception as e:  # any failure: no index to resolve against
        return f"{INDEX} does not answer ({type(e).__name__}: {e})"
    return None


def packages(report):
    """{name: (version, requires_dist)} of a pip --report."""
    return {canonicalize_name(p["metadata"]["name"]):
            (p["metadata"]["version"], p["metadata"].get("requires_dist", []))
            for p in report["install"]}


def unmet(env, markers):
    """(package, dependency, requirement text, what is installed) for every requirement of every
    package in env that env does not meet, under markers and the extras that env's packages
    ask of each other (what `pip check` does, extras included)."""
    extras = {name: {""} for name in env}
    out, grew = set(), True
    while grew:
        grew = False
        for name, (_, requires) in env.items():
            for text in requires:
                req = Requirement(text)
                if req.marker and not any(req.marker.evaluate({**markers, "extra": e})
                                          for e in extras[name]):
                    continue
                dep = canonicalize_name(req.name)
                if dep not in env:
                    out.add((name, dep, text, "missing"))
                    continue
                if not req.specifier.contains(env[dep][0], prereleases=True):
                    out.add((name, dep, text, env[dep][0]))
                if not req.extras <= extras[dep]:
                    extras[dep] |= req.extras
                    grew = True
    return out


# the resolving tests share one dry run of 3-5 minutes (~300 packages' metadata, one request at a
# time; measured on 2 cores)
@pytest.fixture(scope="module")
def layers(tmp_path_factory):
    if (platform.system(), platform.machine(), sys.version_info[:2]) != ("Linux", "x86_64",
                                                                         (3, 11)):
        pytest.skip("resolves for this machine's platform, and a GPU node is Linux x86_64 "
                    "CPython 3.11")
    if reason := index_unreachable():
        pytest.skip(f"needs the package index to resolve against: {reason}")
    work = tmp_path_factory.mktemp("gpu-lock")
    env = {k: v for k, v in os.environ.items() if k not in MACHINE_PIP}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PYTHON": sys.executable,
            "DRY_RUN": str(work / "reports")}
    r = subprocess.run(["bash", str(SCRIPT), str(work / "venv")], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        out = (r.stdout + r.stderr).splitlines()
        pytest.fail(f"`DRY_RUN=... bash scripts/setup_gpu_env.sh` failed (rc {r.returncode}): "
                    f"pip's resolver does not resolve the GPU layers. Its last lines:\n"
                    + "\n".join(out[-60:]), pytrace=False)
    return {n: json.loads((work / "reports" / f"{n}.json").read_text())
            for n in ("layer1", "layer2")}


def final_env(layers):
    """What the venv holds after the layers: layer 2 (--no-deps) replaces layer 1's versions."""
    return packages(layers["layer1"]) | packages(layers["layer2"])


@pytest.mark.expensive  # a 4-minute resolver run: CI runs it as its own step (.ci/run)
def test_gpu_layers_resolve_to_the_pins(layers):
    env = final_env(layers)
    pins = {canonicalize_name(n): spec for n, spec in (lock("gpu.txt") | lock("test.txt")).items()}
    wrong = {name: (str(spec), env.get(name, ("missing",))[0]) for name, spec in pins.items()
             if name not in env or not spec.contains(env[name][0])}
    assert not wrong, f"the GPU layers do not install the locks' pins (pin, resolved): {wrong}"
    for name, version in [("torch", "2.14.0"), ("vllm", "0.33.0"), ("faiss-gpu", "1.15.1"),
                          ("transformers", "5.19.0"), ("numpy", "2.4.6")]:
        assert str(pins[name]) == f"=={version}" and env[name][0] == version, (name, env[name])
    # torch from PyPI is the CUDA build (cuda-toolkit 13.0), not a CPU wheel
    assert any(r.startswith("cuda-toolkit") for r in env["torch"][1]), env["torch"][1]


@pytest.mark.expensive
def test_override_layer_is_only_what_layer1_cannot_hold(layers):
    layer1, layer2 = packages(layers["layer1"]), packages(layers["layer2"])
    common = lock("common.txt")
    # layer 2 is exactly the override pins, as common.txt has them ...
    assert set(layer2) == OVERRIDE, sorted(layer2)
    for name in OVERRIDE:
        assert common[name].contains(layer2[name][0]), (name, layer2[name][0], common[name])
    # ... layer 1 resolved everything else (the plugin comes only from layer 2)
    assert "snakemake-executor-plugin-slurm" not in layer1
    # and the final environment meets every requirement but the one broken on purpose (layer 2's
    # --no-deps skips the plugin's other requirements: layer 1 must already hold them)
    env = final_env(layers)
    problems = unmet(env, layers["layer1"]["environment"])
    extra = {p for p in problems if p[:2] not in BROKEN_ON_PURPOSE}
    assert not extra, ("the GPU environment breaks requirements beyond mistral-common's numpy cap "
                       "(package, dependency, requirement, installed):\n"
                       + "\n".join(map(str, sorted(extra))))
    # each layer on its own is consistent: pip's resolver met every requirement in it
    assert not unmet(layer1, layers["layer1"]["environment"])


@pytest.mark.expensive
def test_final_env_meets_pyproject(layers):
    """`pip install --no-deps -e .` (layer 3) relies on the venv holding a2tgpo's requirements."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    env = final_env(layers)
    wrong = []
    for text in [*project["dependencies"], *extras["gpu"], *extras["test"]]:
        req = Requirement(text)
        version = env.get(canonicalize_name(req.name), ("missing",))[0]
        if version == "missing" or not req.specifier.contains(version):
            wrong.append((text, version))
    assert not wrong, f"pyproject.toml asks for what the GPU layers do not hold: {wrong}"


def test_unmet_follows_markers_and_extras():
    """The checker itself, on a made-up environment (no network)."""
    env = {"a": ("1.0", ["b[x]>=2", "c<1; python_version < '3'", "zz; extra == 'never'"]),
           "b": ("2.0", ["numpy<2.4; extra == 'x'", "d; extra == 'y'"]),
           "c": ("5.0", []), "numpy": ("2.4.6", [])}
    markers = {"python_version": "3.11", "sys_platform": "linux"}
    assert unmet(env, markers) == {("b", "numpy", "numpy<2.4; extra == 'x'", "2.4.6")}
    env["numpy"] = ("2.3.5", [])
    assert unmet(env, markers) == set()
    del env["b"]
    assert unmet(env, markers) == {("a", "b", "b[x]>=2", "missing")}
