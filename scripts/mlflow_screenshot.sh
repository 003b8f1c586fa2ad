#!/usr/bin/env bash
# What the MLflow UI shows for a study: screenshots of its experiment page, taken in headless
# Chromium, of a small store made the way training makes it (a2tgpo.tracking: init_experiment,
# then one Tracker per run), so a person can see what a study opens on without a real run.
#
#   scripts/mlflow_screenshot.sh [OUT_DIR]       # default OUT_DIR: a new folder under /tmp
#   NO_KIND_TAG=1 scripts/mlflow_screenshot.sh   # the same with the experiment's
#                                                # mlflow.experimentKind tag removed afterwards
#
# Five pages, each as OUT_DIR/<page>.png (1400x900) and OUT_DIR/<page>.html (the DOM after the
# page's scripts ran, for checks: tests/test_mlflow_ui.py), their addresses in OUT_DIR/urls:
#
#   runs        #/experiments/<id>?workflowType=machine_learning: the runs table. MLflow 3.17's
#               UI picks an experiment's page by the sidebar's GenAI / Model training switch
#               (this URL parameter, else what the browser last chose, else GenAI), not by
#               the experiment's mlflow.experimentKind tag.
#   experiment  #/experiments/<id>, the experiment list's link, in a browser that never chose:
#               the GenAI overview (empty traces charts) with MLflow 3.17.2.
#   grouped     the runs table grouped by the `method` tag, each method's row the average over
#               its seeds, filtered to the backbone (docs/mlflow.md, "Methods over seeds"):
#               #/experiments/<id>/runs?viewStateShareKey=by_method, a view saved in the tag
#               mlflow.sharedViewState.by_method as the UI's "Save view" saves one (the page's
#               state: groupBy, selectedColumns, searchFilter, chartsSearchFilter)
#   grouped_charts  the same in the chart view (&compareRunsMode=CHART): a line per method, the
#               mean of its seeds with a min-max band; the EM charts only
#   artifacts   the first run's Artifacts tab opened on its predictions file
#               (#/experiments/<id>/runs/<run id>/artifacts/eval/multi_hop.predictions.jsonl): the
#               evidence folders training and evaluation log (rollouts/, eval/; one small file
#               in each) and the file's text
#
# The store has four runs, two methods x two seeds, with five steps of train/reward and val/em
# and a test/multi_hop/em summary, named by a2tgpo.cell.Cell.display_name as training names
# them: "a2tgpo β=0.3 seed 1 · toy", "a2tgpo β=0.3 seed 2 · toy", "grpo β=0 seed 1 · toy" and
# "grpo β=0 seed 2 · toy". It and the server's log stay in OUT_DIR/store/ and OUT_DIR/server.log.
# The server (`mlflow ui` from .venv, through ./run) listens on 127.0.0.1 only, on a free port,
# and is stopped before the script ends, also when it fails or is interrupted. Needs Debian's
# chromium (`apt-get install -y chromium`); CHROMIUM=/path/to/chrome picks another binary.
# About 30 s on 2 idle cores.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$(mktemp -d /tmp/mlflow_screenshot.XXXXXX)}"
CHROMIUM="${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}"
[[ -n $CHROMIUM ]] || { echo "mlflow_screenshot: no chromium binary (apt-get install -y chromium, or set CHROMIUM)" >&2; exit 2; }
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
STORE="$OUT/store"
rm -rf "$STORE" && mkdir -p "$STORE"

# the store, as the DAG's experiment rule and training jobs write it; prints the experiment id
IDS="$(cd "$ROOT" && NO_KIND_TAG="${NO_KIND_TAG:-}" ./run python - "$STORE" <<'EOF'
import json, logging, os, sys, time
from pathlib import Path

from a2tgpo.cell import Cell
from a2tgpo.eval.evaluate import EVIDENCE_DIR
from a2tgpo.tracking import EXPERIMENT_KIND, Tracker, TrackingConfig, init_experiment

logging.disable(logging.WARNING)
store = Path(sys.argv[1])
cfg = TrackingConfig()
exp_id = init_experiment(cfg, study="toy", results_dir=store)
first_run = None
for cell, shift in [(Cell("toy", "a2tgpo", 0.3, 1), 0.10), (Cell("toy", "a2tgpo", 0.3, 2), 0.06),
                    (Cell("toy", "grpo", 0.0, 1), 0.0), (Cell("toy", "grpo", 0.0, 2), -0.04)]:
    # named and tagged as training names and tags its runs (a2tgpo.train.rl.run_name)
    with Tracker(store / "runs" / cell.path, cfg, study="toy", results_dir=store,
                 run_name=cell.display_name,
                 tags={"backbone": cell.backbone, "method": cell.method, "beta": cell.beta,
                       "seed": cell.seed, "cell": cell.path},
                 params={"method": cell.method, "seed": cell.seed}) as t:
        for step in range(1, 6):
            t.log({"train/reward": 0.1 * step + shift, "val/em": 0.05 * step + shift}, step)
        t.summary({"test/multi_hop/em": 0.3 + shift})
        if first_run is None:
            # the evidence a cell's run carries, under the folders training and evaluation log
            # it to: a rollout sample and the test set's predictions (one line each)
            first_run = t.run_id
            evidence = store / "evidence"
            (evidence / "rollouts").mkdir(parents=True)
            (evidence / EVIDENCE_DIR).mkdir()
            (evidence / "rollouts/step_5.json").write_text(json.dumps(
                {"step": 5, "groups": [{"question": "Who founded Arvel?", "trajectories": []}]}))
            (evidence / EVIDENCE_DIR / "multi_hop.predictions.jsonl").write_text(json.dumps(
                {"question": "Who founded Arvel?", "gold": ["Ilsa Morn"],
                 "prediction": "Ilsa Morn", "em": 1.0, "outcome": "correct"}) + "\n")
            t.log_artifact(evidence / "rollouts/step_5.json", "rollouts")
            t.log_artifact(evidence / EVIDENCE_DIR / "multi_hop.predictions.jsonl", EVIDENCE_DIR)
from mlflow import MlflowClient

client = MlflowClient(tracking_uri=f"sqlite:///{store.resolve() / 'mlflow.db'}")
# docs/mlflow.md's comparison as a saved view (the runs page's Views list): the tag the UI's "Save
# view" writes, {name, createdAt, updatedAt, state}, state being the page's state as JSON text
view = {"searchFilter": 'tags.backbone = "toy"',
        "groupBy": {"aggregateFunction": "average",
                    "groupByKeys": [{"mode": "tag", "groupByData": "method"}]},
        "selectedColumns": ["metrics.`val/em`", "metrics.`test/multi_hop/em`", "tags.`seed`"],
        "chartsSearchFilter": "em"}
now = int(time.time() * 1000)
client.set_experiment_tag(exp_id, "mlflow.sharedViewState.by_method", json.dumps(
    {"name": "methods over seeds", "createdAt": now, "updatedAt": now, "state": json.dumps(view)}))
if os.environ.get("NO_KIND_TAG"):
    for key in EXPERIMENT_KIND:
        client.delete_experiment_tag(exp_id, key)
print(exp_id, first_run, f"{EVIDENCE_DIR}/multi_hop.predictions.jsonl")
EOF
)"
read -r EXP_ID RUN_ID EVIDENCE_FILE <<< "$IDS"

PORT="$("$ROOT/.venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
EXP_URL="http://127.0.0.1:$PORT/#/experiments/$EXP_ID"
RUNS_URL="$EXP_URL?workflowType=machine_learning"
# the link the UI's "Save view" gives (the runs tab's own route; /experiments/<id> drops it)
GROUPED_URL="$EXP_URL/runs?viewStateShareKey=by_method"
CHARTS_URL="$GROUPED_URL&compareRunsMode=CHART"
ARTIFACTS_URL="$EXP_URL/runs/$RUN_ID/artifacts/$EVIDENCE_FILE?workflowType=machine_learning"
printf 'runs %s\nexperiment %s\ngrouped %s\ngrouped_charts %s\nartifacts %s\n' "$RUNS_URL" \
    "$EXP_URL" "$GROUPED_URL" "$CHARTS_URL" "$ARTIFACTS_URL" > "$OUT/urls"

# its own process group, so stopping it stops its workers too; one worker and no job runner
# (judges, issue detection): the pages shown do not use them, and it starts faster
MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid "$ROOT/run" mlflow ui \
    --backend-store-uri "sqlite:///$STORE/mlflow.db" --host 127.0.0.1 --port "$PORT" \
    --workers 1 > "$OUT/server.log" 2>&1 &
SERVER=$!
stop() { kill -- "-$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; }
trap stop EXIT

healthy() {
    "$ROOT/.venv/bin/python" -c "import urllib.request as u; u.urlopen('$1', timeout=2)" 2>/dev/null
}
for i in $(seq 241); do  # up to 120 s
    healthy "http://127.0.0.1:$PORT/health" && break
    kill -0 "$SERVER" 2>/dev/null || { echo "mlflow_screenshot: the server exited; see $OUT/server.log" >&2; exit 1; }
    [[ $i -lt 241 ]] || { echo "mlflow_screenshot: no answer from the server in 120 s; see $OUT/server.log" >&2; exit 1; }
    sleep 0.5
done

# a fresh profile per page: the UI remembers the GenAI / Model training choice in the browser
shoot() {  # shoot PAGE URL
    "$CHROMIUM" --headless --no-sandbox --disable-gpu --user-data-dir="$OUT/chromium-$1" \
        --virtual-time-budget=15000 --window-size=1400,900 \
        --screenshot="$OUT/$1.png" --dump-dom "$2" 2>> "$OUT/chromium.log" > "$OUT/$1.html"
    rm -rf "$OUT/chromium-$1"
}
shoot runs "$RUNS_URL"
shoot experiment "$EXP_URL"
shoot grouped "$GROUPED_URL"
shoot grouped_charts "$CHARTS_URL"
shoot artifacts "$ARTIFACTS_URL"
stop
trap - EXIT

echo "experiment $EXP_ID of $STORE/mlflow.db (server stopped)"
echo "runs table:      $OUT/runs.png       ($RUNS_URL)"
echo "experiment page: $OUT/experiment.png ($EXP_URL)"
echo "by method:       $OUT/grouped.png    ($GROUPED_URL)"
echo "by method chart: $OUT/grouped_charts.png ($CHARTS_URL)"
echo "run artifacts:   $OUT/artifacts.png  ($ARTIFACTS_URL)"
