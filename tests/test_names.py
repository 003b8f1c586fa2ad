"""Names the study config turns into paths and shell words, and the folders it writes into, are
refused at load when they are not safe: each refusal names the file and the key."""

from pathlib import Path

import pytest

from a2tgpo.config import ConfigError
from a2tgpo.study import load_study

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config/config.yaml"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # backbone and method files are resolved relative to the repo root


def refusal(overrides) -> str:
    """The ConfigError text, after the lead that names the file and the overrides."""
    with pytest.raises(ConfigError) as e:
        load_study(CONFIG, overrides)
    lead = f"{CONFIG} (with overrides {' '.join(overrides)}): "
    assert str(e.value).startswith(lead), str(e.value)
    return str(e.value)[len(lead):]


@pytest.mark.parametrize("name", [
    "x$(touch PWNED)y",  # a command substitution in every shell command of the DAG
    "toy study",  # a space splits those commands
    "..", ".",  # results/.. is the repository root: every output would land there
    "/tmp/elsewhere", "a/b",  # absolute, or a separator: outside <results_dir>/
    "Toy", "1toy", "",
])
def test_unsafe_study_names_are_refused_naming_the_key(tmp_path, name):
    override = f"study={name!r}"  # quoted as YAML, so '' stays an empty string
    assert refusal([override]).startswith(
        f"study: {name!r}: use lowercase letters, digits and _, starting with a letter")
    assert not (ROOT / "PWNED").exists() and not Path("PWNED").exists()


@pytest.mark.parametrize("override, key", [
    # each of these becomes a folder: tables/<set>, data/<track>, runs/.../regime~<r>
    ("grid.sets={'..': {methods: [grpo]}, main: {methods: [grpo]}}", "grid.sets..."),
    ("tracks={'a b': {train: [toy_hotpotqa], test: [toy_hotpotqa]}}", "tracks.a b"),
    ("train.regimes={'x/..': []}", "train.regimes.x/.."),
])
def test_unsafe_set_track_and_regime_names_are_refused(override, key):
    assert refusal([override]).startswith(f"{key}: ")
    assert "use lowercase letters, digits and _, starting with a letter" in refusal([override])


@pytest.mark.parametrize("backbone", ["../backbones/toy_reader", "..", "/abs/toy"])
def test_a_backbone_id_is_one_file_name(backbone):
    # <backbones_dir>/<id>.yaml and <study>/models/<id>: a path would reach outside both
    assert refusal([f"backbones=[{backbone!r}]"]).startswith(
        f"backbones[0]: {backbone!r}: use letters, digits, '.', '_' and '-', starting with a "
        "letter or digit (one file or folder name: no path)")


@pytest.mark.parametrize("override, key", [
    (("world.qa_sets=[{name: '../q', group: single_hop, splits: {train: 3}, "
      "mix: {single: 1.0}}]"), "world.qa_sets[0].name"),  # <study>/world/qa/<name>/
    ("corpus.download.filename=/etc/x", "corpus.download.filename"),  # <study>/corpus/<file>
    ("corpus.download.index.combined_name=../e5.index", "corpus.download.index.combined_name"),
    ("corpus.download.index.parts=[part_aa, ../part_ab]", "corpus.download.index.parts[1]"),
])
def test_file_names_that_are_paths_are_refused(override, key):
    assert refusal([override]).startswith(f"{key}: ")
    assert "(one file or folder name: no path)" in refusal([override])


def test_a_sweep_name_is_a_name(tmp_path):
    import yaml

    from a2tgpo.config import load_config
    from a2tgpo.sweep import SweepConfig

    sweep = yaml.safe_load((ROOT / "config/sweeps/toy.yaml").read_text())
    path = tmp_path / "s.yaml"
    for name in ("..", "a b", "x$(id)"):  # <study>/sweeps/<name>/ and the target sweep_<name>
        path.write_text(yaml.safe_dump({**sweep, "name": name}))
        with pytest.raises(ConfigError) as e:
            load_config(SweepConfig, path)
        assert str(e.value).startswith(f"{path}: name: {name!r}: use lowercase letters, digits")


def test_output_folders_that_exist_as_files_are_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert refusal([f"results_dir={afile}"]) == \
        f"results_dir: {afile} exists and is not a folder"
    # a folder under a file cannot be made either: the file is named
    assert refusal([f"results_dir={afile}/results"]) == \
        f"results_dir: {afile} exists and is not a folder"
    assert refusal([f"cache_dir={afile}/cache"]) == f"cache_dir: {afile} exists and is not a folder"
    # <results_dir>/<study> itself
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "toy").write_text("")
    assert refusal([f"results_dir={tmp_path / 'res'}"]) == (
        f"study: {tmp_path / 'res' / 'toy'} exists and is not a folder (<results_dir>/<study>)")


def test_names_and_folders_that_are_fine(tmp_path):
    from a2tgpo.config import name_error

    assert name_error("toy_2") is None and name_error("paper") is None
    # a cache folder that does not exist yet, under one that does
    study = load_study(CONFIG, [f"cache_dir={tmp_path / 'not' / 'yet'}"])
    assert study.cache_dir == str(tmp_path / "not" / "yet")
