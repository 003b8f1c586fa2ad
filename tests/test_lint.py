"""Lint as part of the suite: ruff over the Python code, snakefmt and `snakemake --lint` over the
workflow. The tools are pinned in requirements/test.txt and configured in pyproject.toml; each
test shows the tool's own output when it fails.

Not checked: `ruff format`. The code is not in ruff-format (black) style and reformatting all of
it is not worth the churn, so Python is linted only. The Snakefile and workflow/rules/*.smk are
snakefmt-formatted (`./run snakefmt Snakefile workflow/rules/` applies it)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PYTHON_PATHS = ["a2tgpo", "tests", "bench", "scripts"]
SNAKE_PATHS = ["Snakefile", "workflow/rules/"]


def tool(name, *args, cwd=ROOT, timeout=300):
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    return subprocess.run([str(BIN / name), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_ruff_check():
    # --no-cache: a test run writes nothing into the checkout
    r = tool("ruff", "check", "--no-cache", "--output-format", "concise", *PYTHON_PATHS)
    if r.returncode != 0:
        pytest.fail(f"`ruff check {' '.join(PYTHON_PATHS)}` found problems "
                    f"(`./run ruff check --fix PATH` applies the safe fixes):\n"
                    f"{r.stdout}{r.stderr}", pytrace=False)


def test_snakefmt_check():
    r = tool("snakefmt", "--check", *SNAKE_PATHS)
    if r.returncode != 0:
        diff = tool("snakefmt", "--diff", *SNAKE_PATHS)
        pytest.fail(f"snakefmt would reformat the workflow (`./run snakefmt "
                    f"{' '.join(SNAKE_PATHS)}` applies it; review the diff first: a changed "
                    f"shell: or run: text reruns that rule's jobs):\n{r.stderr}\n{diff.stdout}"
                    f"{diff.stderr}", pytrace=False)


# `snakemake --lint` reports three kinds of advice this workflow does not follow, on purpose.
# Every other kind (and a missing log on any other rule) fails the test: fix it, or add it here
# with the reason.
DELIBERATE_LINTS = {
    # Every rule runs the `a2tgpo` CLI of the one pinned environment (`./run`, requirements/*.txt),
    # locally and on SLURM alike; a conda env or container per rule would duplicate those locks.
    "Specify a conda environment or container for each rule.",
    # R is the study's results root (results/<study>) that every input and output path starts
    # with, so it carries no provenance of its own: changing it changes the outputs' paths.
    # Passing it through params would also change every shell command's text, which Snakemake
    # counts as a code change: every finished job of every study would rerun.
    "Shell command directly uses variable R from outside of the rule",
}
# run: rules that write one small file in-process (localrule); they print nothing to log.
RUN_RULES_WITHOUT_LOG = {"resolve_section", "track_data_config", "cell_config",
                         "sweep_base_config"}


def parse_lints(text):
    """(item, title) per lint in `snakemake --lint` text output. Items: 'rule NAME' or
    'snakefile PATH'. Line numbers in titles become N, so a kind does not change when code moves.
    (The text output is parsed because snakemake 9.27.1's CLI ignores `--lint json`.)"""
    lints, item = [], None
    for line in text.splitlines():
        if m := re.match(r"Lints for (rule \S+|snakefile .+?)( \(line \d+, .*\))?:$", line):
            item = m.group(1)
        elif item and (m := re.match(r"    \* (.+):$", line)):
            lints.append((item, re.sub(r"\bline \d+", "line N", m.group(1))))
    return lints


def test_snakemake_lint_reports_only_deliberate_lints(workdir):
    r = tool("snakemake", "--lint", cwd=workdir)  # the default (toy) study config
    out = (r.stdout + r.stderr).replace(f"{workdir}/", "")
    lints = parse_lints(out)
    if r.returncode != 0 and not lints:
        pytest.fail(f"`snakemake --lint` failed without lints:\n{out}", pytrace=False)
    unexpected = sorted({
        f"{item}: {title}" for item, title in lints
        if title not in DELIBERATE_LINTS
        and not (title == "No log directive defined"
                 and item.removeprefix("rule ") in RUN_RULES_WITHOUT_LOG)
    })
    if unexpected:
        pytest.fail("`snakemake --lint` reports lints not listed as deliberate in "
                    "tests/test_lint.py:\n  " + "\n  ".join(unexpected)
                    + f"\n\nfull output:\n{out}", pytrace=False)
    # the exceptions stay exact: one that no longer applies is removed from the lists above
    stale = (DELIBERATE_LINTS - {title for _, title in lints}) | (
        RUN_RULES_WITHOUT_LOG - {item.removeprefix("rule ") for item, title in lints
                                 if title == "No log directive defined"})
    assert not stale, f"listed as deliberate but no longer reported: {sorted(stale)}"
