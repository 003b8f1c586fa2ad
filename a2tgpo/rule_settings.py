"""Snakemake settings keyed by rule name, checked against the workflow's rules.

A profile's `set-resources` and `set-threads` (and the same options on the command line) apply
to the rule of each name they list; Snakemake ignores a name that matches no rule, so a typo
(`trian:`) leaves that rule with the default resources, unnoticed until its jobs run out of
memory or time on the cluster. The workflow refuses such a name before it schedules anything
(workflow/rules/common.smk, `check_rule_settings`), and a test checks the shipped profiles
against the rules the workflow files define.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

RULE_KEYED = ("set-resources", "set-threads")  # profile keys (= options) whose keys are rules
_RULE = re.compile(r"^(?:rule|checkpoint)\s+([A-Za-z_]\w*)\s*:", re.MULTILINE)


def rule_settings_error(settings: Mapping[str, Iterable[str]], rules: Iterable[str],
                        source: str) -> str | None:
    """The first rule name of `settings` (option -> the rule names it sets) that is not one of
    `rules`, as a message led by `source`; None when every name matches a rule."""
    known = sorted(set(rules))
    for option, names in settings.items():
        for name in names:
            if name not in known:
                near = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                return (f"{source}: {option}: {name!r} matches no rule of the workflow{hint}; "
                        "Snakemake would ignore it and run that rule with the default "
                        "resources")
    return None


def defined_rules(*files: str | Path) -> set[str]:
    """The rules (and checkpoints) the Snakemake files define by name (`rule x:`); rules made in
    a loop (`rule:` with `name:`) are not seen."""
    return {m for f in files for m in _RULE.findall(Path(f).read_text())}
