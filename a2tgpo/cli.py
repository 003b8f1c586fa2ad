"""`a2tgpo <command>`: the only entry points the Snakemake rules call; people can too.

Every stage command takes a config file (a resolved section, or the whole study config with
`--section`), optional dotted `key=value` overrides, and an output location it writes
atomically.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from a2tgpo.config import ConfigError

EPILOG_OVERRIDES = (
    "Overrides are dotted key=value pairs parsed as YAML, applied before validation, e.g.\n"
    "  a2tgpo world config/config.yaml --section world seed=3 people=200 --out /tmp/world"
)


def _config_args(p: argparse.ArgumentParser, section: str) -> None:
    p.add_argument("config", help="YAML config file (a resolved section, or see --section)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    p.add_argument(
        "--section",
        default=None,
        help=f"read this top-level section of CONFIG (e.g. {section!r} of config/config.yaml); "
        "default: CONFIG is the section itself",
    )


def _load(cls, args):
    from a2tgpo.config import load_config

    return load_config(cls, args.config, args.overrides, section=args.section)


# --------------------------------------------------------------------------------------------
# commands


def cmd_world(args) -> int:
    from a2tgpo.data.world import WorldConfig, print_summary, write_world

    cfg = _load(WorldConfig, args)
    summary = write_world(cfg, args.out)
    print_summary(summary)
    return 0


def cmd_toy_backbone(args) -> int:
    from a2tgpo.model.toy import ToyBackboneConfig, write_toy_backbone

    cfg = _load(ToyBackboneConfig, args)
    if not (Path(args.world) / "summary.json").exists():
        raise ConfigError(f"{args.world}: no complete toy world here (summary.json missing); "
                          "run `a2tgpo world` first")
    s = write_toy_backbone(cfg, args.world, args.out)
    print(f"toy backbone: {s['parameters']:,} parameters, tokenizer vocabulary "
          f"{s['tokenizer_vocab']} (model {s['model_vocab']}), {s['layers']} layers of width "
          f"{s['hidden_size']} -> {args.out}")
    return 0


def cmd_prepare_data(args) -> int:
    from a2tgpo.data import qa

    return qa.main(args.config, args.overrides, args.out, section=args.section)


def cmd_download_corpus(args) -> int:
    from a2tgpo.data import corpus

    return corpus.main(args.config, args.overrides, args.out, section=args.section)


def cmd_check_config(args) -> int:
    from a2tgpo.study import load_study

    study = load_study(args.config, args.overrides)
    print(f"{args.config}: valid (study {study.study!r})")
    return 0


def cmd_resolve(args) -> int:
    from a2tgpo.study import write_section

    write_section(args.config, args.overrides, args.section, args.output)
    return 0


def cmd_config_doc(args) -> int:
    from a2tgpo.config import describe
    from a2tgpo.study import StudyConfig, study_schema

    if args.schema:
        import yaml

        print(yaml.safe_dump(study_schema(), sort_keys=False, width=100), end="")
        return 0
    for key, type_, default, doc in describe(StudyConfig):
        print(f"{key}  ({type_}; default {default})\n    {doc}")
    return 0


# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="a2tgpo",
        description="Reinforcement learning of LLM search agents: A2TGPO, AT2PO and their "
        "baselines, from corpus to tables. The Snakemake DAG calls these commands; each reads a "
        "config file and writes its outputs atomically.",
        epilog=EPILOG_OVERRIDES,
        formatter_class=fmt,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")

    p = sub.add_parser(
        "world",
        help="generate the toy world (corpus, entities, QA splits)",
        description="Generate the seeded synthetic multi-hop QA world: a wiki-18-format corpus "
        "(one passage per entity plus distractors), entities.jsonl, and questions in the "
        "FlashRAG layout qa/<dataset>/<split>.jsonl. Same seed and sizes -> identical files.",
        epilog=EPILOG_OVERRIDES,
        formatter_class=fmt,
    )
    _config_args(p, "world")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=cmd_world)

    p = sub.add_parser(
        "toy-backbone",
        help="train the toy tokenizer and build the tiny Qwen3 model",
        description="Train a byte-level BPE tokenizer on the toy world and the prompt "
        "templates, build a randomly initialised Qwen3-architecture causal LM of the configured "
        "size, and save both with save_pretrained (loadable by AutoModelForCausalLM).",
        formatter_class=fmt,
    )
    _config_args(p, "toy_backbone")
    p.add_argument("--world", required=True, help="directory written by `a2tgpo world`")
    p.add_argument("--out", required=True, help="output model directory")
    p.set_defaults(func=cmd_toy_backbone)

    p = sub.add_parser(
        "prepare-data",
        help="load QA datasets (FlashRAG, Search-R1, toy) and write normalised parquet splits",
        description="Load the configured training and test datasets through `datasets` (hub ids "
        "or local directories laid out like the hub repos), normalise them to one schema (id, "
        "question, golden_answers, source, split, group, hop_type, hops), hold out a dev split "
        "from the training rows, and write parquet files plus summary.json.",
        formatter_class=fmt,
    )
    _config_args(p, "data")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=cmd_prepare_data)

    p = sub.add_parser(
        "download-corpus",
        help="download and verify the wiki-18 corpus (and optionally the prebuilt e5 index)",
        description="Download the retrieval corpus (and optionally Search-R1's prebuilt e5 "
        "flat index parts) through huggingface_hub, resuming partial downloads, verify sizes and "
        "line counts, and move verified files into place atomically.",
        formatter_class=fmt,
    )
    _config_args(p, "corpus")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=cmd_download_corpus)

    p = sub.add_parser(
        "check-config",
        help="validate a study config (config/config.yaml) strictly",
        description="Validate the whole study config: unknown keys, wrong types and missing "
        "required keys are errors naming the file and the dotted key.",
        formatter_class=fmt,
    )
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser(
        "resolve",
        help="write one validated section of a study config to a file",
        description="Validate the study config, then write SECTION, with every default filled "
        "in, to OUTPUT: the resolved file a stage command reads.",
        formatter_class=fmt,
    )
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--section", required=True)
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(func=cmd_resolve)

    p = sub.add_parser(
        "config-doc",
        help="list every config key with its type, default and meaning",
        description="Print every key of the study config with type, default and documentation "
        "(or, with --schema, the JSON schema Snakemake validates config/config.yaml with).",
        formatter_class=fmt,
    )
    p.add_argument("--schema", action="store_true", help="print the JSON schema as YAML")
    p.set_defaults(func=cmd_config_doc)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    start = time.perf_counter()
    try:
        rc = args.func(args)
    except ConfigError as e:
        print(f"a2tgpo {args.command}: config error: {e}", file=sys.stderr)
        return 2
    logging.getLogger("a2tgpo").info("%s done in %.1f s", args.command, time.perf_counter() - start)
    return rc


if __name__ == "__main__":
    sys.exit(main())
