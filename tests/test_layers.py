"""The package's layers (pyproject.toml, [tool.importlinter]; DESIGN §2) as part of the suite.

`lint-imports` (import-linter, pinned in requirements/test.txt) checks the contracts over the
package, and over a copy of it given one import that breaks a contract, which it must refuse:
an upward import at module level, one inside a function, one under `if TYPE_CHECKING:` (none of
these hides a cycle from the linter), a new module the order does not place, and a model
library imported into algo. The copy is linted from its own folder, which import-linter puts
first on the path, so the chain it reports (module, line) comes from the copy.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    # --no-cache: a test run writes nothing into the checkout; wide columns: rich does not wrap
    # the chains it prints
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "PYTHONPATH": str(cwd)}
    return subprocess.run([str(BIN / "lint-imports"), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_package_keeps_its_layer_contracts():
    r = lint_imports(ROOT)
    assert r.returncode == 0, (
        f"`lint-imports` found imports against the layer order in pyproject.toml "
        f"([tool.importlinter]; DESIGN §2 says where each concept lives):\n{r.stdout}{r.stderr}")
    assert "Contracts: 2 kept, 0 broken." in r.stdout, r.stdout


@pytest.fixture
def package_copy(tmp_path):
    """A copy of the package and its pyproject.toml, to break on purpose."""
    shutil.copytree(ROOT / "a2tgpo", tmp_path / "a2tgpo",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_lines(path: Path, after: str, lines: str) -> int:
    """Insert `lines` after the first line that starts with `after`; returns the 1-based line
    number of the first inserted line."""
    text = path.read_text().splitlines(keepends=True)
    i = next(n for n, line in enumerate(text) if line.startswith(after))
    text[i + 1:i + 1] = [lines]
    path.write_text("".join(text))
    return i + 2


# (file, the line to insert after, the inserted lines, the line of the import within them,
#  what the report must say)
BREAKS = {
    # the cycle the layers ended: the rollout loop typed by the training config
    "module level": ("a2tgpo/rollout/agent.py", "from a2tgpo.rollout.engine import",
                     "from a2tgpo.train.config import TrainConfig  # noqa: F401\n", 0,
                     "a2tgpo.rollout.agent -> a2tgpo.train.config"),
    # process control reaching up into the recipe, hidden in a function
    "inside a function": ("a2tgpo/ops/preemption.py", "log = logging.getLogger",
                          "\n\ndef _peek():\n    from a2tgpo.train import rl\n\n    return rl\n",
                          3, "a2tgpo.ops.preemption -> a2tgpo.train.rl"),
    "under TYPE_CHECKING": ("a2tgpo/retrieval/retriever.py", "from __future__ import",
                            ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from a2tgpo.rollout.agent import AgentConfig\n"), 2,
                            "a2tgpo.retrieval.retriever -> a2tgpo.rollout.agent"),
    # siblings in one layer (`algo | ops | cell`) import nothing of each other
    "between independent siblings": ("a2tgpo/algo/masks.py", "from __future__ import",
                                     "from a2tgpo.ops.lock import folder_lock  # noqa: F401\n",
                                     0, "a2tgpo.algo.masks -> a2tgpo.ops.lock"),
    "a model library into algo": ("a2tgpo/algo/masks.py", "from __future__ import",
                                  "import transformers  # noqa: F401\n", 0,
                                  "a2tgpo.algo.masks -> transformers"),
}


@pytest.mark.parametrize("case", list(BREAKS))
def test_an_import_against_the_order_is_refused(package_copy, case):
    file, after, lines, offset, chain = BREAKS[case]
    line = add_lines(package_copy / file, after, lines) + offset
    r = lint_imports(package_copy)
    assert r.returncode == 1, f"{case}: not refused\n{r.stdout}{r.stderr}"
    assert f"{chain} (l.{line})" in r.stdout, r.stdout
    assert "Contracts: 1 kept, 1 broken." in r.stdout, r.stdout


def test_a_module_the_order_does_not_place_is_refused(package_copy):
    (package_copy / "a2tgpo" / "helpers.py").write_text('"""Somewhere, undecided."""\n')
    r = lint_imports(package_copy)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "The following modules are not listed as layers:" in r.stdout, r.stdout
    assert "a2tgpo.helpers" in r.stdout, r.stdout
