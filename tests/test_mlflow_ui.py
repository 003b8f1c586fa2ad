"""The MLflow UI shows a study's runs table, with run names that put method, β and seed first.

scripts/mlflow_screenshot.sh makes a small store the way training does (a2tgpo.tracking, run
names from Cell.display_name), serves it with `mlflow ui` on 127.0.0.1 and loads two pages in
headless Chromium, keeping each page's DOM after its scripts ran. The test reads those DOMs.

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
RUN_NAMES = ["a2tgpo β=0.3 seed 1 · toy", "a2tgpo β=0.3 seed 2 · toy", "grpo β=0 seed 1 · toy"]


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


@pytest.mark.expensive  # `mlflow ui` and two Chromium page loads: ~20 s on 2 idle cores
def test_runs_page_shows_the_runs_with_method_first(tmp_path):
    binary = chromium()
    if binary is None:
        pytest.skip("no chromium binary on PATH (apt-get install -y chromium, or set CHROMIUM)")
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], env={**os.environ,
                       "CHROMIUM": binary}, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, f"{SCRIPT.name} failed:\n{r.stdout}{r.stderr[-3000:]}"
    title, text = page(tmp_path / "runs.html")
    assert title.startswith("Runs - "), f"the runs link opened {title!r}, not the runs table"
    assert "3 matching runs" in text and "Run Name" in text, text[:2000]
    names = re.findall(r"\b\w+ β=[\d.]+ seed \d+ · toy", text)
    assert sorted(set(names)) == RUN_NAMES, names
    assert "Detect Issues" not in text and "No data available" not in text  # traces overview
