"""Rule names in resource settings (a profile's set-resources / set-threads, the same options on
the command line) must name rules of the workflow: Snakemake ignores any other name."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from a2tgpo.rule_settings import RULE_KEYED, defined_rules, rule_settings_error

ROOT = Path(__file__).resolve().parents[2]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")


def workflow_rules() -> set[str]:
    return defined_rules(ROOT / "Snakefile", *sorted(ROOT.glob("workflow/rules/*.smk")))


@pytest.mark.parametrize("profile",
                         sorted(p.parent.name for p in ROOT.glob("profiles/*/config.yaml")))
def test_every_shipped_profile_names_rules_the_workflow_has(profile):
    rules = workflow_rules()
    assert {"train", "evaluate", "sweep_trial", "prepare_track_data", "all"} <= rules
    settings = yaml.safe_load((ROOT / "profiles" / profile / "config.yaml").read_text())
    named = {key: list(settings.get(key) or {}) for key in RULE_KEYED}
    assert rule_settings_error(named, rules, f"profiles/{profile}/config.yaml") is None


def test_rule_settings_error_names_the_option_and_the_entry():
    rules = {"train", "evaluate", "evaluate_all"}
    assert rule_settings_error({"set-resources": ["train", "evaluate_all"]}, rules, "p") is None
    assert rule_settings_error({"set-resources": ["train"], "set-threads": ["evalute"]}, rules,
                               "p") == (
        "p: set-threads: 'evalute' matches no rule of the workflow (did you mean 'evaluate'?); "
        "Snakemake would ignore it and run that rule with the default resources")


@pytest.mark.parametrize("args, needle", [
    # a site profile of the user's own (profiles/slurm/config.yaml suggests copying it)
    (["--profile", "profiles/site"], ("set-resources: 'trian' matches no rule of the workflow "
                                     "(did you mean 'train'?)")),
    (["--set-threads", "evalute=4"], ("set-threads: 'evalute' matches no rule of the workflow "
                                     "(did you mean 'evaluate'?)")),
])
def test_a_rule_name_that_matches_no_rule_stops_the_workflow(workdir, args, needle):
    site = workdir / "profiles/site"
    site.mkdir()
    (site / "config.yaml").write_text(yaml.safe_dump({"set-resources": {
        "trian": {"mem_mb": 64000}}}))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run([SNAKEMAKE, "-n", "--quiet", "rules", *args], cwd=workdir, text=True,
                       capture_output=True, timeout=300, env=env)
    assert r.returncode != 0
    assert f"invalid resources: profile or command line: {needle}" in r.stdout + r.stderr, \
        r.stderr
    assert not (workdir / "results").exists()
