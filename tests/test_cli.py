"""The CLI explains itself and runs the stage commands end to end."""

import json

import pytest

from a2tgpo.cli import build_parser, main

COMMANDS = ["world", "toy-backbone", "toy-reader", "prepare-data", "download-corpus",
            "encode-corpus", "build-index", "check-index", "serve-retriever", "search",
            "retrieval-eval",
            "sft", "train", "rerun", "evaluate", "select", "methods", "plan", "with-retriever",
            "launch", "fetch-backbone", "fetch-model", "serve-hub", "rehearse", "check-config",
            "resolve", "config-doc", "tables", "plots", "sweep-trial", "sweep-summary",
            "sync-mlflow"]


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in COMMANDS:
        assert cmd in out
    # the parser and this list agree, so a new command cannot go undocumented here
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted(COMMANDS)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_subcommand_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: a2tgpo {cmd}" in out
    help_text = next(a for a in build_parser()._actions if a.dest == "command").choices[cmd]
    assert help_text.description and len(help_text.description) > 60  # says what it does


def test_world_command_with_overrides(tmp_path, capsys):
    cfg = tmp_path / "w.yaml"
    cfg.write_text("seed: 3\ncountries: 4\ncities: 8\npeople: 30\nfilms: 12\nbands: 6\n"
                   "companies: 8\ndistractors: 5\nqa_sets:\n"
                   "  - {name: s, group: single_hop, splits: {test: 5}, mix: {single: 1.0}}\n")
    assert main(["world", str(cfg), "people=20", "--out", str(tmp_path / "w")]) == 0
    summary = json.loads((tmp_path / "w" / "summary.json").read_text())
    assert summary["entities"]["person"] == 20 and summary["seed"] == 3
    assert "toy world" in capsys.readouterr().out


def test_config_error_exit_code_and_message(tmp_path, capsys):
    cfg = tmp_path / "w.yaml"
    cfg.write_text("seed: 3\npeeple: 4\n")
    assert main(["world", str(cfg), "--out", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert f"{cfg}: peeple: unknown key (did you mean 'people'?)" in err
    assert not (tmp_path / "w").exists()  # nothing written for an invalid config
