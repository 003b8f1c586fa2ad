#!/usr/bin/env bash
# What the MLflow UI shows for a study: screenshots of its experiment page, taken in headless
# Chromium, of a small store made the way training makes it (a2tgpo.tracking: init_experiment,
# then one Tracker per run), so a person can see what a study opens on without a real run.
#
#   scripts/mlflow_screenshot.sh [OUT_DIR]       # default OUT_DIR: a new folder under /tmp
#   NO_KIND_TAG=1 scripts/mlflow_screenshot.sh   # the same with the experiment's
#                                                # mlflow.experimentKind tag removed afterwards
#
# Two pages, each as OUT_DIR/<page>.png (1400x900) and OUT_DIR/<page>.html (the DOM after the
# page's scripts ran, for checks: tests/test_mlflow_ui.py), their addresses in OUT_DIR/urls:
#
#   runs        #/experiments/<id>?workflowType=machine_learning: the runs table. MLflow 3.17's
#               UI picks an experiment's page by the sidebar's GenAI / Model training switch
#               (this URL parameter, else what the browser last chose, else GenAI), not by
#               the experiment's mlflow.experimentKind tag.
#   experiment  #/experiments/<id>, the experiment list's link, in a browser that never chose:
#               the GenAI overview (empty traces charts) with MLflow 3.17.2.
#
# The store has three runs with five steps of metrics, named by a2tgpo.cell.Cell.display_name as
# training names them: "a2tgpo β=0.3 seed 1 · toy", "a2tgpo β=0.3 seed 2 · toy" and
# "grpo β=0 seed 1 · toy". It and the server's log stay in OUT_DIR/store/ and OUT_DIR/server.log.
# The server (`mlflow ui` from .venv, through ./run) listens on 127.0.0.1 only, on a free port,
# and is stopped before the script ends, also when it fails or is interrupted. Needs Debian's
# chromium (`apt-get install -y chromium`); CHROMIUM=/path/to/chrome picks another binary.
# About 20 s on 2 idle cores.
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
EXP_ID="$(cd "$ROOT" && NO_KIND_TAG="${NO_KIND_TAG:-}" ./run python - "$STORE" <<'EOF'
import logging, os, sys
from pathlib import Path

from a2tgpo.cell import Cell
from a2tgpo.tracking import EXPERIMENT_KIND, Tracker, TrackingConfig, init_experiment

logging.disable(logging.WARNING)
store = Path(sys.argv[1])
cfg = TrackingConfig()
exp_id = init_experiment(cfg, study="toy", results_dir=store)
for cell, shift in [(Cell("toy", "a2tgpo", 0.3, 1), 0.10), (Cell("toy", "a2tgpo", 0.3, 2), 0.08),
                    (Cell("toy", "grpo", 0.0, 1), 0.0)]:
    # named and tagged as training names and tags its runs (a2tgpo.train.rl.run_name)
    with Tracker(store / "runs" / cell.path, cfg, study="toy", results_dir=store,
                 run_name=cell.display_name,
                 tags={"backbone": cell.backbone, "method": cell.method, "beta": cell.beta,
                       "seed": cell.seed, "cell": cell.path},
                 params={"method": cell.method, "seed": cell.seed}) as t:
        for step in range(1, 6):
            t.log({"train/reward": 0.1 * step + shift, "val/em": 0.05 * step + shift}, step)
if os.environ.get("NO_KIND_TAG"):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store.resolve() / 'mlflow.db'}")
    for key in EXPERIMENT_KIND:
        client.delete_experiment_tag(exp_id, key)
print(exp_id)
EOF
)"

PORT="$("$ROOT/.venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
EXP_URL="http://127.0.0.1:$PORT/#/experiments/$EXP_ID"
RUNS_URL="$EXP_URL?workflowType=machine_learning"
printf 'runs %s\nexperiment %s\n' "$RUNS_URL" "$EXP_URL" > "$OUT/urls"

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
stop
trap - EXIT

echo "experiment $EXP_ID of $STORE/mlflow.db (server stopped)"
echo "runs table:      $OUT/runs.png       ($RUNS_URL)"
echo "experiment page: $OUT/experiment.png ($EXP_URL)"
