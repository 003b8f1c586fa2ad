"""`a2tgpo <command>`: the only entry points the Snakemake rules call; people can too.

Every stage command takes a config file (a resolved section, or the whole study config with
`--section`), optional dotted `key=value` overrides, and an output location it writes
atomically.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import signal
import sys
import time
from pathlib import Path

from a2tgpo.config import ConfigError

EPILOG_OVERRIDES = (
    "Overrides are dotted key=value pairs parsed as YAML, applied before validation, e.g.\n"
    "  a2tgpo world config/config.yaml --section world seed=3 people=200 --out /tmp/world"
)


def _config_args(p: argparse.ArgumentParser, section: str) -> None:
    p.add_argument("config", help="YAML config file (a resolved section, or see --section)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    p.add_argument(
        "--section",
        default=None,
        help=f"read this top-level section of CONFIG (e.g. {section!r} of config/config.yaml); "
        "default: CONFIG is the section itself",
    )


def _load(cls, args):
    from a2tgpo.config import load_config

    return load_config(cls, args.config, args.overrides, section=args.section)


# --------------------------------------------------------------------------------------------
# commands


def cmd_world(args) -> int:
    from a2tgpo.data.world import WorldConfig, print_summary, write_world

    cfg = _load(WorldConfig, args)
    summary = write_world(cfg, args.out)
    print_summary(summary)
    return 0


def cmd_toy_backbone(args) -> int:
    from a2tgpo.model.toy import ToyBackboneConfig, write_toy_backbone

    cfg = _load(ToyBackboneConfig, args)
    if not (Path(args.world) / "summary.json").exists():
        raise ConfigError(f"{args.world}: no complete toy world here (summary.json missing); "
                          "run `a2tgpo world` first")
    s = write_toy_backbone(cfg, args.world, args.out)
    print(f"toy backbone: {s['parameters']:,} parameters, tokenizer vocabulary "
          f"{s['tokenizer_vocab']} (model {s['model_vocab']}), {s['layers']} layers of width "
          f"{s['hidden_size']} -> {args.out}")
    return 0


def cmd_toy_reader(args) -> int:
    from a2tgpo.train.reader import ToyReaderConfig, build_reader

    cfg = _load(ToyReaderConfig, args)
    work = args.work or f"{args.out}.worlds"
    s = build_reader(cfg, work, args.out)
    copy = s["copy_pretraining"]
    print(f"toy reader: {s['parameters']:,} parameters, tokenizer vocabulary "
          f"{s['tokenizer_vocab']}, {cfg.worlds} worlds (seeds {s['world_seeds']}), copy "
          f"accuracy {copy.get('heldout_accuracy', 'n/a')}, {s['demonstrations']['total']['demos']}"
          f" demonstrations, SFT final loss {s['sft']['final_loss']:.4f}, "
          f"{sum(s['seconds'].values()):.0f} s -> {args.out}")
    return 0


def cmd_prepare_data(args) -> int:
    from a2tgpo.data import qa

    return qa.main(args.config, args.overrides, args.out, section=args.section)


def cmd_download_corpus(args) -> int:
    from a2tgpo.data import corpus

    return corpus.main(args.config, args.overrides, args.out, section=args.section)


def _retrieval(args):
    from a2tgpo.retrieval.retriever import RetrievalConfig

    return _load(RetrievalConfig, args)


def _index_meta(cfg, corpus: str) -> dict:
    from a2tgpo.config import to_dict

    enc = to_dict(cfg.encoder)
    # what decides the vectors; device and batching do not
    keep = ("model", "revision", "pooling", "passage_prefix", "normalize", "max_length")
    return {"corpus": corpus, "encoder": {k: enc[k] for k in keep}}


def cmd_encode_corpus(args) -> int:
    from a2tgpo.retrieval.docstore import DocStore
    from a2tgpo.retrieval.encoders import Encoder
    from a2tgpo.retrieval.index import encode_shard

    cfg = _retrieval(args)
    docs = DocStore(args.corpus)
    emb = encode_shard(docs, Encoder(cfg.encoder), args.shard, cfg.index.num_shards, args.out,
                       cfg.index.chunk_size)
    print(f"shard {args.shard}/{cfg.index.num_shards}: {len(emb):,} passages x {emb.shape[1]} "
          f"-> {args.out}")
    return 0


def cmd_build_index(args) -> int:
    from a2tgpo.retrieval.docstore import DocStore
    from a2tgpo.retrieval.index import build_index

    cfg = _retrieval(args)
    if len(args.shards) != cfg.index.num_shards:
        raise ConfigError(f"index.num_shards is {cfg.index.num_shards} but "
                          f"{len(args.shards)} shard files were given")
    n = len(DocStore(args.corpus))
    meta = build_index(args.shards, cfg.index, n, args.out, _index_meta(cfg, args.corpus))
    print(f"index {cfg.index.factory}: {meta['ntotal']:,} vectors of dim {meta['dim']} "
          f"(= corpus passages) -> {args.out}")
    return 0


def cmd_check_index(args) -> int:
    import dataclasses

    from a2tgpo.io import atomic_write_json
    from a2tgpo.retrieval.docstore import DocStore
    from a2tgpo.retrieval.encoders import Encoder
    from a2tgpo.retrieval.index import check_alignment, load_index

    cfg = _retrieval(args)
    if args.sample_rows < 2:
        raise ConfigError(f"--sample-rows must be >= 2 (the first and the last row), got "
                          f"{args.sample_rows}")
    docs = DocStore(args.corpus)  # every row's contents checked; the first bad line is named
    n = len(docs)
    # on the CPU: a GPU copy holds fp16 vectors and cannot reconstruct them
    index = load_index(args.index, dataclasses.replace(cfg.index, gpu="off"), n)  # the count
    alignment = check_alignment(index, docs, Encoder(cfg.encoder), args.index,
                                sample=args.sample_rows, seed=args.seed)
    atomic_write_json(args.out, {"index": args.index, "corpus": args.corpus,
                                 "ntotal": int(index.ntotal), "dim": int(index.d),
                                 "contents_checked": n, "alignment": alignment})
    print(f"{args.index}: {index.ntotal:,} vectors = {n:,} corpus passages (every contents a "
          f"non-empty string); {len(alignment['rows'])} sampled rows aligned "
          f"({alignment['method']})")
    return 0


def _open_retriever(args, cfg, retriever: str | None = None):
    import dataclasses

    from a2tgpo.retrieval.index import IndexMismatch, read_meta
    from a2tgpo.retrieval.retriever import build_retriever

    if retriever is not None:
        cfg = dataclasses.replace(cfg, retriever=retriever)
    if cfg.retriever == "dense" and cfg.mode == "inprocess":
        built = read_meta(args.index).get("encoder")
        want = _index_meta(cfg, args.corpus)["encoder"]
        if built is not None and built != want:
            raise IndexMismatch(f"{args.index} was built with encoder {built}, but the config "
                                f"asks for {want}; rebuild the index or fix retrieval.encoder")
    return build_retriever(cfg, args.corpus, args.index)


def cmd_serve_retriever(args) -> int:
    from a2tgpo.retrieval.http import serve

    cfg = _retrieval(args)
    retriever = _open_retriever(args, cfg)
    h = cfg.http
    serve(retriever, host=args.host or h.host, port=h.port if args.port is None else args.port,
          default_topk=cfg.topk, max_batch=h.max_batch, max_wait_ms=h.max_wait_ms,
          ready_file=args.ready_file, hold_on_sigterm=args.hold_on_sigterm,
          limits={"max_request_queries": h.max_request_queries, "max_topk": h.max_topk,
                  "max_body_bytes": h.max_body_bytes, "max_query_chars": h.max_query_chars},
          keep_alive_s=h.keep_alive_s, request_timeout_s=h.request_timeout_s)
    return 0


def cmd_with_retriever(args) -> int:
    from pathlib import Path

    from a2tgpo.config import load_config
    from a2tgpo.ops.sidecar import RetrieverStartError, run_with_retriever
    from a2tgpo.train.config import TrainConfig

    command = args.passthrough
    if not command:
        raise ConfigError("with-retriever: name the command after `--`")
    cfg = load_config(TrainConfig, args.config)
    try:
        return run_with_retriever(cfg.retrieval, cfg.corpus, cfg.index, command,
                                  Path(args.state_dir or Path(cfg.run_dir) / "retriever"))
    except RetrieverStartError as e:
        print(f"a2tgpo with-retriever: {e}", file=sys.stderr)
        return 1


def cmd_fetch_backbone(args) -> int:
    from a2tgpo.model.backbone import load_backbone_config
    from a2tgpo.model.fetch import FetchError, fetch_backbone

    cfg = load_backbone_config(args.config)
    try:
        fetch_backbone(cfg, args.out, endpoint=args.endpoint)
    except FetchError as e:
        print(f"a2tgpo fetch-backbone: {args.config}: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_fetch_model(args) -> int:
    from a2tgpo.model.fetch import FetchError, fetch_model

    try:
        fetch_model(args.repo, args.revision, args.out, endpoint=args.endpoint)
    except FetchError as e:
        print(f"a2tgpo fetch-model: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_serve_hub(args) -> int:
    import time

    from a2tgpo.ops.hub import LocalHub, summary

    if not 0 < args.timeout < float("inf"):
        raise ConfigError(f"serve-hub: --timeout: expected seconds > 0, got {args.timeout}")
    with LocalHub(args.folder, host=args.host, port=args.port,
                  follow_symlinks=args.follow_symlinks, timeout_s=args.timeout) as hub:
        print(summary(hub), flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


def cmd_rehearse(args) -> int:
    from a2tgpo.ops.rehearsal import rehearse
    from a2tgpo.rehearsal_hub import prepare_hub

    if not args.passthrough:
        raise ConfigError("rehearse: name the command after `--`, e.g. -- snakemake --profile "
                          "slurm --configfile config/rehearsal.yaml")
    prepare_hub(args.hub)
    return rehearse(args.passthrough, hub_dir=args.hub, host=args.host, port=args.port)


def cmd_launch(args) -> int:
    from a2tgpo.train.launch import launch

    if not args.passthrough:
        raise ConfigError("launch: name the command after `--`")
    return launch(args.passthrough, args.nproc, nnodes=args.nnodes)


def cmd_search(args) -> int:
    from a2tgpo.retrieval.retriever import format_passages

    cfg = _retrieval(args)
    retriever = _open_retriever(args, cfg)
    for q, hits in zip(args.query, retriever.search(args.query, args.topk or cfg.topk),
                       strict=True):
        print(f"### {q}")
        print(format_passages(hits, args.style, cfg.max_passage_chars))
        print("scores: " + ", ".join(f"{h.id}={h.score:.3f}" for h in hits))
    return 0


def cmd_retrieval_eval(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from a2tgpo.io import atomic_write_json
    from a2tgpo.retrieval.evaluate import first_hop_recall, load_world_questions

    cfg = _retrieval(args)
    questions = load_world_questions(args.world)
    report = {}
    for kind in ("dense", "bm25"):
        retriever = _open_retriever(args, cfg, retriever=kind)
        report[kind] = first_hop_recall(retriever, questions, cfg.eval_k)
        retriever.close()
    atomic_write_json(args.out, report)
    table = Table("retriever", "questions", *(f"recall@{k}" for k in cfg.eval_k),
                  title="first-hop passage recall (query = the question)")
    for kind, r in report.items():
        for name, sub in [("all", r), *[(f"  {t}", v) for t, v in r["by_hop_type"].items()]]:
            table.add_row(f"{kind} {name}", str(sub["n"]),
                          *(f"{sub['recall'][str(k)]:.3f}" for k in cfg.eval_k))
    Console().print(table)
    return 0


def cmd_methods(args) -> int:
    from a2tgpo.algo.methods import METHODS, get_method, render_method_yaml, write_method_files

    if args.write:
        for path in write_method_files(args.write):
            print(path)
        return 0
    if args.show:
        print(render_method_yaml(get_method(args.show)), end="")
        return 0
    for m in METHODS.values():
        print(f"{m.id:<24} {m.name:<26} advantage={m.advantage.estimator:<12} "
              f"ratio={m.loss.ratio_level:<8} rollout={m.rollout.shape}")
    return 0


def cmd_sft(args) -> int:
    from a2tgpo.config import load_config
    from a2tgpo.retrieval.retriever import RetrievalConfig
    from a2tgpo.train import sft

    retrieval = load_config(RetrievalConfig, args.retrieval) if args.retrieval else None
    return sft.main(args.config, args.overrides, backbone_dir=args.backbone,
                    world_dir=args.world, corpus=args.corpus, index=args.index,
                    out_dir=args.out, section=args.section, holdout=args.holdout,
                    retrieval=retrieval)


def cmd_train(args) -> int:
    from a2tgpo.ops.job_cpus import check_job_cpus
    from a2tgpo.train.config import TrainConfig
    from a2tgpo.train.rl import train

    check_job_cpus("train.threads")
    cfg = _load(TrainConfig, args)
    summary = train(cfg)
    args.summary = (f"{cfg.method.id}, {summary['steps']} steps; best dev EM "
                    f"{summary['best_val_em']:.3f} at step {summary['best_step']} -> "
                    f"{cfg.run_dir}")
    return 0


def cmd_select(args) -> int:
    from a2tgpo.eval.select import SelectionError, write_best

    try:
        best = write_best(args.cell, args.criterion, out=args.out, eval_all_dir=args.eval_all)
    except SelectionError as e:  # the cell's files lack what selection needs: say which
        print(f"a2tgpo select: error: {e}", file=sys.stderr)
        return 1
    print(f"{args.cell}: step {best['step']} by {best['label']} ({best['value']:.4f}; "
          f"{len(best['candidates'])} candidates) -> {best['checkpoint']}")
    return 0


def cmd_evaluate(args) -> int:
    from a2tgpo.eval import evaluate
    from a2tgpo.eval.select import SelectionError
    from a2tgpo.ops.job_cpus import check_job_cpus

    check_job_cpus("eval.threads")
    try:
        return evaluate.main(args.config, args.overrides, test=args.test, out_dir=args.out,
                             best=args.best, all_checkpoints=args.all_checkpoints,
                             section=args.section, chunk=args.chunk, max_batch=args.max_batch)
    except SelectionError as e:
        print(f"a2tgpo evaluate: error: {e}", file=sys.stderr)
        return 1


def _snakemake_args(argv: list[str]) -> argparse.Namespace:
    """`argv` as Snakemake reads it (its own parser, so every spelling it accepts counts: -n,
    --dry-run, --dryrun, n among combined short flags such as -pn). Raises ValueError for
    arguments it refuses; -h and --version print Snakemake's answer and raise SystemExit, as
    `snakemake` does."""
    from snakemake.cli import get_argument_parser

    parser = get_argument_parser()
    parser.prog = "snakemake"  # its help, not ours

    def refuse(message):
        raise ValueError(message)

    parser.error = refuse
    return parser.parse_args(argv)


def _snakemake_locks_on(folder: Path, workdir: Path) -> list[str]:
    """Snakemake's lock files in `workdir` (<workdir>/.snakemake/locks, its default file
    backend: one path per line, relative to `workdir`) that name a file inside `folder`: a
    Snakemake run there reads or writes the folder, or one killed without unlocking left them.
    Snakemake itself refuses a second run whose outputs meet these files."""
    inside = folder.resolve()
    found = []
    for lock in sorted((workdir / ".snakemake" / "locks").glob("*.lock")):
        try:
            names = lock.read_text().splitlines()
        except OSError:
            continue
        if any(n and (workdir / n).resolve().is_relative_to(inside) for n in names):
            found.append(str(lock))
    return found


def cmd_rerun(args) -> int:
    """Archive one cell's run, then let Snakemake retrain, re-evaluate it and refresh tables."""
    import os
    import subprocess
    import sys

    from a2tgpo.cell import archive_dir, archive_run, archive_stamp
    from a2tgpo.grid import cells_of, match_cells, validate_grid
    from a2tgpo.ops.lock import FolderBusy, folder_lock, in_use
    from a2tgpo.study import load_study

    study = load_study(args.configfile, args.overrides)
    betas = validate_grid(study.grid, study.backbones, study.methods_dir, args.configfile,
                          study.track_names, tuple(study.train.regimes))
    by_set = {name: cells_of(study.grid, name, study.backbones, betas, study.track_names)
              for name in study.grid.sets}
    every = [c for cells in by_set.values() for c in cells]
    found = match_cells(every, args.selectors)
    if len(found) != 1:
        listing = "\n  ".join(c.path for c in found[:20]) or "(none)"
        print(f"a2tgpo rerun: {' '.join(args.selectors)} matches {len(found)} cells of "
              f"{args.configfile}; name exactly one:\n  {listing}", file=sys.stderr)
        return 2
    cell = found[0]
    sets = [n for n in study.grid.default if cell in by_set[n]]
    root = str(study.root)
    run_dir = study.root / "runs" / cell.path
    # the default tables if the cell is in a default set, else its own set's tables
    if sets:
        targets, refresh = [f"{root}/tables/main.md", f"{root}/plots"], ["tables",
                                                                                 "plots"]
    else:
        name = next(n for n, cells in by_set.items() if cell in cells)
        targets = [f"{root}/tables/{name}/main.md", f"{root}/set_plots/{name}"]
        refresh = ["set_tables", "set_plots"]
    # forced explicitly: Snakemake does not rerun an existing target whose input was removed
    cmd = [sys.executable, "-m", "snakemake", *targets, "--configfile", args.configfile,
           "--forcerun", f"{run_dir}/summary.json", *refresh]
    if args.overrides:
        cmd += ["--config", *args.overrides]
    cmd += args.snakemake_args
    try:
        smk = _snakemake_args(args.snakemake_args)
    except ValueError as e:
        print(f"a2tgpo rerun: Snakemake refuses the arguments after --: {e}; nothing was "
              "moved", file=sys.stderr)
        return 2
    except SystemExit as e:  # -h, --version: Snakemake has answered; there is nothing to run
        return e.code if isinstance(e.code, int) else 0
    workdir = Path(smk.directory or ".")

    def snakemake_busy() -> str | None:
        locks = [] if smk.nolock else _snakemake_locks_on(run_dir, workdir)
        if not locks:
            return None
        return (f"a Snakemake run in {workdir} holds locks on files of {run_dir} "
                f"({', '.join(locks)}): it may be training or evaluating the cell, and "
                "Snakemake would refuse this rerun's run. Wait for it to end; if no Snakemake "
                "runs there, `snakemake --unlock` clears what a killed one left")

    if args.dry_run or smk.dryrun:
        stamp = archive_stamp()
        what = (f"would archive {run_dir} to {archive_dir(root, cell.path, stamp)}"
                if run_dir.exists() else f"would archive nothing ({run_dir} does not exist)")
        holder = in_use(run_dir)
        if holder:
            what += f"; refused now: the run folder is in use by {holder}"
        elif busy := snakemake_busy():
            what += f"; refused now: {busy}"
        if args.dry_run:
            print(f"{what}\nwould run: {' '.join(cmd)}")
            return 0
        print(f"dry run, nothing is moved: {what}")
        print("running: " + " ".join(cmd), flush=True)
        return subprocess.call(cmd, env=os.environ.copy())
    # under the run folder's lock: a job training the cell holds it, and no job starts on the
    # folder while it moves
    try:
        with folder_lock(run_dir, "run folder"):
            if busy := snakemake_busy():
                print(f"a2tgpo rerun: cell {cell.path}: {busy}. Nothing was moved.",
                      file=sys.stderr)
                return 1
            moved = archive_run(root, cell, archive_stamp())
    except FolderBusy as e:
        print(f"a2tgpo rerun: cell {cell.path}: {e}. Nothing was moved.", file=sys.stderr)
        return 1
    print(f"cell {cell.path}: " + (f"previous run moved to {moved}" if moved
                                   else "no previous run"))
    print("running: " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=os.environ.copy())


def cmd_plan(args) -> int:
    import dataclasses

    from a2tgpo.io import atomic_write_json
    from a2tgpo.plan import GIB, Assumptions, index_note, plan_evals, plan_study, print_plan
    from a2tgpo.study import load_study

    study = load_study(args.config, args.overrides)
    sets = None if args.sets == ["all"] else (args.sets or list(study.grid.default))
    unknown = [s for s in sets or [] if s not in study.grid.sets]
    if unknown:
        raise ConfigError(f"{args.config}: --sets: no grid set {', '.join(unknown)} "
                          f"(sets: {', '.join(study.grid.sets)})")
    assume = Assumptions(**{k: v for k, v in vars(args).items()
                            if k in {f.name for f in dataclasses.fields(Assumptions)}
                            and v is not None})
    plans = plan_study(study, sets, assume)
    evals = plan_evals(study, sets)
    print_plan(plans, assume, evals=evals)
    print(index_note(study))
    if args.json:
        atomic_write_json(args.json, {
            "assumptions": dataclasses.asdict(assume),
            "cells": [{"cell": p.cell, "fits": p.fits, "peak_phase": p.peak_phase,
                       "peak_gib": p.peak / GIB, "capacity_gib": p.capacity / GIB,
                       "largest_term": p.largest.name, "tokens_per_step": p.tokens_per_step,
                       "gpu_hours": p.gpu_hours, "disk_gib": p.disk_bytes / GIB,
                       "phases": {ph: {t.name: t.bytes / GIB for t in ts}
                                  for ph, ts in p.phases.items()},
                       "host_gib": {t.name: t.bytes / GIB for t in p.host},
                       "mem_request_gib": p.mem_request / GIB} for p in plans],
            "evaluation": [{"backbone": e.backbone, "fits": e.fits, "gpus": e.gpus,
                            "gpu_gib": {t.name: t.bytes / GIB for t in e.gpu},
                            "host_gib": {t.name: t.bytes / GIB for t in e.host},
                            "mem_request_gib": e.mem_request / GIB} for e in evals]})
    return 0 if all(p.fits for p in plans) and all(e.fits for e in evals) else 1


def cmd_check_config(args) -> int:
    from a2tgpo.study import load_study
    from a2tgpo.study_checks import check_study

    study = load_study(args.config, args.overrides)
    checks = check_study(study, args.config)  # what Snakemake checks before it starts any job
    n_cells = len({c for cells in checks.cells.values() for c in cells})
    print(f"{args.config}: valid (study {study.study!r}: {n_cells} cells in "
          f"{len(checks.cells)} grid sets, {len(checks.sweeps)} sweeps; every job's memory "
          "plan fits)")
    return 0


def cmd_resolve(args) -> int:
    from a2tgpo.study import write_section

    write_section(args.config, args.overrides, args.section, args.output)
    return 0


def cmd_config_doc(args) -> int:
    from a2tgpo.config import describe
    from a2tgpo.study import StudyConfig, study_schema

    if args.schema:
        import yaml

        print(yaml.safe_dump(study_schema(), sort_keys=False, width=100), end="")
        return 0
    for key, type_, default, doc in describe(StudyConfig):
        print(f"{key}  ({type_}; default {default})\n    {doc}")
    return 0


def _report(args, module) -> int:
    from a2tgpo.report import ReportInputError

    if args.runs is None and not args.cells:
        raise ConfigError("give --runs DIR or --cells CELL...")
    if args.set is not None and not args.study_run:
        raise ConfigError("--set names the grid set of --study-run; give both or neither")
    try:
        rc = module.main(args.config, args.section, args.runs, args.cells, args.out)
    except ReportInputError as e:  # a malformed result file: a message, not a traceback
        print(f"a2tgpo {args.command}: error: {e}", file=sys.stderr)
        return 1
    if rc == 0 and args.study_run:
        _log_study_run(args)
    return rc


def _log_study_run(args) -> None:
    """`--study-run`: the outputs into the study's MLflow run; tracking never fails the
    report (a2tgpo/report/study_run.py)."""
    from a2tgpo.report import discover_cells
    from a2tgpo.report.study_run import log_outputs

    try:
        cells = [c.run_dir for c in discover_cells(args.runs, args.cells)]
        run_id = log_outputs(cells, args.out, args.command, args.set)
    except Exception as e:  # the files are written; the study run is the browsing layer
        logging.getLogger("a2tgpo.report").warning(
            "the study's MLflow run was not updated with %s (%s: %s)", args.out,
            type(e).__name__, e)
        return
    if run_id is not None:
        print(f"{args.command} logged to the study's MLflow run {run_id}")


def cmd_tables(args) -> int:
    from a2tgpo.report import tables

    return _report(args, tables)


def cmd_plots(args) -> int:
    from a2tgpo.report import plots

    return _report(args, plots)


def cmd_sweep_trial(args) -> int:
    from a2tgpo import sweep
    from a2tgpo.config import load_config
    from a2tgpo.ops.job_cpus import check_job_cpus
    from a2tgpo.train.config import TrainConfig

    check_job_cpus("train.threads")  # a trial is a training job (rule sweep_trial; main()
    # has sent stderr to --log already)
    cfg = sweep.load_sweep(args.sweep)
    base = load_config(TrainConfig, args.base)
    try:
        sweep.run_trial(cfg, args.index, base, out=args.out)
    except sweep.SweepError as e:
        print(f"a2tgpo sweep-trial: error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_sweep_summary(args) -> int:
    from a2tgpo import sweep

    cfg = sweep.load_sweep(args.sweep)
    try:
        summary = sweep.summarize(cfg, args.dir)
    except sweep.SweepError as e:
        print(f"a2tgpo sweep-summary: error: {e}", file=sys.stderr)
        return 1
    print(sweep.format_summary(summary))
    print(f"-> {args.dir}/summary.json, {args.dir}/best.png")
    return 0


def cmd_sync_mlflow(args) -> int:
    from a2tgpo.tracking import TrackingUnreachable, sync

    try:
        report = sync(args.paths, tracking_uri=args.tracking_uri, experiment=args.experiment)
    except TrackingUnreachable as e:
        print(f"a2tgpo sync-mlflow: error: {e}; nothing more was sent", file=sys.stderr)
        return 1
    print(report.format())
    return 1 if report.failed else 0


# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="a2tgpo",
        description="Reinforcement learning of LLM search agents: A2TGPO, AT2PO and their "
        "baselines, from corpus to tables. The Snakemake DAG calls these commands; each reads a "
        "config file and writes its outputs atomically.",
        epilog=EPILOG_OVERRIDES,
        formatter_class=fmt,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    # the `deepspeed` launcher puts --local_rank=N before the command (LOCAL_RANK is set too)
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")

    p = sub.add_parser(
        "world",
        help="generate the toy world (corpus, entities, QA splits)",
        description="Generate the seeded synthetic multi-hop QA world: a wiki-18-format corpus "
        "(one passage per entity plus distractors), entities.jsonl, and questions in the "
        "FlashRAG layout qa/<dataset>/<split>.jsonl. Same seed and sizes -> identical files.",
        epilog=EPILOG_OVERRIDES,
        formatter_class=fmt,
    )
    _config_args(p, "world")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=cmd_world)

    p = sub.add_parser(
        "toy-backbone",
        help="train the toy tokenizer and build the tiny Qwen3 model",
        description="Train a byte-level BPE tokenizer on the toy world and the prompt "
        "templates, build a randomly initialised Qwen3-architecture causal LM of the configured "
        "size, and save both with save_pretrained (loadable by AutoModelForCausalLM).",
        formatter_class=fmt,
    )
    _config_args(p, "toy_backbone")
    p.add_argument("--world", required=True, help="directory written by `a2tgpo world`")
    p.add_argument("--out", required=True, help="output model directory")
    p.set_defaults(func=cmd_toy_backbone)

    p = sub.add_parser(
        "toy-reader",
        help="pretrain the toy reader: a toy backbone that reads, built on other toy worlds",
        description="Generate the pretraining worlds, train the tokenizer on them, build the "
        "tiny Qwen3 model, copy-pretrain it, fine-tune it on the oracle's demonstrations of "
        "every pretraining question (a2tgpo/train/reader.py), and save it with "
        "save_pretrained plus a2tgpo_reader.json. About 25 min on one CPU thread.",
        formatter_class=fmt,
    )
    _config_args(p, "toy_reader")
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--work", default=None,
                   help="where the pretraining worlds go (default: OUT.worlds)")
    p.set_defaults(func=cmd_toy_reader)

    p = sub.add_parser(
        "prepare-data",
        help="load QA datasets (FlashRAG, Search-R1, toy) and write normalised parquet splits",
        description="Load the configured training and test datasets (hub ids or local "
        "directories laid out like the hub repos), normalise them to one schema (id, "
        "question, golden_answers, source, split, group, hop_type, hops), hold out a dev split "
        "from the training rows, and write parquet files plus summary.json.",
        formatter_class=fmt,
    )
    _config_args(p, "data")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=cmd_prepare_data)

    p = sub.add_parser(
        "download-corpus",
        help="download and verify the wiki-18 corpus (and optionally the prebuilt e5 index)",
        description="Download the retrieval corpus (and optionally Search-R1's prebuilt e5 "
        "flat index parts) through huggingface_hub, resuming partial downloads, verify sizes and "
        "line counts, and move verified files into place atomically.",
        formatter_class=fmt,
    )
    _config_args(p, "corpus")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=cmd_download_corpus)

    def retrieval_args(p, index=True):
        _config_args(p, "retrieval")
        p.add_argument("--corpus", required=True, help="wiki-18-format JSONL corpus (.jsonl[.gz])")
        if index:
            p.add_argument("--index", default=None, help="faiss index (dense retriever)")

    p = sub.add_parser(
        "encode-corpus",
        help="embed one shard of the corpus (resumable)",
        description="Embed rows [start, end) of shard SHARD of retrieval.index.num_shards with "
        "the configured encoder; finished chunks are kept, so a killed job resumes; the shard's "
        ".npy file appears atomically when complete.",
        formatter_class=fmt,
    )
    retrieval_args(p, index=False)
    p.add_argument("--shard", type=int, required=True, help="shard number, 0-based")
    p.add_argument("--out", required=True, help="output .npy file")
    p.set_defaults(func=cmd_encode_corpus)

    p = sub.add_parser(
        "build-index",
        help="build one faiss index from the encoded shards",
        description="Add the shard embeddings in order to faiss.index_factory(d, factory, IP), "
        "train it first when the factory needs it, check that it holds one vector per corpus "
        "passage, and write it (plus <index>.json metadata) atomically.",
        formatter_class=fmt,
    )
    retrieval_args(p, index=False)
    p.add_argument("--shards", nargs="+", required=True, help="shard .npy files, in order")
    p.add_argument("--out", required=True, help="output index file")
    p.set_defaults(func=cmd_build_index)

    p = sub.add_parser(
        "check-index",
        help="check that an index (e.g. Search-R1's prebuilt one) matches the corpus",
        description="Check every corpus row (contents a non-empty UTF-8 string; the first bad "
        "line is named), load the index (after estimating its memory need), compare its vector "
        "count with the corpus's passage count, re-encode a fixed sample of passages with the "
        "configured encoder and check that index row i holds corpus row i's vector (cosine >= "
        "0.99 with the stored vector; indexes storing codes: found by its own passage), and "
        "write a small JSON record if all agree.",
        formatter_class=fmt,
    )
    retrieval_args(p)
    p.add_argument("--sample-rows", type=int, default=32,
                   help="passages re-encoded for the alignment check, spread over the corpus "
                   "(always the first and the last)")
    p.add_argument("--seed", type=int, default=0, help="seed of the alignment sample")
    p.add_argument("--out", required=True, help="output JSON record")
    p.set_defaults(func=cmd_check_index)

    p = sub.add_parser(
        "serve-retriever",
        help="serve the retriever over HTTP (Search-R1's POST /retrieve API)",
        description="Load the configured retriever and serve POST /retrieve with body "
        "{queries, topk, return_scores}, batching concurrent requests. Binds 127.0.0.1 unless "
        "--host says otherwise.",
        formatter_class=fmt,
    )
    retrieval_args(p)
    p.add_argument("--host", default=None, help="bind address (default: retrieval.http.host)")
    p.add_argument("--port", type=int, default=None,
                   help="port (default: retrieval.http.port; 0 = a free port)")
    p.add_argument("--ready-file", default=None,
                   help="once listening, write {host, port, url, pid} here (JSON, atomic)")
    p.add_argument("--hold-on-sigterm", action="store_true",
                   help="keep serving through SIGTERM, stop on SIGINT (a job's own server: "
                   "SLURM's SIGTERM reaches every process of the job)")
    p.set_defaults(func=cmd_serve_retriever)

    p = sub.add_parser(
        "search",
        help="run queries through the configured retriever and print the passages",
        description="Run QUERY strings through the configured retriever (in-process or HTTP) and "
        "print each result as the policy would see it.",
        formatter_class=fmt,
    )
    retrieval_args(p)
    p.add_argument("--query", action="append", required=True, help="a query (repeatable)")
    p.add_argument("--topk", type=int, default=None)
    p.add_argument("--style", choices=["a2tgpo", "search_r1"], default="a2tgpo")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser(
        "retrieval-eval",
        help="recall@k of each toy question's first-hop passage, dense and BM25",
        description="For every question of the toy world, search with the question text and "
        "report recall@k (retrieval.eval_k) of the passage holding its first hop, overall, by "
        "hop type and by dataset, for the dense retriever and for BM25.",
        formatter_class=fmt,
    )
    retrieval_args(p)
    p.add_argument("--world", required=True, help="directory written by `a2tgpo world`")
    p.add_argument("--out", required=True, help="output JSON report")
    p.set_defaults(func=cmd_retrieval_eval)

    p = sub.add_parser(
        "sft",
        help="warm-start a backbone on scripted search demonstrations (the toy world)",
        description="Write oracle demonstrations on the toy world (queries formed from the "
        "question and the retrieved passages, through the real retriever; a share of them "
        "deliberately imperfect) and fine-tune the backbone on their generated tokens only. "
        "Makes the tiny toy model a competent starting policy; the papers' backbones skip it.",
        formatter_class=fmt,
    )
    _config_args(p, "sft")
    p.add_argument("--backbone", required=True, help="model directory to start from")
    p.add_argument("--world", required=True, help="directory written by `a2tgpo world`")
    p.add_argument("--corpus", required=True, help="retrieval corpus (JSONL)")
    p.add_argument("--index", required=True, help="faiss index of the corpus")
    p.add_argument("--retrieval", default=None,
                   help="the study's retrieval section as a file (the encoder of --index, "
                   "topk, max_passage_chars); default: that section's defaults")
    p.add_argument("--holdout", default=None,
                   help="prepared QA file whose questions are left out (e.g. data/dev.parquet)")
    p.add_argument("--out", required=True, help="output model directory")
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser(
        "train",
        help="run (or resume) one RL training job from a resolved config",
        description="Train one grid cell: rollouts, rewards, information gain, advantages and "
        "PPO-style updates per the method, with validation, checkpoints and tracking on "
        "schedule. A rerun resumes from the last complete checkpoint. SIGTERM/SIGUSR1 (a "
        "time limit, a preemption) stop it at the next rollout wave or the end of the step, "
        "with a checkpoint, and exit 75; under SLURM it also stops so before a step that "
        "would not end stop_margin_s before the job's time limit.",
        epilog=EPILOG_OVERRIDES,
        formatter_class=fmt,
    )
    _config_args(p, "train")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "rerun",
        help="retrain and re-evaluate one grid cell, then refresh the tables",
        description="Select one cell of the study's grid by its coordinates "
        "(backbone=, method=, beta=, seed=; omitted ones must be unambiguous), move its run "
        "folder to <results>/<study>/archive/<cell>/<time>/ (nothing is deleted), and run "
        "Snakemake for the tables: only that cell is retrained and re-evaluated, the tables "
        "and plots are refreshed, every other cell is left as it is. The folder moves under "
        "its lock: while a job trains the cell, rerun refuses and names that job. Arguments "
        "after -- go to Snakemake (e.g. -- --profile profiles/slurm); a Snakemake dry run "
        "there (-- -n) moves nothing and says what a rerun would move.",
        epilog="example: a2tgpo rerun data=multi_hop method=a2tgpo beta=0.3 seed=1 -- --cores 2",
        formatter_class=fmt,
    )
    p.add_argument("selectors", nargs="+", help="key=value: backbone, method, beta, seed")
    p.add_argument("--configfile", default="config/config.yaml", help="the study config")
    p.add_argument("--config", dest="overrides", nargs="*", default=[],
                   help="dotted study-config overrides, passed to Snakemake as --config too")
    p.add_argument("-n", "--dry-run", action="store_true",
                   help="print what would be archived and run; move and run nothing")
    p.set_defaults(func=cmd_rerun, snakemake_args=[])

    p = sub.add_parser(
        "select",
        help="choose a cell's checkpoint (dev EM, or the papers' best test average)",
        description="Pick the checkpoint of a grid cell that the tables report and write "
        "best.json atomically: by default the best greedy dev EM (val/em in metrics.jsonl) "
        "among steps with a complete checkpoint; with --criterion test_avg the best "
        "sample-weighted test average over eval_all/step_*/summary.json (written by `evaluate "
        "--all-checkpoints`), the papers' protocol. Ties go to the earliest step.",
        formatter_class=fmt,
    )
    p.add_argument("cell", help="grid cell directory (config.yaml, metrics.jsonl, checkpoints/)")
    p.add_argument("--criterion", choices=["dev_em", "test_avg"], default="dev_em",
                   help="selection rule (default: dev_em)")
    p.add_argument("--out", default=None, help="output file (default: <cell>/best.json)")
    p.add_argument("--eval-all", default=None,
                   help="test_avg: the evaluate --all-checkpoints folder "
                   "(default: <cell>/eval_all)")
    p.set_defaults(func=cmd_select)

    p = sub.add_parser(
        "evaluate",
        help="greedy test-set evaluation of the selected checkpoint (or of every checkpoint)",
        description="Roll out the checkpoint named by best.json (or, with --all-checkpoints, "
        "every complete checkpoint into <out>/step_NNNNNN/) greedily on every test set, with "
        "training's validation code, and write per-dataset EM/F1 (<dataset>.json), predictions "
        "(<dataset>.predictions.jsonl) and summary.json with sample-weighted group averages; "
        "the metrics also go to the cell's MLflow run. The dataset name is the parquet stem, "
        "its group the rows' `group` column.",
        epilog=EPILOG_OVERRIDES,
        formatter_class=fmt,
    )
    _config_args(p, "train")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--best", help="best.json written by `a2tgpo select`")
    which.add_argument("--all-checkpoints", action="store_true",
                       help="evaluate every complete checkpoint (for --criterion test_avg)")
    p.add_argument("--test", nargs="+", required=True, help="prepared test parquet files")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--chunk", type=int, default=1024,
                   help="questions per rollout call, all test sets pooled (default 1024)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="hf engine: sequences per forward pass (default: 32 on CPU, the "
                   "engine's default on GPU)")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser(
        "methods",
        help="list the method table, show one method, or write config/methods/*.yaml",
        description="Every method id (baselines, A2TGPO, AT2PO and their ablation cells) with "
        "its advantage estimator, ratio level and rollout shape. --show ID prints its settings "
        "with the source of each value; --write DIR regenerates the method files.",
        formatter_class=fmt,
    )
    p.add_argument("--show", metavar="ID", help="print one method's settings")
    p.add_argument("--write", metavar="DIR", help="write <DIR>/<id>.yaml for every method")
    p.set_defaults(func=cmd_methods)

    p = sub.add_parser(
        "with-retriever",
        help="run a command against a retrieval server started for it on this node",
        description="Start `serve-retriever` for the cell config's retrieval section, corpus "
        "and index on a free port, wait until it listens, run the command after `--` with "
        "A2TGPO_RETRIEVER_URL pointing at it (SIGTERM/SIGUSR1 passed on), stop the server, "
        "and exit with the command's status. The DAG wraps training and evaluation jobs in it "
        "when retrieval.http.serve is job.",
        formatter_class=fmt,
    )
    p.add_argument("config", help="the cell's resolved config.yaml (a TrainConfig)")
    p.add_argument("--state-dir", help="the server's section, ready file and log; default "
                   "<the config's run_dir>/retriever (sweep trials, which share a base "
                   "config, each give their own)")
    p.set_defaults(func=cmd_with_retriever)

    p = sub.add_parser(
        "fetch-backbone",
        help="download a released backbone at its pinned revision into a study folder",
        description="Fetch the backbone file's hub `path` at its `revision` (a commit pins it; a "
        "branch or tag is resolved once, with a warning naming the commit to pin): configs, "
        "tokenizer files, chat template and safetensors weights only, into a temporary folder "
        "checked (config.json, every shard of the index) and renamed into place, with "
        "fetch.json (repo, revision, commit, file sizes) written last. The DAG runs it once per "
        "backbone on the submitting host; jobs load the folder with the hub offline.",
        formatter_class=fmt,
    )
    p.add_argument("config", help="a backbone file, e.g. config/backbones/qwen3-8b.yaml")
    p.add_argument("--out", required=True, help="the folder, e.g. results/paper/models/qwen3-8b")
    p.add_argument("--endpoint", default=None,
                   help="hub endpoint (default: huggingface_hub's, HF_ENDPOINT)")
    p.set_defaults(func=cmd_fetch_backbone)

    p = sub.add_parser(
        "fetch-model",
        help="download a hub model repo (e.g. the retrieval encoder) at a revision into a folder",
        description="fetch-backbone for any model repo: the same files, checks and fetch.json. "
        "The DAG runs it for a retrieval encoder given by hub id (into results/<study>/models/"
        "encoder).",
        formatter_class=fmt,
    )
    p.add_argument("repo", help="hub model id, e.g. intfloat/e5-base-v2")
    p.add_argument("--revision", default=None, help="commit (pins it), branch or tag; "
                   "default main, resolved to its commit with a warning")
    p.add_argument("--out", required=True, help="the folder, e.g. results/paper/models/encoder")
    p.add_argument("--endpoint", default=None,
                   help="hub endpoint (default: huggingface_hub's, HF_ENDPOINT)")
    p.set_defaults(func=cmd_fetch_model)

    p = sub.add_parser(
        "serve-hub",
        help="serve a local folder of hub-shaped repos as a Hugging Face Hub (HF_ENDPOINT)",
        description="Serve FOLDER/models/<org>/<name>/ and FOLDER/datasets/<org>/<name>/ with "
        "the endpoints huggingface_hub downloads from (repo info, file tree, resolve with "
        "sha256 etags and resumable ranges), each repo at the commit its files hash to; "
        "until Ctrl-C. Point HF_ENDPOINT at it.",
        formatter_class=fmt,
    )
    p.add_argument("folder", help="e.g. results/rehearsal-hub")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0: every interface; "
                   "anyone who reaches the port can read the files)")
    p.add_argument("--port", type=int, default=8790, help="port (0: a free one)")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S",
                   help="seconds a connection has to send its request head, and for each read "
                   "or write after; then it is closed (default 30)")
    p.add_argument("--follow-symlinks", action="store_true",
                   help="also serve files whose symlinks lead outside FOLDER (by default they "
                   "are left out, with a warning)")
    p.set_defaults(func=cmd_serve_hub)

    p = sub.add_parser(
        "rehearse",
        help="run the rehearsal study's command against its local hub (a2tgpo/ops/rehearsal.py)",
        description="Build the rehearsal hub's repos (a tiny Qwen3-architecture backbone, an "
        "encoder, a wiki-18-format corpus with its prebuilt faiss index in parts, FlashRAG-shaped "
        "data) into --hub unless complete, serve them, run the command after `--` with "
        "HF_ENDPOINT pointing at them, stop the hub, exit with the command's status. Use: "
        "a2tgpo rehearse -- snakemake --profile slurm --configfile config/rehearsal.yaml",
        formatter_class=fmt,
    )
    p.add_argument("--hub", default="results/rehearsal-hub", help="the hub's folder")
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (default 127.0.0.1: only jobs on this machine reach the "
                   "hub); where compute nodes are other machines, 0.0.0.0 (or this host's "
                   "address on their network) lets them reach it at this host's name, and so "
                   "can anyone else who reaches the port")
    p.add_argument("--port", type=int, default=0, help="port (0: a free one)")
    p.set_defaults(func=cmd_rehearse)

    p = sub.add_parser(
        "launch",
        help="start a training job's ranks on this node (a stop reaches them, nothing kills them)",
        description="Run the command after `--` --nproc times with RANK, LOCAL_RANK, WORLD_SIZE, "
        "LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, pass SIGTERM/SIGUSR1/SIGINT on to "
        "every rank, and exit with the first failing rank's status (the others stopped), else "
        "75 if a rank stopped for a time limit or preemption, else 0. Unlike the deepspeed "
        "launcher and torchrun it never kills ranks 30 s after SIGTERM, so they can "
        "checkpoint. The DAG starts backend-deepspeed training through it.",
        formatter_class=fmt,
    )
    p.add_argument("--nproc", type=int, required=True, help="ranks on this node")
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes (one launcher per node under srun; SLURM_NODEID is the node)")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser(
        "plan",
        help="memory, tokens, GPU-hours and disk of every cell, before any job starts",
        description="Per cell and rank: weights, optimizer shard, reference, vLLM share, "
        "activations, log-prob buffers and KV caches in each phase of a step, against "
        "train.gpu_memory_gb (GPU cells) or train.mem_mb (CPU cells); each job's host memory "
        "against its mem_mb (null: the plan x 1.25) and each evaluation job's GPU and host "
        "memory, the job's own retrieval server included; tokens per step, a GPU-hour "
        "estimate from the stated assumptions, and checkpoint disk. Exit 1 when a cell or an "
        "evaluation job does not fit (the DAG refuses such a study).",
        formatter_class=fmt,
    )
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--sets", nargs="*", default=None,
                   help="grid sets to plan (default: grid.default; `all`: every set)")
    p.add_argument("--json", help="also write the plan to this JSON file")
    p.add_argument("--mean-tokens", dest="mean_tokens", type=float,
                   help="assumed mean trajectory length in tokens (prompt included)")
    p.add_argument("--mfu", dest="train_mfu", type=float,
                   help="assumed model-FLOPs utilisation of the training passes")
    p.add_argument("--peak-tflops", dest="peak_tflops", type=float,
                   help="the GPU's dense bf16 peak, TFLOP/s (default: train.gpu_model's)")
    p.add_argument("--shape", choices=["grpo", "a2tgpo"],
                   help="the simulated rollouts' lengths (a2tgpo/timing.py SHAPES; default "
                   "grpo: maxima at the response budget)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "check-config",
        help="validate a study config (config/config.yaml) strictly",
        description="Validate the whole study config with exactly the checks Snakemake runs "
        "before it starts any job: unknown keys (with a suggestion), wrong types, missing "
        "required keys and numbers out of range name the file and the dotted key; then the "
        "grid, the overrides, the sweeps and every job's memory plan.",
        formatter_class=fmt,
    )
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser(
        "resolve",
        help="write one validated section of a study config to a file",
        description="Validate the study config, then write SECTION, with every default filled "
        "in, to OUTPUT: the resolved file a stage command reads.",
        formatter_class=fmt,
    )
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--section", required=True)
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(func=cmd_resolve)

    p = sub.add_parser(
        "config-doc",
        help="list every config key with its type, default and meaning",
        description="Print every key of the study config with type, default and documentation "
        "(or, with --schema, the JSON schema Snakemake validates config/config.yaml with).",
        formatter_class=fmt,
    )
    p.add_argument("--schema", action="store_true", help="print the JSON schema as YAML")
    p.set_defaults(func=cmd_config_doc)

    def report_args(p, out_help):
        p.add_argument("--runs", default=None,
                       help="directory of cells backbone~*/method~*/beta~*/seed~* to discover")
        p.add_argument("--cells", nargs="+", default=None, metavar="CELL",
                       help="explicit cell directories (or files inside them, e.g. "
                       "eval/summary.json) instead of discovering them under --runs")
        p.add_argument("--config", default=None,
                       help="report config: a resolved `report` section, or a study config "
                       "with --section report (default: the built-in layout of the papers)")
        p.add_argument("--section", default=None, help="read this section of --config")
        p.add_argument("--out", required=True, help=out_help)
        p.add_argument("--study-run", action="store_true",
                       help="also log the outputs into the study's MLflow run (tag "
                       "kind=study), in the store and experiment of the first cell's "
                       "config.yaml; best effort: a tracking failure is a warning")
        p.add_argument("--set", default=None, metavar="NAME",
                       help="with --study-run: the run of grid set NAME, not the study's")

    p = sub.add_parser(
        "tables",
        help="write the papers' tables (main, ablations, β) as Markdown, LaTeX and CSV",
        description="Read every evaluated cell's eval/summary.json and write main, "
        "ablation_a2tgpo, ablation_at2po, credit_at2po and beta tables as .md, .tex (booktabs) "
        "and tidy .csv: methods x test datasets and sample-weighted group averages per "
        "backbone, mean ± sample std over seeds, best per column in bold, and a caption "
        "stating how the checkpoints were selected. Missing cells are left out with a note.",
        formatter_class=fmt,
    )
    report_args(p, "output directory of the tables")
    p.set_defaults(func=cmd_tables)

    p = sub.add_parser(
        "plots",
        help="write the papers' figures (training curves, advantages, tool calls, Jaccard, "
        "time, β) as PNG",
        description="From the cells' metrics.jsonl, rollouts.jsonl and eval/summary.json, "
        "draw per backbone: dev EM, reward and entropy over steps, advantage statistics by "
        "turn position, tool calls per trajectory, same- vs cross-position Jaccard similarity "
        "of turns, seconds per training stage and the β-sensitivity curve, as "
        "<out>/<backbone>/<kind>.png plus <out>/index.json. Plots without data are skipped "
        "with a note.",
        formatter_class=fmt,
    )
    report_args(p, "output directory of the plots")
    p.set_defaults(func=cmd_plots)

    p = sub.add_parser(
        "sweep-trial",
        help="one trial of an Optuna β/γ sweep: ask, train, tell (a DAG job)",
        description="Run trial INDEX of the sweep (config/sweeps/<name>.yaml): create or load "
        "the Optuna study in <results>/<study>/sweeps/<name>/journal.log, fail trials of this "
        "index left RUNNING by a killed job and re-enqueue their β/γ (training then resumes "
        "from the run's checkpoints), ask, train the base config with the trial's β/γ and "
        "the sweep's overrides in trials/INDEX/run, tell the best dev EM, and write "
        "trials/INDEX/result.json atomically.",
        formatter_class=fmt,
    )
    p.add_argument("sweep", help="sweep config file (config/sweeps/<name>.yaml)")
    p.add_argument("--index", type=int, required=True, help="trial index, 0 .. n_trials-1")
    p.add_argument("--base", required=True,
                   help="the base cell's resolved TrainConfig (sweeps/<name>/base.yaml)")
    p.add_argument("--out", default=None,
                   help="result file (default: <results>/<study>/sweeps/<name>/trials/INDEX/"
                   "result.json)")
    p.add_argument("--log", default=None,
                   help="send logging and training output here; stdout keeps one line at the "
                   "trial's start and one at its end")
    p.set_defaults(func=cmd_sweep_trial)

    p = sub.add_parser(
        "sweep-summary",
        help="summarise an Optuna β/γ sweep: best trial, all trials, plots",
        description="Read trials/<i>/result.json of every trial of the sweep and its Optuna "
        "journal, write summary.json (best params and value, every trial, the study's trial "
        "states) and best.png (objective per trial; β/γ scatter coloured by it) into DIR, and "
        "print the table.",
        formatter_class=fmt,
    )
    p.add_argument("sweep", help="sweep config file (config/sweeps/<name>.yaml)")
    p.add_argument("--dir", required=True, help="the sweep's folder (<results>/<study>/sweeps/"
                   "<name>)")
    p.set_defaults(func=cmd_sweep_summary)

    p = sub.add_parser(
        "sync-mlflow",
        help="upload to MLflow what jobs logged only to metrics.jsonl (the store was down)",
        description="Find every job folder (one with tracker.json: a cell's training, its "
        "evaluation, a sweep trial's run) under the given results or run folders and log into "
        "its MLflow run what the run lacks: the run itself (created and linked in "
        "mlflow_run.json), its tags, params and config artifact, the metric points of "
        "metrics.jsonl and summary.json (compared by key and step, so nothing is sent twice) "
        "and its final status. Safe to repeat: a complete run is left alone. Prints a line per "
        "job and a summary; exit 1 if the store does not answer or a job failed.",
        formatter_class=fmt,
    )
    p.add_argument("paths", nargs="+", metavar="DIR",
                   help="a results folder (results/<study>) or job folders")
    p.add_argument("--tracking-uri", default=None,
                   help="store to upload to (default: each job's tracking.tracking_uri, or its "
                   "study's sqlite file)")
    p.add_argument("--experiment", default=None,
                   help="experiment for runs not yet in the store (default: each job's "
                   "tracking.experiment, or its study name)")
    p.set_defaults(func=cmd_sync_mlflow)
    return parser


def _user_errors() -> tuple[type[Exception], ...]:
    from a2tgpo.data.jsonl import DataFileError
    from a2tgpo.io import WriteFailed
    from a2tgpo.ops.lock import FolderBusy
    from a2tgpo.retrieval.http import RetrieverError
    from a2tgpo.retrieval.index import IndexMismatch

    errors = (IndexMismatch, RetrieverError, FolderBusy, WriteFailed, DataFileError)
    if "a2tgpo.model.copy_pretrain" in sys.modules:  # only toy-backbone builds raise it
        errors += (sys.modules["a2tgpo.model.copy_pretrain"].CopyPretrainFailed,)
    return errors


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line as `main` reads it (the README's commands are checked through this)."""
    argv = list(argv)
    passthrough: list[str] = []
    # rerun ... -- <snakemake arguments>; with-retriever / launch / rehearse ... -- <command>
    if argv and {"rerun", "with-retriever", "launch", "rehearse"} & set(argv) and "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # dotted overrides anywhere after CONFIG, also after options (`world CONFIG --section world
    # seed=3 --out DIR people=200`): argparse alone takes them only right after CONFIG
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and not isinstance(getattr(args, "overrides", None), list)):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    args.passthrough = passthrough
    if passthrough:
        args.snakemake_args = passthrough
    return args


def main(argv: list[str] | None = None) -> int:
    import sys

    from a2tgpo.ops import joblog

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if getattr(args, "log", None):  # sweep-trial --log: the job's log is that file, header too
        from a2tgpo.sweep import redirect_to_log

        redirect_to_log(args.log)
    joblog.setup_logging(args.verbose)
    if joblog.header_due(mark=args.command in WRAPPERS):
        joblog.begin(_job_title(args), ["a2tgpo", *argv], _job_config(args))
    # a job started by the workflow ends with the Snakemake that started it (no orphans); the
    # retrieval server stops gracefully on SIGINT (it holds on through SIGTERM)
    from a2tgpo.ops.preemption import watch_anchor

    watch_anchor(signal.SIGINT if args.command == "serve-retriever" else signal.SIGTERM)
    start = time.perf_counter()
    rc = 1  # an exception other than those below: its traceback follows the closing line
    try:
        rc = args.func(args)
    except ConfigError as e:
        print(f"a2tgpo {args.command}: config error: {e}", file=sys.stderr)
        rc = 2
    except (FileNotFoundError, MemoryError, *_user_errors()) as e:
        # problems of the inputs, not of the code: a message, not a traceback
        print(f"a2tgpo {args.command}: error: {e}", file=sys.stderr)
        rc = 1
    except SystemExit as e:  # a training job stopped for its time limit (exit 75)
        rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        raise
    finally:
        if os.environ.get("RANK", "0") == "0":
            joblog.end(args.command, rc, time.perf_counter() - start,
                       getattr(args, "summary", None), getattr(args, "out", None))
    return rc


# commands that run another a2tgpo command into their own log: its header is theirs
WRAPPERS = ("with-retriever", "launch")


def _job_title(args) -> str:
    """`train` for `with-retriever CFG -- a2tgpo launch ... -- a2tgpo train CFG`: the job a
    wrapper runs; the command itself otherwise."""
    words = getattr(args, "passthrough", None) or []
    if args.command in WRAPPERS:
        inner = [w for prev, w in itertools.pairwise(words) if Path(prev).name == "a2tgpo"]
        if inner:
            return f"{inner[-1]} (through {args.command})"
    return args.command


def _job_config(args) -> str | None:
    """The job's config file, for its log's header: CONFIG, --config, or a cell folder's."""
    config = getattr(args, "config", None)
    if isinstance(config, str):
        return config
    cell = getattr(args, "cell", None)
    if isinstance(cell, str) and (Path(cell) / "config.yaml").is_file():
        return str(Path(cell) / "config.yaml")
    return None


if __name__ == "__main__":
    sys.exit(main())
