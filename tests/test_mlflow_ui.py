"""The MLflow UI shows a study's runs table, with run names that put method, β and seed first.

scripts/mlflow_screenshot.sh makes a small store the way training does (a2tgpo.tracking, run
names from Cell.display_name), serves it with `mlflow ui` on 127.0.0.1 and loads five pages in
headless Chromium (the runs table, the experiment link, the runs grouped by method, its chart
view, one run's artifacts), keeping each page's DOM after its scripts ran. The test reads those
DOMs.

MLflow 3.17's UI opens an experiment on the page of its sidebar switch (GenAI / Model
training): the URL's `workflowType` parameter, else the browser's last choice, else GenAI, whose
page is the traces overview. The experiment's `mlflow.experimentKind` tag does not change that,
so the address that shows the runs table carries `?workflowType=machine_learning`.
"""

import html
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "mlflow_screenshot.sh"
RUN_NAMES = ["a2tgpo β=0.3 seed 1 · toy", "a2tgpo β=0.3 seed 2 · toy", "grpo β=0 seed 1 · toy",
             "grpo β=0 seed 2 · toy"]


def chromium() -> str | None:
    return os.environ.get("CHROMIUM") or next(
        (p for name in ("chromium", "chromium-browser") if (p := shutil.which(name))), None)


def page(path: Path) -> tuple[str, str]:
    """(the document's title, its visible text) of a dumped DOM."""
    dom = path.read_text()
    title = re.search(r"<title>(.*?)</title>", dom, re.S)
    text = re.sub(r"<(script|style)\b.*?</\1>|<[^>]+>", " ", dom, flags=re.S)
    return (html.unescape(title.group(1)) if title else "",
            re.sub(r"\s+", " ", html.unescape(text)))


@pytest.mark.expensive  # `mlflow ui` and five Chromium page loads: ~60 s on 2 busy cores
def test_runs_page_shows_the_runs_with_method_first(tmp_path):
    binary = chromium()
    if binary is None:
        pytest.skip("no chromium binary on PATH (apt-get install -y chromium, or set CHROMIUM)")
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], env={**os.environ,
                       "CHROMIUM": binary}, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, f"{SCRIPT.name} failed:\n{r.stdout}{r.stderr[-3000:]}"
    title, text = page(tmp_path / "runs.html")
    assert title.startswith("Runs - "), f"the runs link opened {title!r}, not the runs table"
    assert "4 matching runs" in text and "Run Name" in text, text[:2000]
    names = re.findall(r"\b\w+ β=[\d.]+ seed \d+ · toy", text)
    assert sorted(set(names)) == RUN_NAMES, names
    assert "Detect Issues" not in text and "No data available" not in text  # traces overview

    # docs/mlflow.md's comparison of methods over seeds, opened from its saved view: grouped by the
    # method tag, a method's row the average of its two seeds' test/multi_hop/em (the script
    # logs 0.3 + shift: grpo 0.30 and 0.26, a2tgpo 0.40 and 0.36)
    _, text = page(tmp_path / "grouped.html")
    assert "Group by: method" in text and 'You\'re viewing a shared view' in text, text[:2000]
    assert re.search(r"Group: grpo 2 .* Group: a2tgpo 2 ", text), text[:2000]
    assert "0.28 (average)" in text and "0.38 (average)" in text, text[:3000]
    # the chart view draws a series per method (the group), not per run
    _, text = page(tmp_path / "grouped_charts.html")
    assert "grpo (test/multi_hop/em)" in text and "a2tgpo (test/multi_hop/em)" in text, text
    # a run's Artifacts tab on its predictions file: the evidence folders (the script logs one
    # file in each of rollouts/ and eval/ to the first run) and the file's line
    _, text = page(tmp_path / "artifacts.html")
    assert "a2tgpo β=0.3 seed 1 · toy" in text, text[:2000]
    assert re.search(r"\beval\b.*\brollouts\b", text), text[:3000]
    assert re.search(r'"prediction"\s*:\s*"Ilsa Morn"', text), text[:3000]
