"""One place per setting: every documented config key is read by the code, a cell config sets
each setting once, and the limits that two sections must agree on are checked at load."""

from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

import pytest
import yaml

from a2tgpo.config import ConfigError, describe
from a2tgpo.study import load_study, resolve_cell, study_cells
from a2tgpo.study_checks import check_study

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "config/config.yaml"
PAPER = ROOT / "config/paper.yaml"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # backbone files are resolved relative to the repo root


# --------------------------------------------------------------------------------------------
# every documented key is read


# keys no code reads on purpose: what they say changes nothing a job does
DESCRIPTIVE = {
    "MethodConfig.paper": "a citation printed in the generated method file",
}


def _declared(root: Path, files: list[Path]) -> list[tuple[str, str, str]]:
    """(file, class, key) of every config key: `name: T = option(...)` in a class body."""
    out = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                out += [(str(f.relative_to(root)), node.name, st.target.id) for st in node.body
                        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
                        and isinstance(st.value, ast.Call)
                        and getattr(st.value.func, "id", None) == "option"]
    return out


def _reads(files: list[Path], workflow: list[Path]) -> collections.Counter:
    """How often each name is read: `x.name` and `getattr(x, "name")` in the package, outside
    the `__post_init__` of a config (a check of a value is no use of it); `.name` in the
    workflow's rules; a string "name" passed to a call or listed in a comparison (a section
    read by name: `section(study, "report")`, the rules' configs/<name>.yaml)."""
    reads: collections.Counter = collections.Counter()
    for f in files:
        tree = ast.parse(f.read_text())
        skip = {id(n) for fn in ast.walk(tree)
                if isinstance(fn, ast.FunctionDef) and fn.name == "__post_init__"
                for n in ast.walk(fn)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Attribute):
                reads[node.attr] += 1
            elif isinstance(node, ast.Call):
                reads.update(a.value for a in node.args
                             if isinstance(a, ast.Constant) and isinstance(a.value, str))
    for f in workflow:
        text = f.read_text()
        reads.update(re.findall(r"\.([A-Za-z_]\w*)", text))
        reads.update(re.findall(r"configs/([a-z_]+)\.yaml", text))
    return reads


def unread_keys(root: Path = ROOT) -> list[str]:
    files = sorted((root / "a2tgpo").rglob("*.py"))
    workflow = [root / "Snakefile", *sorted((root / "workflow").rglob("*.smk"))]
    reads = _reads(files, workflow)
    return [f"{f}: {cls}.{key}" for f, cls, key in _declared(root, files)
            if not reads[key] and f"{cls}.{key}" not in DESCRIPTIVE]


def test_every_documented_config_key_is_read_by_the_code():
    # a key that nothing reads does nothing, whatever its doc says it does
    assert unread_keys() == []


def test_the_guard_finds_a_key_nothing_reads(tmp_path):
    # the same walk over a copy of the package with one more documented key, read nowhere
    import shutil

    for part in ("a2tgpo", "workflow"):
        shutil.copytree(ROOT / part, tmp_path / part,
                        ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    shutil.copy(ROOT / "Snakefile", tmp_path / "Snakefile")
    agent = tmp_path / "a2tgpo/rollout/agent.py"
    text = agent.read_text()
    anchor = "    max_tool_calls: int = option("
    assert anchor in text
    agent.write_text(text.replace(anchor, "    zz_passages_shown: int = option(3, \"Passages "
                                  "per search.\", ge=1)\n" + anchor, 1))
    assert unread_keys(tmp_path) == ["a2tgpo/rollout/agent.py: AgentConfig.zz_passages_shown"]


# --------------------------------------------------------------------------------------------
# a setting is set in one place


# leaf names that two sections use for two settings (not one setting set twice)
DISTINCT = {
    "backbones": "the grid's backbones / the rows the report shows",
    "batch_size": "the copy pretraining's, the encoder's and the warm start's batches",
    "datasets": "the warm start's demonstration files / the report's columns",
    "device": "the policy's device / the encoder's",
    "dtype": "the policy's weights / the encoder's",
    "engine_memory_share": "the training job's engine (beside the trainer) / the evaluation's",
    "expected_bytes": "the corpus file / the index file",
    "grad_clip": "the warm start's optimiser / RL's",
    "id": "the backbone's id / the method's",
    "log_every": "the warm start's progress bar / the tracker's flushes",
    "lr": "the copy pretraining's, the warm start's and RL's optimisers",
    "max_batch": "the retrieval server's batch / the evaluation engine's",
    "max_length": "the copy pretraining's sequences / the encoder's texts",
    "mem_mb": "the training job's memory / the evaluation job's",
    "repo_id": "the corpus repository / the index repository",
    "revision": "one hub revision per model or dataset",
    "runtime_min": "the training job's wall time / the evaluation job's",
    "seed": "one seed per random stage (world, toy backbone, copy, data split, warm start)",
    "steps": "the copy pretraining's steps / RL's",
    "threads": "the training job's threads / the evaluation job's",
    "timeout_s": "the retrieval client's requests / the tracking server's",
    "warmup_steps": "the copy pretraining's warm-up / RL's",
    "weight_decay": "the warm start's optimiser / RL's",
}


def shared_leaf_names(cls, skip: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Leaf key names that more than one dotted key of `cls` ends in."""
    by_name = collections.defaultdict(list)
    for key, _, default, _ in describe(cls):
        if default != "(section, below)" and not key.startswith(skip):
            by_name[key.rsplit(".", 1)[-1]].append(key)
    return {n: keys for n, keys in by_name.items() if len(keys) > 1}


def test_a_cell_config_and_a_study_set_each_setting_in_one_place():
    from a2tgpo.study import StudyConfig
    from a2tgpo.train.config import TrainConfig

    # toy_reader configures a separate build (its own worlds, backbone and warm start)
    for cls, skip in ((TrainConfig, ()), (StudyConfig, ("toy_reader.",))):
        twice = {n: keys for n, keys in shared_leaf_names(cls, skip).items()
                 if n not in DISTINCT}
        assert twice == {}, f"{cls.__name__}: one setting under two keys"


def test_passages_per_search_and_their_length_are_the_retrieval_sections():
    from a2tgpo.retrieval.base import Hit
    from a2tgpo.train.episodes import search_tool

    class Recording:
        def __init__(self):
            self.topk = []

        def search(self, queries, topk):
            self.topk.append(topk)
            return [[Hit(str(i), f"Title {i}\n" + "word " * 50, 1.0) for i in range(topk)]
                    for _ in queries]

    class Tok:  # one id per character: the observation's text is read back exactly
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    study = load_study(TOY, ["retrieval.topk=5", "retrieval.max_passage_chars=20"])
    cell = study_cells(study)["main"][0]
    cfg = resolve_cell(study, cell.path)
    retriever = Recording()
    (obs,) = search_tool(cfg, retriever, Tok()).observe(["q"])
    text = "".join(map(chr, obs))
    assert retriever.topk == [5]
    # 5 pages of the first 20 characters of each passage ("Title i\n" + 12 of the words)
    pages = re.findall(r"Page (\d): (.*?)(?=\nPage|\n</result>)", text, re.DOTALL)
    assert [int(n) for n, _ in pages] == [1, 2, 3, 4, 5]
    assert all(len(p) == 20 for _, p in pages)


def test_the_warm_start_searches_with_the_studys_retrieval_section(tmp_path, monkeypatch):
    # rule sft passes the study's retrieval section: its demonstrations show what RL shows
    from a2tgpo import cli
    from a2tgpo.config import dump_config
    from a2tgpo.train import sft

    seen = {}
    monkeypatch.setattr(sft, "main", lambda *a, **kw: seen.update(kw) or 0)
    section = tmp_path / "retrieval.yaml"
    dump_config(load_study(TOY, ["retrieval.topk=5"]).retrieval, section)
    assert cli.main(["sft", "sft.yaml", "--backbone", "b", "--world", "w", "--corpus", "c",
                     "--index", "i", "--out", "o", "--retrieval", str(section)]) == 0
    assert seen["retrieval"].topk == 5


@pytest.mark.parametrize("override, key, owner", [
    ("train.rollout.topk=5", r"train\.rollout\.topk", r"retrieval\.topk"),
    ("train.rollout.max_passage_chars=500", r"train\.rollout\.max_passage_chars",
     r"retrieval\.max_passage_chars"),
])
def test_a_rollout_topk_is_refused_pointing_at_the_retrieval_key(override, key, owner):
    with pytest.raises(ConfigError, match=rf"config\.yaml .*: {key}: unknown key \(set it as "
                                          rf"{owner}\)"):
        load_study(TOY, [override])


def test_a_cell_may_change_its_topk_through_the_overrides():
    # a regime's or an override's retrieval.topk reaches its cells' search (and their server)
    study = load_study(TOY, ["train.overrides=[retrieval.topk=4]"])
    cfg = resolve_cell(study, study_cells(study)["main"][0].path)
    assert cfg.retrieval.topk == 4


# --------------------------------------------------------------------------------------------
# limits two sections must agree on


def test_a_topk_over_the_servers_max_topk_is_refused_at_load(capsys):
    from a2tgpo import cli

    # the paper study's jobs search their own server (retrieval.http.serve: job), which
    # answers 422 to a topk over retrieval.http.max_topk (100)
    with pytest.raises(ConfigError, match=r"^.*paper\.yaml .*: retrieval: topk 101 is over "
                                          r"http\.max_topk 100"):
        load_study(PAPER, ["retrieval.topk=101"])
    assert load_study(PAPER, ["retrieval.topk=100"]).retrieval.topk == 100
    # in-process search has no server to refuse it
    assert load_study(TOY, ["retrieval.topk=101"]).retrieval.topk == 101
    # one cell's override is checked at load too, with the study file named
    assert cli.main(["check-config", str(PAPER), "train.overrides=[retrieval.topk=101]"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"paper\.yaml: cell backbone~\S+ \(after study overrides\): "
                     r"retrieval: topk 101 is over http\.max_topk 100", err), err


def test_the_rollout_budget_must_leave_room_for_a_prompt_in_max_model_len():
    # the toy reader's context is 2048 tokens: a response budget of 2048 leaves no prompt
    study = load_study(TOY, ["train.rollout.max_response_tokens=2048"])
    with pytest.raises(ConfigError, match=r"^cfg: cell backbone~toy_reader/\S+ \(after study "
                                          r"overrides\): <root>: rollout\.max_response_tokens "
                                          r"\(2048\) leaves no room for a prompt in "
                                          r"backbone\.max_model_len \(2048\)"):
        check_study(study, "cfg", plan=False)
    check_study(load_study(TOY, ["train.rollout.max_response_tokens=2047"]), "cfg", plan=False)


def _backbone_dir(tmp_path, name, **changes):
    spec = yaml.safe_load((ROOT / f"config/backbones/{name}.yaml").read_text())
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({**spec, **changes}))
    return tmp_path


def test_a_built_backbones_max_model_len_must_fit_the_model_it_builds(tmp_path):
    # config/backbones/toy.yaml is built with toy_backbone.max_position_embeddings (2048)
    d = _backbone_dir(tmp_path, "toy", max_model_len=4096)
    study = load_study(TOY, [f"backbones_dir={d}", "backbones=[toy]", "sweeps=[]"])
    with pytest.raises(ConfigError, match=rf"^cfg: backbones\[0\]: {d}/toy\.yaml: "
                                          r"max_model_len: 4096 is over the model's context of "
                                          r"2048 tokens \(toy_backbone\.max_position_embeddings\)"):
        check_study(study, "cfg", plan=False)
    check_study(load_study(TOY, [f"backbones_dir={d}", "backbones=[toy]", "sweeps=[]",
                                 "toy_backbone.max_position_embeddings=4096"]), "cfg", plan=False)


def test_a_released_backbones_max_model_len_must_fit_its_config_json(tmp_path):
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(ROOT / "assets/toy-reader", model)
    d = _backbone_dir(tmp_path, "toy_reader", path=str(model), max_model_len=4096)
    study = load_study(TOY, [f"backbones_dir={d}"])
    with pytest.raises(ConfigError, match=rf"^cfg: backbones\[0\]: {d}/toy_reader\.yaml: "
                                          r"max_model_len: 4096 is over the model's context of "
                                          rf"2048 tokens \(max_position_embeddings in the "
                                          rf"config\.json of {model}\)"):
        check_study(study, "cfg", plan=False)
    # a RoPE-scaled model's length is the engine's to work out
    cfg = json.loads((model / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                              "original_max_position_embeddings": 2048}
    (model / "config.json").write_text(json.dumps(cfg))
    check_study(study, "cfg", plan=False)


def test_the_hf_engine_gets_the_backbones_max_model_len():
    from a2tgpo.train.episodes import make_engine

    class Model:  # what HfEngine reads of a model before it samples
        generation_config = type("G", (), {"eos_token_id": 0})()

        def parameters(self):
            import torch

            yield torch.zeros(1)

    class Tok:
        eos_token_id, pad_token_id = 0, 0

    study = load_study(TOY)
    cfg = resolve_cell(study, study_cells(study)["main"][0].path)
    assert cfg.engine == "hf"
    engine = make_engine(cfg, Model(), Tok())
    assert engine.max_model_len == cfg.backbone.max_model_len == 2048

