"""The study config: config/config.yaml validates; errors name the key; schema is generated."""

import re
from pathlib import Path

import pytest
import yaml

from a2tgpo.config import ConfigError, load_config
from a2tgpo.data.world import WorldConfig
from a2tgpo.study import load_study, study_schema, write_section

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # backbone files are resolved relative to the repo root


def test_default_config_is_valid():
    study = load_study(ROOT / "config/config.yaml")
    assert study.study == "toy"
    assert study.backbone("toy").needs_build


@pytest.mark.parametrize("name", ["config", "paper", "rehearsal"])
def test_every_cell_of_every_grid_set_resolves(name):
    # a cell whose overrides contradict each other (a tree shape whose leaves are not
    # rollout.n) must fail here, as the DAG fails before any job, not at its first rollout
    from a2tgpo.study import resolve_cell, study_cells

    study = load_study(ROOT / f"config/{name}.yaml")
    cells = {c.path for set_cells in study_cells(study).values() for c in set_cells}
    assert cells
    for path in sorted(cells):
        cfg = resolve_cell(study, path)
        assert cfg.cell == path


def test_committed_schema_is_the_generated_one():
    # Snakemake validates with the committed file; it must not drift from the dataclasses
    committed = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
    assert committed == yaml.safe_load(yaml.safe_dump(study_schema()))


def test_study_errors(tmp_path):
    cfg = ROOT / "config/config.yaml"
    with pytest.raises(ConfigError, match=r"world\.peeple: unknown key \(did you mean 'people'"):
        load_study(cfg, ["world.peeple=3"])
    with pytest.raises(ConfigError, match=r"backbones\[0\]: no backbone file"):
        load_study(cfg, ["backbones=[nope]"])
    data = yaml.safe_load(cfg.read_text())
    del data["data"]
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=rf"{p}: data: missing required key"):
        load_study(p)


def test_write_section_round_trips(tmp_path):
    out = tmp_path / "world.yaml"
    write_section(ROOT / "config/config.yaml", ["world.seed=5"], "world", out)
    world = load_config(WorldConfig, out)
    assert world.seed == 5 and world == load_study(ROOT / "config/config.yaml",
                                                   ["world.seed=5"]).world


def test_eval_section_defaults_and_paper_values():
    from a2tgpo.study import EvalSection

    assert load_study(ROOT / "config/config.yaml").eval == EvalSection()  # the toy: defaults
    written = yaml.safe_load((ROOT / "config/paper.yaml").read_text())["eval"]
    paper = load_study(ROOT / "config/paper.yaml")
    assert {k: getattr(paper.eval, k) for k in written} == written
    assert paper.eval.engine_memory_share != paper.train.engine_memory_share


@pytest.mark.parametrize("override, message", [
    ("eval.gpus=-1", r"eval\.gpus: -1 is out of range: must be >= 0$"),
    ("eval.threads=0", r"eval\.threads: 0 is out of range: must be >= 1$"),
    ("eval.mem_mb=0", r"eval\.mem_mb: 0 is out of range: must be >= 1$"),
    ("eval.runtime_min=0", r"eval\.runtime_min: 0 is out of range: must be >= 1$"),
    ("eval.runtime_all_min=0", r"eval\.runtime_all_min: 0 is out of range: must be >= 1$"),
    ("eval.chunk=0", r"eval\.chunk: 0 is out of range: must be >= 1$"),
    ("eval.max_batch=0", r"eval\.max_batch: 0 is out of range: must be >= 1$"),
    ("eval.engine_memory_share=0",
     r"eval\.engine_memory_share: 0\.0 is out of range: must be > 0 and <= 1$"),
    ("eval.engine_memory_share=1.5",
     r"eval\.engine_memory_share: 1\.5 is out of range: must be > 0 and <= 1$"),
    ("eval.mem_mb=lots", r"eval\.mem_mb: expected int or null, got 'lots'"),
    ("eval.gpu=2", r"eval\.gpu: unknown key \(did you mean 'gpus'"),
])
def test_eval_section_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_study(ROOT / "config/config.yaml", [override])


def test_eval_gpus_must_fit_the_one_engine_of_an_evaluation_job():
    paper = ROOT / "config/paper.yaml"
    # vLLM, tensor parallel over train.rollout_tp GPUs: fewer fail at start-up, more sit idle
    for rollout_tp, gpus in ((2, 1), (1, 2)):
        with pytest.raises(ConfigError, match=rf"eval\.gpus: {gpus}, but an evaluation job "
                           rf"runs one vllm engine on {rollout_tp} GPU"):
            load_study(paper, [f"train.rollout_tp={rollout_tp}", f"eval.gpus={gpus}"])
    assert load_study(paper, ["train.rollout_tp=2", "eval.gpus=2"]).eval.gpus == 2
    assert load_study(paper, ["eval.gpus=0"]).eval.gpus == 0  # a CPU job
    # the hf engine runs on one device; a CPU study requests no GPU whatever eval.gpus says
    with pytest.raises(ConfigError, match=r"eval\.gpus: 2, but .* one hf engine on 1 GPU"):
        load_study(paper, ["train.engine=hf", "eval.gpus=2"])
    assert load_study(ROOT / "config/config.yaml", ["eval.gpus=4"]).eval.gpus == 4


@pytest.mark.parametrize("override, message", [
    # each once passed check-config and failed late (a ZeroDivisionError after step 1, a
    # pruning error, β < 0 trained as β = 0, an override pattern silently ignored)
    ("train.schedule.save_every=0",
     r"train\.schedule\.save_every: 0 is out of range: must be >= 1"),
    ("train.schedule.keep_last=0", r"train\.schedule\.keep_last: 0 is out of range"),
    ("grid.sets.beta.betas=[0.3, -0.1]",
     r"grid\.sets\.beta\.betas\[1\]: -0\.1 is out of range: must be >= 0"),
    ("train.method_overrides={a2tgop: [method.rollout.n=4]}",
     (r"config/config\.yaml: train\.method_overrides\.a2tgop: matches no method id "
      r"\(.*\) \(did you mean 'a2tgpo'\?\)")),
])
def test_check_config_refuses_bad_settings_before_any_job(override, message, capsys):
    from a2tgpo import cli

    assert cli.main(["check-config", "config/config.yaml", override]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_check_config_accepts_a_method_override_pattern_that_matches(capsys):
    from a2tgpo import cli

    assert cli.main(["check-config", "config/config.yaml",
                     # tree_grpo's own M·K = 6 leaves: the toy's rollout.n=8 would not fit
                     ("train.method_overrides={at2po*: [method.rollout.n=4], "
                      "tree_grpo: [method.rollout.n=6]}")]) == 0
    assert "config/config.yaml: valid" in capsys.readouterr().out


@pytest.mark.parametrize("override, message", [
    # each passed check-config and failed in a late job: after encoding (a factory faiss
    # cannot parse, or one whose PQ needs a width divisible by 7: MiniLM's 384 is not), or at
    # its first download (an encoder id without its owner reads as a network error)
    ("retrieval.index.factory=Flatt",
     (r"retrieval\.index\.factory: faiss\.index_factory\(384, 'Flatt', inner product\) "
     r"fails: could not parse index string Flatt")),
    ("retrieval.index.factory=IVF16,PQ7",
     (r"retrieval\.index\.factory: faiss\.index_factory\(384, 'IVF16,PQ7', inner product\) "
     r"fails: .*d % M == 0")),
    ("retrieval.index.factory=IVF99999999,Flat",
     r"retrieval\.index\.factory: 99,999,999 is above 4,194,304"),
    ("retrieval.encoder.model=e5-base-v2",
     (r"retrieval\.encoder\.model: neither a local directory nor a hub id of the form "
     r"owner/name")),
    ("retrieval.encoder.model=./models/e5", (r"retrieval\.encoder\.model: no such local "
                                            r"directory: \./models/e5$")),
    ("retrieval.encoder.model=intfloat/e5 base",
     r"retrieval\.encoder\.model: neither a local directory nor a hub id: Repo id must use"),
    ("retrieval.encoder.model=config", (r"retrieval\.encoder\.model: local directory config "
                                       r"has no config\.json")),
    # an index file that is not there and that no rule writes: the first retrieval job fails
    ("retrieval.index.prebuilt=/nonexistent/x.index",
     (r"retrieval\.index\.prebuilt: no such file: /nonexistent/x\.index \(nor the index the "
      r"corpus download writes: corpus\.download\.index\.enabled is false\)")),
    # the tables job would leave a row, a curve or a whole table empty
    ("report.methods=[grpo, nosuch]", r"report\.methods: 'nosuch' is no method id$"),
    ("report.jaccard_method=a2tgp",
     r"report\.jaccard_method: 'a2tgp' is no method id \(did you mean 'a2tgpo'\?\)"),
    ("report.paired=[[a2tgpo, igpo], [grpo, grpoo]]",
     r"report\.paired\[1\]: 'grpoo' is no method id \(did you mean 'grpo'\?\)"),
    # the toy grid runs a2tgpo at the betas of its main (0.3) and beta (0-0.5 by 0.1) sets
    ("report.beta_main=0.77", (r"report\.beta_main: 0\.77 is not a β the grid runs a2tgpo at "
                               r"\(0, 0\.1, 0\.2, 0\.3, 0\.4, 0\.5\)")),
])
def test_check_config_refuses_what_a_late_job_would_find(override, message, capsys):
    from a2tgpo import cli

    assert cli.main(["check-config", "config/config.yaml", override]) == 2
    err = capsys.readouterr().err
    assert re.search(r"config error: config/config\.yaml: " + message, err), err


def test_check_config_accepts_factories_and_encoders_that_build(capsys):
    from a2tgpo import cli

    # IVF16,PQ8: 384 = 8 x 48; a bm25 study reads neither key; a prebuilt index is not built
    for overrides in (["retrieval.index.factory=IVF16,PQ8"], ["retrieval.index.factory=HNSW32"],
                      ["retrieval.retriever=bm25", "retrieval.encoder.model=e5-base-v2"],
                      ["retrieval.index.prebuilt=config/config.yaml",
                       "retrieval.index.factory=Flatt"]):
        assert cli.main(["check-config", "config/config.yaml", *overrides]) == 0, \
            capsys.readouterr().err


@pytest.mark.parametrize("path, message", [
    ("Qwen3-4B", "neither a local directory nor a hub id of the form owner/name"),
    ("./models/qwen3-4b", r"no such local directory: \./models/qwen3-4b$"),
    ("~/models/qwen3-4b", "~/models/qwen3-4b: ~ is not expanded"),
    ("Qwen//Qwen3-4B", "neither a local directory nor a hub id"),
])
def test_check_config_refuses_a_backbone_path_no_job_could_load(tmp_path, path, message):
    from a2tgpo.study_checks import check_study

    spec = yaml.safe_load((ROOT / "config/backbones/toy_reader.yaml").read_text())
    (tmp_path / "toy_reader.yaml").write_text(yaml.safe_dump({**spec, "path": path}))
    study = load_study(ROOT / "config/config.yaml", [f"backbones_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=rf"^cfg: backbones\[0\]: {tmp_path}/toy_reader\.yaml: "
                                          rf"path: {message}"):
        check_study(study, "cfg", plan=False)


def test_check_config_refuses_a_dev_size_that_leaves_a_track_nothing_to_train_on(tmp_path,
                                                                                 capsys):
    from a2tgpo import cli

    for subset, n in (("nq", 6), ("hotpotqa", 4)):
        (tmp_path / subset).mkdir()
        (tmp_path / subset / "train.jsonl").write_text("".join(
            f'{{"id": "{i}", "question": "q{i}", "golden_answers": ["a"]}}\n' for i in range(n)))
    train = (f"data.train=[{{name: toy_nq, loader: flashrag, repo: {tmp_path}, subset: nq, "
             f"split: train, group: single_hop}}, {{name: toy_hotpotqa, loader: flashrag, "
             f"repo: {tmp_path}, subset: hotpotqa, split: train, group: multi_hop}}]")
    # the multi_hop track trains on toy_hotpotqa's 4 rows alone: dev_size 4 leaves none
    assert cli.main(["check-config", "config/config.yaml", train, "data.dev_size=4"]) == 2
    err = capsys.readouterr().err
    assert (f": data.dev_size (track multi_hop: toy_hotpotqa): 4 dev rows held out of 4 "
            f"training rows leave none to train on (toy_hotpotqa in {tmp_path}); set it below "
            "4") in err, err
    assert cli.main(["check-config", "config/config.yaml", train, "data.dev_size=3"]) == 0, \
        capsys.readouterr().err


WORLD_QA = "{name: x, loader: flashrag, repo: %s, subset: %s, split: %s, group: multi_hop}"
SEED_BOUND = "must be >= 0 and < 4294967296"  # 2**32: numpy's legacy seeding, vLLM's LLM(seed=)


@pytest.mark.parametrize("override, message", [
    # non-finite floats: no key reads .inf as "unbounded", and NaN passes every comparison
    ("train.optim.lr=.inf", r"train\.optim\.lr: inf is not a finite number"),
    ("train.optim.lr=.nan", r"train\.optim\.lr: nan is not a finite number"),
    ("train.optim.betas=[0.9, .nan]", r"train\.optim\.betas\[1\]: nan is not a finite number"),
    ("retrieval.http.timeout_s=-.inf", r"retrieval\.http\.timeout_s: -inf is not a finite"),
    ("train.seconds_per_step=.inf", r"train\.seconds_per_step: inf is not a finite number"),
    # seeds past what the seeded libraries take (torch.manual_seed raises from 2**64 on, with
    # no key named), or negative
    ("grid.sets.main.seeds=[1, 18446744073709551616]",
     rf"grid\.sets\.main\.seeds\[1\]: 18446744073709551616 is out of range: {SEED_BOUND}"),
    ("grid.sets.main.seeds=[4294967296]", r"grid\.sets\.main\.seeds\[0\]: 4294967296 is out"),
    ("world.seed=4294967296", rf"world\.seed: 4294967296 is out of range: {SEED_BOUND}"),
    ("data.seed=4294967296", r"data\.seed: 4294967296 is out of range"),
    ("toy_backbone.seed=4294967296", r"toy_backbone\.seed: 4294967296 is out of range"),
    ("toy_backbone.copy.seed=4294967296", r"toy_backbone\.copy\.seed: 4294967296 is out of"),
    ("sft.seed=4294967296", r"sft\.seed: 4294967296 is out of range"),
    ("toy_reader.sft.seed=4294967296", r"toy_reader\.sft\.seed: 4294967296 is out of range"),
    # sampling divides the logits by the temperature (greedy decoding is another switch)
    ("train.rollout.temperature=0", (r"train\.rollout\.temperature: 0\.0 is out of range: must "
                                    r"be > 0$")),
    ("grid.default=[]", (r"grid\.default: name at least one set: the default target would run "
                        r"nothing")),
    ("tracking.tracking_uri=ftp://host/mlruns",
     (r"tracking\.tracking_uri: 'ftp://host/mlruns': MLflow has no tracking store for scheme "
     r"ftp:")),
    ("tracking.tracking_uri=htp://localhost:5000", r"tracking\.tracking_uri: .* scheme htp:"),
    ("train.device=gpu", r"train\.device: 'gpu' is not a torch device"),
    ("train.device=cuda:x", r"train\.device: 'cuda:x' is not a torch device"),
    ("retrieval.encoder.device=GPU", r"retrieval\.encoder\.device: 'GPU' is not a torch device"),
    # a local data folder that is not there (a hub id owner/name is not a local path)
    (("data.test=[{name: t, loader: flashrag, repo: ./no/such/dir, subset: nq, group: "
     "single_hop}]"), r"data\.test\[0\]\.repo: no such local folder: \./no/such/dir$"),
    ("data.test=[{name: t, loader: searchr1, repo: ~/no/such/dir, group: single_hop}]",
     r"data\.test\[0\]\.repo: no such local folder: ~/no/such/dir$"),
    ("data.test=[{name: t, loader: searchr1, repo: pyproject.toml, group: single_hop}]",
     r"data\.test\[0\]\.repo: pyproject\.toml is a file, not a folder$"),
    ("data.train=[%s]" % (WORLD_QA % ("results/tyo/world/qa", "toy_nq", "train")),
     (r"data\.train\[0\]\.repo: 'results/tyo/world/qa' is neither a local folder nor a hub "
     r"dataset id \(owner/name\); this study's toy world writes its questions to "
     r"results/toy/world/qa$")),
    # results_dir moved, the data repos not: prepare-data would have found nothing
    ("results_dir=/tmp/elsewhere", (r"data\.train\[0\]\.repo: 'results/toy/world/qa' is "
                                    r"neither .* writes its questions to "
                                    r"/tmp/elsewhere/toy/world/qa$")),
    # the toy world's QA folder is written by the DAG; what it will hold is known at load
    ("data.train=[%s]" % (WORLD_QA % ("results/toy/world/qa", "toy_hotpotqa", "trian")),
     (r"data\.train\[0\]\.split: world\.qa_sets toy_hotpotqa has no split trian \(train, "
     r"dev\)$")),
    ("data.train=[%s]" % (WORLD_QA % ("results/toy/world/qa", "toy_hotpot", "train")),
     r"data\.train\[0\]\.subset: 'toy_hotpot' is not one of the world's qa_sets"),
    ("data.train=[%s]" % (WORLD_QA % ("results/toy/world/qa/toy_hotpotqa", "toy_hotpotqa",
                                      "train")),
     r"data\.train\[0\]\.repo: .* the toy world's questions are read from results/toy/world/qa"),
    # a value listed twice makes its cells twice (a seed counted twice in a mean and its CI)
    ("grid.sets.main.seeds=[1, 2, 1]", (r"grid\.sets\.main\.seeds\[2\]: 1 is listed twice "
                                       r"\(seeds\[0\]\)")),
    ("grid.sets.beta.betas=[0.3, 0.30]", r"grid\.sets\.beta\.betas\[1\]: 0\.3 is listed twice"),
    ("grid.sets.main.methods=[grpo, grpo]", r"grid\.sets\.main\.methods\[1\]: 'grpo' is listed"),
    ("backbones=[toy_reader, toy_reader]", r"backbones\[1\]: 'toy_reader' is listed twice"),
    ("tracks.single_hop.test=[toy_nq, toy_nq]",
     r"tracks\.single_hop\.test\[1\]: 'toy_nq' is listed twice"),
    # values a job would misread or fail on
    ("train.optim.betas=[0.9]", r"train\.optim\.betas: AdamW takes two betas"),
    ("train.rollout.max_turn_tokens=99999",
     r"train\.rollout: max_turn_tokens \(99999\) exceeds max_response_tokens"),
    ("retrieval.index.max_memory_fraction=1.5",
     r"retrieval\.index\.max_memory_fraction: 1\.5 is out of range: must be > 0 and <= 1"),
    ("retrieval.http.host='bad host'",
     r"retrieval\.http\.host: 'bad host' is neither an IP address nor a host name"),
    ("retrieval.encoder.revision=''", r"retrieval\.encoder\.revision: empty"),
    ("corpus.download.revision=' '", r"corpus\.download\.revision: empty"),
    ("corpus.download.endpoint=hf-mirror.com",
     r"corpus\.download\.endpoint: expected an http\(s\):// URL"),
    ("tracking.experiment=''", r"tracking\.experiment: empty"),
    ("cache_dir=''", r"cache_dir: an empty path"),
    ("results_dir=''", r"results_dir: an empty path"),
    ("methods_dir=config/method", r"methods_dir: no such folder: config/method$"),
])
def test_values_a_late_job_would_trip_on_are_refused_at_load(override, message):
    with pytest.raises(ConfigError) as e:
        load_study(ROOT / "config/config.yaml", [override])
    # the file (and the override) first, then the dotted key
    lead = f"{ROOT / 'config/config.yaml'} (with overrides {override}): "
    assert str(e.value).startswith(lead), str(e.value)
    assert re.search(message, str(e.value)[len(lead):]), str(e.value)


def test_a_world_split_without_questions_is_refused_at_load():
    # prepare-data would have read an empty file; `auto` reads test where the world writes one
    sets = ("world.qa_sets=[{name: toy_nq, group: single_hop, splits: {train: 0, dev: 5, test: "
            "0}, mix: {single: 1.0}}]")
    source = "{name: toy_nq, loader: flashrag, repo: results/toy/world/qa, subset: toy_nq"
    for split, which in (("train", "train"), ("auto", "test")):
        data = f"data={{train: [{source}, split: {split}, group: single_hop}}]}}"
        with pytest.raises(ConfigError, match=rf"\): data\.train\[0\]\.split: world\.qa_sets "
                           rf"toy_nq writes no question to its {which} split \(splits\.{which}: "
                           r"0\)$"):
            load_study(ROOT / "config/config.yaml", [sets, data])
    data = f"data={{train: [{source}, split: dev, group: single_hop}}]}}"
    with pytest.raises(ConfigError, match=r"tracks\.multi_hop"):  # the world check passed
        load_study(ROOT / "config/config.yaml", [sets, data])


def test_a_duplicate_key_inside_an_override_is_refused():
    with pytest.raises(ConfigError, match=r"^override 'train=\{optim: \{lr: 1e-6, lr: 1e-5\}\}': "
                                          r"train\.optim\.lr: duplicate key$"):
        load_study(ROOT / "config/config.yaml", ["train={optim: {lr: 1e-6, lr: 1e-5}}"])


def test_accepted_near_misses_of_the_refused_values():
    # the bounds are the libraries' own, not tighter: the largest seed, any torch device type
    # with an index (whether or not this machine has it), every store scheme MLflow has, a hub
    # dataset id that does not exist locally
    study = load_study(ROOT / "config/config.yaml", [
        "grid.sets.main.seeds=[0, 4294967295]", "train.device=cuda:3",
        "retrieval.encoder.device=mps", "train.rollout.temperature=1e-3",
        "tracking.tracking_uri=postgresql+psycopg2://u@db.example/mlflow"])
    assert study.grid.sets["main"].seeds == (0, 4294967295)
    paper = load_study(ROOT / "config/paper.yaml")  # hub ids RUC-NLPIR/FlashRAG_datasets
    assert {s.repo for s in paper.data.test} == {"RUC-NLPIR/FlashRAG_datasets"}
    for uri in ("http://login1:5000", "https://h", "sqlite:///r/mlflow.db", "mysql://h/db",
                "file:///r/mlruns", "r/mlruns", "/abs/mlruns", "databricks"):
        assert load_study(ROOT / "config/config.yaml", [f"tracking.tracking_uri={uri}"])


def test_mlflow_schemes_are_the_stores_mlflow_registers():
    # the list is read without importing mlflow (1 s); it must follow mlflow's own registry
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    from a2tgpo.tracking import MLFLOW_SCHEMES

    assert set(MLFLOW_SCHEMES) == set(_tracking_store_registry._registry)


@pytest.mark.parametrize("key, value", [("base.seed", 4294967296), ("sampler.seed", -1)])
def test_a_sweep_seed_out_of_range_is_refused_by_check_config(tmp_path, capsys, key, value):
    from a2tgpo import cli

    sweep = yaml.safe_load((ROOT / "config/sweeps/toy.yaml").read_text())
    section, name = key.split(".")
    sweep[section][name] = value
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    assert cli.main(["check-config", "config/config.yaml", f"sweeps=[{path}]"]) == 2
    err = capsys.readouterr().err
    assert f"sweeps[0]: {path}: {key}: {value} is out of range: {SEED_BOUND}" in err, err
