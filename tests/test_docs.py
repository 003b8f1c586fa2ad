"""Every command the README and docs/*.md show, and every example in `a2tgpo ... --help`, works
as written.

The commands are extracted from the ```bash blocks of README.md and of every page in docs/, and
from the CLI's help texts, and each one must match an entry of CHECKS, which says how it is
checked:

  run     executed (outputs under /tmp go to tmp_path; `rerun` with --dry-run, which resolves
          the study and the one cell its selectors name, and prints what it would run)
  dry     a Snakemake command, run with -n in that copy (the same config parsing, checks and
          DAG; no job runs). Commands of one config and profile share one dry run with all
          their targets
  parse   an `a2tgpo` command that needs what this machine lacks (a cluster, results of a real
          run, another environment): parsed exactly as `a2tgpo` parses it (cli.parse_args);
          `rehearse`'s inner Snakemake command is dry-run too
  serve   a server: started, answered one request, stopped
  env     environment set-up: the script exists and is valid bash, or a PATH change

A documented command no entry matches fails the test, so a new one cannot go unchecked.
"""

import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


BASH_BLOCK = re.compile(r"^\s*```bash\n(.*?)^\s*```", flags=re.M | re.S)


def doc_pages() -> list[Path]:
    """README.md, then every page of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def bash_commands(page: Path) -> list[str]:
    """A page's shell commands: ```bash blocks, continuation lines joined, comments cut."""
    commands = []
    for block in BASH_BLOCK.findall(page.read_text()):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                commands.append(shlex.join(argv))
    return commands


def readme_commands() -> list[str]:
    return bash_commands(ROOT / "README.md")


def documented_commands() -> list[str]:
    """Every page's commands, each once (a page may repeat another's), the README's first."""
    return list(dict.fromkeys(c for page in doc_pages() for c in bash_commands(page)))


def help_commands() -> list[str]:
    """`a2tgpo ...` examples in the help of every subcommand (description and epilog)."""
    from a2tgpo.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    found = []
    for p in sub.choices.values():
        for text in (p.description or "", p.epilog or ""):
            for m in re.finditer(r"(?:^|example: |e\.g\.\n)\s*(a2tgpo [^\n]+)", text, re.M):
                found.append(shlex.join(shlex.split(m.group(1))))
    return list(dict.fromkeys(found))


# (pattern on the command, how it is checked); the first match wins
CHECKS = [
    (r"\./run pytest", "env"),  # the test command itself: .ci/run runs it (checked below)
    (r"(\./run )?snakemake( |$)", "dry"),
    (r"\./run a2tgpo (config-doc|world)( |$)", "run"),
    (r"a2tgpo (world)( |$)", "run"),
    (r"(\./run )?a2tgpo rerun ", "run"),  # with --dry-run: it prints what it would do
    (r"(\./run )?a2tgpo (sync-mlflow|rehearse)( |$)", "parse"),
    (r"\./run mlflow ui ", "serve"),
    (r"\./run optuna-dashboard ", "serve"),  # on a sweep's journal made here
    (r"export '?PATH=", "env"),
    (r"bash scripts/\S+\.sh", "env"),
    (r"\.venv-gpu/bin/python -m pytest -m gpu", "env"),
]


def how(command: str) -> str | None:
    return next((kind for pattern, kind in CHECKS if re.match(pattern, command)), None)


def test_every_documented_command_has_a_check():
    # the README's first two commands are the contract: the main job, then the tests
    assert readme_commands()[:2] == ["./run snakemake", "./run pytest"]
    assert "./run pytest" in (ROOT / ".ci/run").read_text()
    found = {page.relative_to(ROOT).as_posix(): bash_commands(page) for page in doc_pages()}
    found["a2tgpo ... --help"] = help_commands()
    assert sum(map(len, found.values())) >= 20, found  # the extraction finds the blocks
    unchecked = [f"{where}: {c}" for where, commands in found.items() for c in commands
                 if how(c) is None]
    assert not unchecked, f"documented commands with no check in CHECKS: {unchecked}"


def test_every_bash_block_of_every_page_is_read():
    # a shell fence the pattern misses (```sh, ```console, text after the language) would
    # hide its commands from every test here
    for page in doc_pages():
        text = page.read_text()
        fences = re.findall(r"^[ \t]*```(?:bash|sh|shell|console|zsh)\b.*$", text, flags=re.M)
        assert len(BASH_BLOCK.findall(text)) == len(fences), f"{page}: {fences}"
    assert any("docs" in page.parts for page in doc_pages())


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_resolve():
    # a page moved or a heading renamed leaves its links behind: each relative link must name a
    # file of the checkout and, with #anchor, a heading of that page
    broken = []
    for page in doc_pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):  # http(s):, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


COMMAND = r"`(\./run\b|\.venv-\w+/bin/|bash |\.ci/run)[^`]*`"
DATE = r"\b20\d\d-\d\d-\d\d\b"


def test_every_result_names_its_command_and_date():
    # docs/results.md: each section says what reproduces its numbers and when it was measured
    sections = re.split(r"^## ", (ROOT / "docs/results.md").read_text(), flags=re.M)[1:]
    assert len(sections) >= 5
    for section in sections:
        title = section.splitlines()[0]
        assert re.search(COMMAND, section), f"docs/results.md, {title!r}: no command"
        assert re.search(DATE, section), f"docs/results.md, {title!r}: no date"
    # a dated measurement in the README names its command in the same paragraph
    for paragraph in re.split(r"\n\s*\n", (ROOT / "README.md").read_text()):
        if re.search(DATE, paragraph):
            assert re.search(COMMAND, paragraph), f"README.md: no command in {paragraph!r}"


def _local(command: str, tmp_path: Path) -> list[str]:
    """argv of a documented command for this machine: ./run's environment, outputs in tmp."""
    argv = shlex.split(command.replace("/tmp/", f"{tmp_path}/"))
    if argv[0] == "./run":
        argv = argv[1:]
    return [str(BIN / argv[0]) if (BIN / argv[0]).exists() else argv[0], *argv[1:]]


def _env():
    return {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}


def test_documented_parse_commands_parse(tmp_path):
    from a2tgpo.cli import parse_args

    for command in documented_commands() + help_commands():
        if how(command) != "parse":
            continue
        argv = shlex.split(re.sub(r"<[a-z]+>", "x", command))  # <cell>, <host>: any value
        argv = argv[argv.index("a2tgpo") + 1:]
        try:
            args = parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{command!r} does not parse (exit {e.code})")
        assert args.command == argv[0]


def test_documented_run_commands_work(tmp_path, capsys):
    ran = []
    for command in documented_commands() + help_commands():
        if how(command) != "run":
            continue
        argv = _local(command, tmp_path)
        if argv[0] == "a2tgpo":
            argv[0] = str(BIN / "a2tgpo")
        if "rerun" in argv:
            argv.insert(argv.index("rerun") + 1, "--dry-run")
        r = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, f"{command}: {r.stderr[-2000:]}"
        ran.append(command)
        if "rerun" in argv:
            assert "would archive" in r.stdout, r.stdout
        if " world " in f" {command} ":
            # the overrides after --section took effect
            import json

            out = Path(argv[argv.index("--out") + 1])
            summary = json.loads((out / "summary.json").read_text())
            assert summary["seed"] == 3 and summary["entities"]["person"] == 200
    assert len(ran) >= 5, ran


def test_documented_env_commands_exist():
    for command in documented_commands():
        script = next((a for a in shlex.split(command) if a.endswith(".sh")), None)
        if how(command) == "env" and script:
            assert (ROOT / script).is_file(), command
            r = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True,
                               text=True)
            assert r.returncode == 0, f"{script}: {r.stderr}"


@pytest.mark.expensive
def test_documented_gpu_test_command_selects_tests():
    assert ".venv-gpu/bin/python -m pytest -m gpu" in documented_commands()
    # the same selection in this environment (the tests skip here without a GPU)
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q",
                        "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and re.search(r"\d+/\d+ tests collected", r.stdout), \
        r.stdout[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.expensive
def test_documented_servers_start(tmp_path):
    for command in documented_commands():
        if how(command) != "serve":
            continue
        port = str(_free_port())
        argv = _local(re.sub(r"--port \d+", f"--port {port}", command), tmp_path)
        # its store path is relative: results/toy/ of a fresh folder
        (tmp_path / "results/toy").mkdir(parents=True, exist_ok=True)
        url, expect = f"http://127.0.0.1:{port}/health", None
        if "optuna-dashboard" in command:  # it serves the study the sweep's journal holds
            _sweep_journal(tmp_path / Path(argv[1]).parent)
            url, expect = f"http://127.0.0.1:{port}/api/studies", b'"study_name": "toy"'
        proc = subprocess.Popen(argv, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, f"{command}: {proc.stderr.read()[-2000:]}"
                try:
                    with urllib.request.urlopen(url, timeout=2) as r:
                        assert r.status == 200
                        body = r.read()
                    assert expect is None or expect in body, f"{command}: {url} gave {body!r}"
                    break
                except OSError:
                    assert time.monotonic() < deadline, f"{command}: no answer in 120 s"
                    time.sleep(0.5)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _sweep_journal(directory: Path) -> None:
    """A sweep's Optuna journal (a2tgpo.sweep.open_storage) with the study `toy`, two trials."""
    import optuna

    from a2tgpo.sweep import open_storage

    study = optuna.create_study(study_name="toy", storage=open_storage(directory),
                                direction="maximize")
    study.optimize(lambda trial: trial.suggest_float("beta", 0.0, 0.5), n_trials=2)


def _dry_runs() -> dict[tuple[str, ...], list[str]]:
    """Snakemake commands grouped by their arguments other than targets: flags -> targets."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for command in documented_commands():
        if how(command) == "parse" and " -- snakemake " in command:  # rehearse -- snakemake
            command = command[command.index(" -- ") + 4:]
        elif how(command) != "dry":
            continue
        argv = shlex.split(command)
        argv = argv[argv.index("snakemake") + 1:]
        flags, targets, i = [], [], 0
        while i < len(argv):
            a = argv[i]
            if a in ("--profile", "--configfile"):  # one value each
                flags += argv[i:i + 2]
                i += 1
            elif a == "--config":  # values up to the next option
                flags.append(a)
                while i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                    i += 1
                    flags.append(argv[i])
            elif a != "-n":
                targets.append(a)
            i += 1
        groups.setdefault(tuple(flags), []).extend(targets)
    return groups


@pytest.mark.expensive
@pytest.mark.parametrize("flags", list(_dry_runs()), ids=lambda f: " ".join(f) or "toy")
def test_documented_snakemake_commands_dry_run(workdir, flags):
    targets = _dry_runs()[flags]
    (workdir / "slurm").symlink_to("profiles/slurm")  # as in the checkout: --profile slurm
    # targets first: --configfile takes every word after it
    r = subprocess.run([str(BIN / "snakemake"), *targets, "-n", "--quiet", "rules", *flags],
                       cwd=workdir, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"snakemake {' '.join(targets)} {' '.join(flags)}: " \
        f"{(r.stdout + r.stderr)[-3000:]}"
