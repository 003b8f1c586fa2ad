# Config validation (before any job starts), study paths and the target list.

import shlex
import sys
from pathlib import Path

from snakemake.utils import validate

import a2tgpo.study as study_lib
from a2tgpo.study_checks import check_study
from a2tgpo.config import NAME, ConfigError, parse_override, read_yaml, to_dict
from a2tgpo.study import study_from_dict


def _typed_config_args():
    """--config values as YAML reads them: Snakemake reads the scalars inside a mapping value
    ("train={'optim': {'lr': 3e-4}}") as strings, which no number key accepts."""

    def merge(node, value):
        if isinstance(node, dict) and isinstance(value, dict):
            for k, v in value.items():
                node[k] = merge(node.get(k), v)
            return node
        return value

    for arg in workflow.config_settings.config_args or ():
        (key, *rest), value = parse_override(arg)
        if not rest:
            config[key] = merge(config.get(key), value)


# 1. the strict loader (file, key, a suggestion), then every check that needs more than the
# file (a2tgpo.study_checks.check_study: the grid, overrides, sweeps, memory plans; `a2tgpo
# check-config` runs the same function); the main process plans, job processes need not
def _config_source():
    """Where the config came from, for error messages: its files and --config values."""
    parts = [str(f) for f in workflow.configfiles]
    if workflow.config_settings.config_args:
        parts.append("--config " + " ".join(workflow.config_settings.config_args))
    return "config (" + " + ".join(parts) + ")"


try:
    # Snakemake's own YAML loader keeps the last of a key set twice: the strict one refuses
    for _file in workflow.configfiles:
        read_yaml(_file)
    _typed_config_args()
    STUDY = study_from_dict(config, source=_config_source())
    CHECKS = check_study(STUDY, _config_source(), plan=workflow.is_main_process)
except ConfigError as e:
    sys.exit(f"invalid config: {e}")


def check_rule_settings():
    """A --set-resources / --set-threads rule name (a profile's set-resources or the command
    line) that matches no rule is refused, as Snakemake would ignore it (a2tgpo/rule_settings.py).
    Called at the end of the Snakefile, once every rule is defined."""
    from a2tgpo.rule_settings import rule_settings_error

    rs = workflow.resource_settings
    error = rule_settings_error(
        {"set-resources": rs.overwrite_resources, "set-threads": rs.overwrite_threads},
        [r.name for r in workflow.rules],
        "profile or command line",
    )
    if error:
        sys.exit(f"invalid resources: {error}")


# 2. the JSON schema (generated from the same dataclasses by `a2tgpo config-doc --schema`)
# on the config as loaded: it cannot fail where the loader passed, unless the schema file is
# stale
validate(to_dict(STUDY), "../schemas/config.schema.yaml")

R = str(STUDY.root)  # results/<study>

# jobs' caches under the study (or cache_dir), never $HOME; every job process, local or on
# SLURM, parses this file, so the variables reach all of them; set ones win
import os

from a2tgpo.model.fetch import encoder_is_hub_id, is_hub_id

for _var, _path in study_lib.cache_env(STUDY).items():
    os.environ.setdefault(_var, _path)

# jobs end with the Snakemake that started them: killed, it leaves no orphan writing a run
# folder (a2tgpo/ops/preemption.py, "the anchor"); a job's own Snakemake on SLURM re-parses
# this file, so it anchors that job's processes
from a2tgpo.ops.preemption import ANCHOR_ENV, anchor_value

os.environ[ANCHOR_ENV] = anchor_value()
BACKBONES = {b: STUDY.backbone(b) for b in STUDY.backbones}
TOY_BACKBONES = {b: cfg for b, cfg in BACKBONES.items() if cfg.needs_build}


def uses_world():
    """The toy world is built when the corpus, a dataset or a backbone comes from it."""
    world_dir = f"{R}/world"
    sources = list(STUDY.data.train) + list(STUDY.data.test)
    return (
        STUDY.corpus.source == "world"
        or bool(TOY_BACKBONES)
        or any(s.repo.startswith(world_dir) for s in sources)
    )


def corpus_file():
    return study_lib.corpus_file(STUDY)


def index_file():
    return study_lib.index_file(STUDY)


def all_targets():
    targets = [f"{data_dir(t)}/summary.json" for t in STUDY.track_names] + [
        corpus_file(),
        f"{R}/index/check.json",
        f"{R}/tables/main.md",
        f"{R}/plots",
    ]
    if uses_world():
        targets += [f"{R}/world/summary.json", f"{R}/retrieval/recall.json"]
    targets += [f"{cfg.path}/config.json" for cfg in TOY_BACKBONES.values()]
    if TOY_BACKBONES:
        targets.append(f"{R}/sft/config.json")
    return targets


wildcard_constraints:
    section=r"[a-z_]+(\.[a-z_]+)*",


# --------------------------------------------------------------------------------------------
# the grid: one row per cell, self-describing paths runs/backbone~B/method~M/beta~X/seed~N

from a2tgpo.grid import CELL_PATTERN, Cell

TRACKS = STUDY.track_names  # ("",) without tracks: one model on all training sets
SET_CELLS = CHECKS.cells
DEFAULT_CELLS = list(dict.fromkeys(c for s in STUDY.grid.default for c in SET_CELLS[s]))

# 3. every cell's memory plan fits its GPUs and its job's memory request, and so does every
# evaluation job's (checked in 1.); a null train.mem_mb / eval.mem_mb becomes the plan's host
# memory x 1.25; `a2tgpo plan CONFIG` prints the whole plan
TRAIN_MEM_MB, EVAL_MEM_MB = {}, {}
if workflow.is_main_process:
    from a2tgpo.plan import MIB

    TRAIN_MEM_MB = {p.cell: round(p.mem_request / MIB) for p in CHECKS.plans}
    EVAL_MEM_MB = {e.backbone: round(e.mem_request / MIB) for e in CHECKS.evals}
    # 4. retries of the train rule: the jobs the longest cell needs at train.runtime_min
    for _line in CHECKS.retries.lines:
        print(_line, file=sys.stderr)
    TRAIN_RETRIES = CHECKS.retries.retries
else:
    TRAIN_RETRIES = None  # jobs run one attempt; the main process resubmits


def data_dir(track):
    return study_lib.data_dir(STUDY, track)


def track_tests(track):
    return [f"{data_dir(track)}/test/{s.name}.parquet" for s in STUDY.track_data(track).test]


def run_dir(cell):
    return f"{R}/runs/{cell}"


# a retrieval encoder given by hub id is fetched once (rule fetch_encoder); every job that
# encodes reads the retrieval section, which then names the fetched folder
ENCODER_INPUTS = (
    [f"{study_lib.encoder_dir(STUDY)}/fetch.json"]
    if encoder_is_hub_id(STUDY.retrieval.encoder.model)
    else []
)


def policy_inputs(backbone_id):
    """Files a training job waits for: the warm-started toy model, or a released backbone's
    fetched folder (none for a backbone given as a local directory)."""
    cfg = BACKBONES[backbone_id]
    if cfg.needs_build:
        return [f"{R}/sft/config.json"]
    if is_hub_id(cfg):
        return [f"{study_lib.model_dir(STUDY, backbone_id)}/fetch.json"]
    return []


def resolve_cell(path):
    """The resolved TrainConfig of the cell at `path` (what `a2tgpo train` reads)."""
    return study_lib.resolve_cell(STUDY, path)


def job_gpus(backbone_id, n=1):
    """GPUs a training/evaluation job of this backbone requests: none on CPU studies and for
    built (toy) backbones, else n."""
    return 0 if STUDY.train.device == "cpu" or BACKBONES[backbone_id].needs_build else n


def train_mem_mb(wc):
    """A training job's memory request (MB): train.mem_mb, or the cell's plan (3.); a sweep
    trial, not a grid cell, gets the largest of the grid's. Job-side processes, which plan
    nothing, see train.mem_mb (or 1)."""
    cell = getattr(wc, "cell", None)
    if cell in TRAIN_MEM_MB:
        return TRAIN_MEM_MB[cell]
    return STUDY.train.mem_mb or max(TRAIN_MEM_MB.values(), default=1)


def eval_mem_mb(wc):
    """An evaluation job's memory request (MB): eval.mem_mb, or its backbone's plan (3.)."""
    backbone = Cell.parse(wc.cell).backbone
    return EVAL_MEM_MB.get(backbone, STUDY.eval.mem_mb or 1)


def eval_all_runtime(wc):
    """evaluate_all's wall time: eval.runtime_all_min, else eval.runtime_min per checkpoint
    the cell saves (step 0, every save_every steps, the last; ReAct: step 0 only)."""
    ev = STUDY.eval
    if ev.runtime_all_min is not None:
        return ev.runtime_all_min
    cfg = resolve_cell(wc.cell)
    sched = cfg.schedule
    n = 1 + -(-sched.steps // sched.save_every) if cfg.method.train else 1
    return ev.runtime_min * n


# a job's own retrieval server (retrieval.http.serve: job): `a2tgpo with-retriever` starts it
# on the job's node, runs the job against it and stops it
WITH_RETRIEVER = (
    "a2tgpo with-retriever {input.cfg:q} -- "
    if STUDY.retrieval.mode == "http" and STUDY.retrieval.http.serve == "job"
    else ""
)


def with_retriever(cfg_path, state_dir=None):
    """WITH_RETRIEVER for the cell config `cfg_path` (a rule's params); `state_dir`: where the
    server keeps its files, if not in the config's run folder."""
    where = shlex.quote(str(cfg_path))
    if state_dir:
        where += f" --state-dir {shlex.quote(str(state_dir))}"
    return WITH_RETRIEVER.replace("{input.cfg:q}", where)


from a2tgpo.ops.job_cpus import ENV as JOB_CPUS_ENV, THREAD_VARS


def job_cpus_env(n):
    """The shell prefix of a grid job (train, sweep_trial, evaluate, evaluate_all) for the `n`
    CPUs its study config asks (train.threads / eval.threads; the rule's resource cpus_per_task
    requests them from SLURM): the thread counts, and A2TGPO_JOB_CPUS, which the job checks its
    CPUs against at start (a2tgpo/ops/job_cpus.py).

    Not from the rule's `threads`: Snakemake caps those at --cores, even for SLURM jobs
    (snakemake/rules.py), and profiles/default's `cores: all`, which wins over any profile's
    `cores`, makes that the submitting host's count; Snakemake also passes that --cores into
    each job. From a 2-core login node, every paper job would get 2 CPUs. cpus_per_task and
    these variables do not depend on --cores, so the request holds wherever Snakemake runs and
    whatever --cores says."""
    return " ".join(f"{var}={n}" for var in (JOB_CPUS_ENV, *THREAD_VARS)) + " "


def train_command(wc, threads):
    """Single process, or `train.nproc` ranks per node through `a2tgpo launch`, which passes a
    time limit's SIGTERM on to the ranks and, unlike the deepspeed launcher, never kills them
    30 s later (a2tgpo/train/launch.py)."""
    train = STUDY.train
    if train.backend == "single":
        return "a2tgpo train"
    return f"a2tgpo launch --nproc {train.nproc} --nnodes {train.nodes} -- a2tgpo train"


def cell_outputs(cells):
    """The per-cell files a finished cell has (evaluation last)."""
    return [f"{run_dir(c.path)}/eval/summary.json" for c in cells]


def set_cells(name):
    """Cells a table of set `name` covers: the default sets' plus its own; only its own for a
    set trained under a regime (grid.sets.<name>.regime), as its runs differ from theirs."""
    if STUDY.grid.sets[name].regime:
        return SET_CELLS[name]
    return list(dict.fromkeys(DEFAULT_CELLS + SET_CELLS[name]))


wildcard_constraints:
    cell=CELL_PATTERN,
    track=NAME.pattern,
    backbone=r"[A-Za-z0-9._-]+",


# --------------------------------------------------------------------------------------------
# Optuna sweeps (rules in sweep.smk): each sweep file listed in the study config, loaded and
# checked against the study in 1.

SWEEPS = CHECKS.sweeps  # name -> (file, SweepConfig, base cell)


def sweep_base(name):
    """The base cell's resolved TrainConfig (each trial then sets its run folder, β/γ, and
    the sweep's overrides)."""
    return resolve_cell(SWEEPS[name][2].path)
