"""The study's MLflow run (a2tgpo/report/study_run.py) against a real sqlite store: the tables
and plots as artifacts of one run tagged kind=study, a set's run beside it, rewritten files
replaced, two report jobs at once making one run, and `sync-mlflow` replaying an offline one."""

import json
import threading

import pytest

from a2tgpo.cli import main
from a2tgpo.report.study_run import log_outputs, study_run_dir
from a2tgpo.tracking import RUN_LINK_FILE, TrackingConfig, init_experiment, resolve_tracking_uri

STUDY = "unit_study"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from mlflow import MlflowClient

    results = tmp_path_factory.mktemp("results")
    init_experiment(TrackingConfig(), study=STUDY, results_dir=results)
    return results, MlflowClient(tracking_uri=resolve_tracking_uri(TrackingConfig(), results))


def outputs(root, results, mlflow=True):
    """Two cells whose config.yaml names the study and `results`, and what `a2tgpo tables` and
    `a2tgpo plots` would have written: 2 default tables and a set's table below them, a plot
    per backbone panel and plots/index.json."""
    cells = [root / "runs" / f"seed~{s}" for s in (1, 2)]
    for cell in cells:
        cell.mkdir(parents=True)
        (cell / "config.yaml").write_text(
            f"study: {STUDY}\nresults_dir: {results}\n"
            f"tracking:\n  mlflow: {str(mlflow).lower()}\n  tracking_uri: "
            f"{resolve_tracking_uri(TrackingConfig(), results)}\n")
    tables, plots = root / "tables", root / "plots"
    (tables / "mini").mkdir(parents=True)
    (tables / "main.md").write_text("| method | EM |\n")
    (tables / "main.csv").write_text("method,em\n")
    (tables / "mini" / "main.md").write_text("a set's table: not the study run's\n")
    (plots / "toy").mkdir(parents=True)
    (plots / "toy" / "dev_em.png").write_bytes(b"\x89PNG")
    (plots / "index.json").write_text("{}")
    return cells, tables, plots


def artifacts(client, run_id, path=None):
    """Every file of a run under `path`, recursively."""
    out = []
    for a in client.list_artifacts(run_id, path):
        out += artifacts(client, run_id, a.path) if a.is_dir else [a.path]
    return sorted(out)


def study_runs(client):
    exp = client.get_experiment_by_name(STUDY)
    return client.search_runs([exp.experiment_id], "tags.kind = 'study'")


def test_tables_and_plots_go_to_one_study_run_and_a_set_to_its_own(store, tmp_path):
    results, client = store
    cells, tables, plots = outputs(tmp_path, results)
    run_id = log_outputs(cells, tables, "tables")
    assert log_outputs(cells, plots, "plots") == run_id  # the same run, found by its link
    run = client.get_run(run_id)
    assert run.info.run_name == f"study · {STUDY}" and run.info.status == "FINISHED"
    assert run.data.tags["kind"] == "study" and run.data.tags["study"] == STUDY
    # 2 tables (the set's table below them is not the study's) + 2 plot files
    assert artifacts(client, run_id) == ["plots/index.json", "plots/toy/dev_em.png",
                                         "tables/main.csv", "tables/main.md"]
    assert json.loads((study_run_dir(results) / RUN_LINK_FILE).read_text())["run_id"] == run_id

    # the rules run again: the same run, its table replaced
    (tables / "main.md").write_text("| method | EM |\n| grpo | 0.5 |\n")
    assert log_outputs(cells, tables, "tables") == run_id
    local = client.download_artifacts(run_id, "tables/main.md", str(tmp_path / "down"))
    assert open(local).read().endswith("| grpo | 0.5 |\n")

    set_id = log_outputs(cells, tables / "mini", "tables", "mini")
    assert set_id != run_id
    set_run = client.get_run(set_id)
    assert set_run.info.run_name == f"study · {STUDY} · set mini"
    assert set_run.data.tags["set"] == "mini" and set_run.data.tags["kind"] == "study"
    assert artifacts(client, set_id) == ["tables/main.md"]
    assert {run_id, set_id} <= {r.info.run_id for r in study_runs(client)}


def test_two_report_jobs_at_once_make_one_study_run(tmp_path):
    # the tables and plots rules may run at the same time: the lock lets one create the run
    results = tmp_path / "results"  # a store of its own: a study run of its own
    init_experiment(TrackingConfig(), study=STUDY, results_dir=results)
    cells, tables, plots = outputs(tmp_path, results)
    ids, start = [], threading.Barrier(2)

    def job(folder, what):
        start.wait()
        ids.append(log_outputs(cells, folder, what))

    threads = [threading.Thread(target=job, args=a) for a in ((tables, "tables"),
                                                              (plots, "plots"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == 2 and ids[0] == ids[1] and ids[0] is not None
    from mlflow import MlflowClient

    local = MlflowClient(tracking_uri=resolve_tracking_uri(TrackingConfig(), results))
    exp = local.get_experiment_by_name(STUDY)
    assert len(local.search_runs([exp.experiment_id], "tags.kind = 'study'")) == 1


def test_sync_replays_an_offline_study_run(store, tmp_path, capsys):
    results, client = store
    offline = tmp_path / "results"
    cells, tables, plots = outputs(tmp_path, offline, mlflow=False)
    assert log_outputs(cells, tables, "tables") is None  # MLflow off: the records only
    assert log_outputs(cells, plots, "plots") is None
    assert not (study_run_dir(offline) / RUN_LINK_FILE).exists()
    uri = resolve_tracking_uri(TrackingConfig(), results)
    assert main(["sync-mlflow", str(offline / "mlflow"), "--tracking-uri", uri]) == 0
    # the first job (plots/, in path order) creates the run, the other adds to it
    assert "2 jobs synced into 1 runs (1 created)" in capsys.readouterr().out
    run_id = json.loads((study_run_dir(offline) / RUN_LINK_FILE).read_text())["run_id"]
    assert client.get_run(run_id).data.tags["kind"] == "study"
    assert artifacts(client, run_id) == ["plots/index.json", "plots/toy/dev_em.png",
                                         "tables/main.csv", "tables/main.md"]


def test_set_without_study_run_is_refused(tmp_path, capsys):
    assert main(["tables", "--runs", str(tmp_path), "--out", str(tmp_path / "t"),
                 "--set", "x"]) == 2
    assert "--set names the grid set of --study-run" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def _study_cell(make_cell, results, tracking):
    cell = make_cell("toy", "grpo", "0", 1, datasets={"nq": (0.5, "single_hop")},
                     groups={"single_hop": 0.5, "all": 0.5})
    (cell / "config.yaml").write_text(f"study: {STUDY}\nresults_dir: {results}\n"
                                      f"tracking: {json.dumps(tracking)}\n")
    return cell


def test_tables_command_logs_what_it_wrote_into_the_study_run(store, make_cell, tmp_path,
                                                              capsys):
    # what the tables rule runs (workflow/rules/report.smk)
    results, client = store
    uri = resolve_tracking_uri(TrackingConfig(), results)
    cell = _study_cell(make_cell, tmp_path / "r", {"tracking_uri": uri})
    out = tmp_path / "tables"
    assert main(["tables", "--cells", str(cell), "--out", str(out), "--study-run"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines()
               if x.startswith("tables logged to the study's MLflow run ")]
    run_id = line.split()[-1]
    assert client.get_run(run_id).data.tags["kind"] == "study"
    written = sorted(f"tables/{p.name}" for p in out.iterdir())
    assert "tables/main.md" in written and artifacts(client, run_id) == written


def test_a_broken_tracking_config_leaves_the_tables_written(make_cell, tmp_path, caplog,
                                                           capsys):
    cell = _study_cell(make_cell, tmp_path / "r", {"log_every": 0})  # not a valid setting
    out = tmp_path / "tables"
    assert main(["tables", "--cells", str(cell), "--out", str(out), "--study-run"]) == 0
    assert (out / "main.md").is_file()
    logged = "\n".join(r.getMessage() for r in caplog.records) + capsys.readouterr().err
    assert "the study's MLflow run was not updated" in logged and "log_every" in logged
