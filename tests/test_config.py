"""Strict config loading: errors name the file and the dotted key; dump/load round trips."""

from dataclasses import dataclass
from typing import Literal

import pytest

from a2tgpo.config import (
    ConfigError,
    describe,
    dump_config,
    from_dict,
    json_schema,
    load_config,
    option,
)


@dataclass(frozen=True)
class Inner:
    lr: float = option(1e-6, "learning rate")
    mode: Literal["token", "turn"] = option("turn", "ratio level")


@dataclass(frozen=True)
class Outer:
    name: str = option(doc="required name")
    steps: int = option(10, "steps")
    betas: tuple[float, ...] = option((0.0, 0.3), "betas")
    maybe: int | None = option(None, "optional int")
    inner: Inner = option(doc="nested", factory=Inner)
    items: tuple[Inner, ...] = option((), "list of nested")
    table: dict[str, int] = option(doc="mapping", factory=dict)


def write(tmp_path, text):
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def test_valid_file_loads_with_types(tmp_path):
    p = write(tmp_path, "name: a\nsteps: 3\nbetas: [0, 0.1]\ninner: {lr: 2}\ntable: {x: 1}\n")
    cfg = load_config(Outer, p)
    # ints given for float keys are converted; lists become tuples (frozen, hashable)
    assert cfg == Outer(name="a", steps=3, betas=(0.0, 0.1), inner=Inner(lr=2.0), table={"x": 1})
    assert isinstance(cfg.inner.lr, float)


@pytest.mark.parametrize(
    "text, where, what",
    [
        ("name: a\nstpes: 3\n", "stpes", "did you mean 'steps'"),  # unknown key + suggestion
        ("name: a\ninner: {lr: 1, extra: 2}\n", "inner.extra", "unknown key"),
        ("steps: 3\n", "name", "missing required key"),
        ("name: a\nsteps: three\n", "steps", "expected int"),
        ("name: a\nsteps: 2.5\n", "steps", "expected int"),
        ("name: a\nsteps: true\n", "steps", "expected int"),  # bool is not an int here
        ("name: a\ninner: {mode: tokn}\n", "inner.mode", "one of 'token', 'turn'"),
        ("name: a\nbetas: [0.1, x]\n", "betas[1]", "expected float"),
        ("name: a\nitems: [{lr: 1}, {mode: x}]\n", "items[1].mode", "one of"),
        ("name: a\ntable: {x: y}\n", "table.x", "expected int"),
        ("name: 5\n", "name", "expected str"),
    ],
)
def test_errors_name_file_and_dotted_key(tmp_path, text, where, what):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(Outer, p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: {where}: "), msg
    assert what in msg


def test_not_a_mapping_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(Outer, write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Outer, write(tmp_path, "name: [unclosed\n"))
    with pytest.raises(ConfigError, match="file not found"):
        load_config(Outer, tmp_path / "nope.yaml")


def test_overrides_are_parsed_and_validated(tmp_path):
    p = write(tmp_path, "name: a\n")
    cfg = load_config(Outer, p, ["steps=7", "inner.mode=token", "betas=[0.5]", "maybe=null"])
    assert (cfg.steps, cfg.inner.mode, cfg.betas, cfg.maybe) == (7, "token", (0.5,), None)
    with pytest.raises(ConfigError, match=r"inner\.lrr: unknown key"):
        load_config(Outer, p, ["inner.lrr=1"])
    with pytest.raises(ConfigError, match="with overrides steps=x.*steps: expected int"):
        load_config(Outer, p, ["steps=x"])
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(Outer, p, ["steps"])


def test_section_loading(tmp_path):
    p = write(tmp_path, "outer:\n  name: a\n  inner: {lr: 0.5}\n")
    assert load_config(Inner, p, section="outer.inner") == Inner(lr=0.5)
    with pytest.raises(ConfigError, match=r"outer\.inner\.bad: unknown key"):
        load_config(Inner, p, ["bad=1"], section="outer.inner")


def test_dump_and_reload_gives_the_same_object(tmp_path):
    # 0.1 + 0.2 is not 0.3: the dump must keep every float bit (repr round trip)
    cfg = Outer(name="x", betas=(0.1 + 0.2, 1e-7), items=(Inner(lr=3e-3, mode="token"),),
                table={"a": 1})
    path = tmp_path / "resolved.yaml"
    dump_config(cfg, path)
    assert load_config(Outer, path) == cfg


def test_every_key_documented_and_schema_matches():
    rows = describe(Outer)
    keys = [r[0] for r in rows]
    assert keys == ["name", "steps", "betas", "maybe", "inner", "inner.lr", "inner.mode",
                    "items", "table"]
    assert all(r[3] for r in rows)
    schema = json_schema(Outer)
    assert schema["required"] == ["name"]
    assert schema["additionalProperties"] is False
    assert schema["properties"]["inner"]["properties"]["mode"]["enum"] == ["token", "turn"]


def test_option_requires_doc():
    with pytest.raises(TypeError):
        option(1)


def test_post_init_errors_become_config_errors():
    from a2tgpo.data.world import WorldConfig

    with pytest.raises(ConfigError, match="cities must be >= countries"):
        from_dict(WorldConfig, {"countries": 5, "cities": 3}, source="w.yaml", path="world")


def test_yaml11_exponent_floats_are_accepted(tmp_path):
    # PyYAML reads `1e-6` (no dot) as a string; float keys accept it, int keys do not
    p = write(tmp_path, "name: a\ninner: {lr: 1e-6}\nbetas: [3e-3, '4E-3']\n")
    cfg = load_config(Outer, p)
    assert cfg.inner.lr == 1e-6 and cfg.betas == (3e-3, 4e-3)
    with pytest.raises(ConfigError, match="steps: expected int"):
        load_config(Outer, write(tmp_path, "name: a\nsteps: 1e3\n"))
    with pytest.raises(ConfigError, match="inner.lr: expected float"):
        load_config(Outer, write(tmp_path, "name: a\ninner: {lr: 1e-6x}\n"))


# --------------------------------------------------------------------------------------------
# ranges


@dataclass(frozen=True)
class Ranged:
    steps: int = option(10, "steps", ge=1)
    share: float = option(0.5, "share", gt=0, le=1)
    betas: tuple[float, ...] = option((), "betas", ge=0)
    splits: dict[str, int] = option(doc="sizes", factory=dict, ge=0)
    limit: int | None = option(None, "optional", ge=1)


@pytest.mark.parametrize("data, where, need", [
    ({"steps": 0}, "r.steps: 0", "must be >= 1"),
    ({"share": 0}, "r.share: 0.0", "must be > 0 and <= 1"),
    ({"share": 1.5}, "r.share: 1.5", "must be > 0 and <= 1"),
    ({"betas": [0.3, -0.1]}, r"r.betas\[1\]: -0.1", "must be >= 0"),
    ({"splits": {"train": 3, "dev": -1}}, "r.splits.dev: -1", "must be >= 0"),
    ({"limit": 0}, "r.limit: 0", "must be >= 1"),
])
def test_numbers_out_of_range_name_the_key_and_the_range(data, where, need):
    with pytest.raises(ConfigError, match=rf"^c.yaml: {where} is out of range: {need}$"):
        from_dict(Ranged, data, source="c.yaml", path="r")


@pytest.mark.parametrize("text, where, value", [
    ("name: a\ninner: {lr: .inf}\n", "inner.lr", "inf"),
    ("name: a\ninner: {lr: -.inf}\n", "inner.lr", "-inf"),
    ("name: a\ninner: {lr: .nan}\n", "inner.lr", "nan"),
    ("name: a\nbetas: [0.1, .NaN]\n", r"betas\[1\]", "nan"),
    ("name: a\ninner: {lr: 1e999}\n", "inner.lr", "'1e999'"),  # a string YAML 1.1 leaves
    ("name: a\ninner: {lr: 1" + "0" * 400 + "}\n", "inner.lr", "1" + "0" * 400),  # > max float
])
def test_a_float_key_refuses_inf_and_nan(tmp_path, text, where, value):
    # no key reads inf as "unbounded", and NaN passes every comparison a job makes
    p = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^{p}: {where}: {value} is not a finite number$"):
        load_config(Outer, p)
    # with bounds and in a `float | None` union alike (not "expected float or null")
    with pytest.raises(ConfigError, match=r"^c\.yaml: r\.share: nan is not a finite number$"):
        from_dict(Ranged, {"share": float("nan")}, source="c.yaml", path="r")
    with pytest.raises(ConfigError, match=r"^c\.yaml: r\.x: inf is not a finite number$"):
        from_dict(MaybeFloat, {"x": float("inf")}, source="c.yaml", path="r")


@dataclass(frozen=True)
class MaybeFloat:
    x: float | None = option(None, "optional float")


def test_numbers_in_range_and_null_pass_and_the_schema_carries_the_range():
    cfg = from_dict(Ranged, {"steps": 1, "share": 1, "betas": [0], "splits": {"a": 0},
                             "limit": None})
    assert (cfg.steps, cfg.share, cfg.betas, cfg.splits, cfg.limit) == (1, 1.0, (0.0,),
                                                                          {"a": 0}, None)
    props = json_schema(Ranged)["properties"]
    assert props["steps"]["minimum"] == 1
    assert (props["share"]["exclusiveMinimum"], props["share"]["maximum"]) == (0, 1)
    assert props["betas"]["items"]["minimum"] == 0
    assert props["splits"]["additionalProperties"]["minimum"] == 0
    assert {"type": "integer", "minimum": 1} in props["limit"]["anyOf"]


# numeric keys with no range of their own, and why
UNBOUNDED = {
    "WorldConfig.first_year": "any year; last_year >= first_year is checked",
    "WorldConfig.last_year": "any year; last_year >= first_year is checked",
    "ParamRange.low": "a search range over any real (β, γ ranges are checked by the sweep)",
    "ParamRange.high": "a search range over any real",
    "ParamRange.fixed": "a fixed value of a searched parameter, checked by the sweep",
}


def _config_classes():
    import dataclasses
    import importlib
    import pkgutil

    import a2tgpo

    seen = {}
    for m in pkgutil.walk_packages(a2tgpo.__path__, "a2tgpo."):
        for obj in vars(importlib.import_module(m.name)).values():
            if (isinstance(obj, type) and dataclasses.is_dataclass(obj)
                    and obj.__module__ == m.name
                    and any("doc" in f.metadata for f in dataclasses.fields(obj))):
                seen[obj.__name__] = obj
    return seen


def _numeric(tp) -> bool:
    import typing

    if tp in (int, float):
        return True
    return any(_numeric(a) for a in typing.get_args(tp) if a is not Ellipsis)


def test_every_numeric_config_key_declares_its_range_and_its_default_is_in_it():
    import dataclasses

    from a2tgpo.config import _check_bounds, _type_hints

    missing, bad_defaults = [], []
    for name, cls in _config_classes().items():
        hints = _type_hints(cls)
        for f in dataclasses.fields(cls):
            if "doc" not in f.metadata or not _numeric(hints[f.name]):
                continue
            key = f"{name}.{f.name}"
            bounds = f.metadata.get("bounds", {})
            if not bounds and key not in UNBOUNDED:
                missing.append(key)
            if bounds and f.default is not dataclasses.MISSING:
                try:
                    _check_bounds(bounds, f.default, "default", key)
                except ConfigError as e:
                    bad_defaults.append(str(e))
    assert not missing, f"numeric keys without a range (option(..., ge=...)): {missing}"
    assert not bad_defaults


def test_every_seed_key_is_bounded_by_what_the_seeded_libraries_take():
    # torch.manual_seed raises from 2**64 on, numpy's legacy seeding (vLLM's LLM(seed=),
    # Optuna's grid sampler) from 2**32, both for negative seeds; a seed key found here
    # without the bound would reach them unchecked
    import dataclasses

    from a2tgpo.config import SEED_LIMIT

    assert SEED_LIMIT == 2**32
    seeds = {f"{name}.{f.name}": f.metadata.get("bounds") for name, cls in
             _config_classes().items() for f in dataclasses.fields(cls)
             if f.name in ("seed", "seeds")}
    assert set(seeds) >= {"WorldConfig.seed", "ToyBackboneConfig.seed", "CopyPretrainConfig.seed",
                          "SftConfig.seed", "DataConfig.seed", "CellSet.seeds", "TrainConfig.seed",
                          "SweepBase.seed", "SamplerConfig.seed"}
    assert {k: b for k, b in seeds.items() if b != {"ge": 0, "lt": SEED_LIMIT}} == {}


@dataclass(frozen=True)
class Tuned:
    inner: Inner = option(doc="nested, defaults other than Inner's",
                          factory=lambda: Inner(lr=0.5, mode="token"))
    table: dict[str, int] = option(doc="mapping", factory=lambda: {"a": 1})


def test_a_partial_nested_mapping_keeps_the_fields_own_default():
    # the field's factory sets lr 0.5 and mode token: giving only mode keeps lr 0.5, not
    # Inner's class default 1e-6 (an override of one key must not reset its siblings)
    assert from_dict(Tuned, {"inner": {"mode": "turn"}}).inner == Inner(lr=0.5, mode="turn")
    assert from_dict(Tuned, {}).inner == Inner(lr=0.5, mode="token")
    # a plain mapping field is replaced, not merged: what is written is what is used
    assert from_dict(Tuned, {"table": {"b": 2}}).table == {"b": 2}
    # a class without such defaults is unchanged
    assert from_dict(Outer, {"name": "x", "inner": {"mode": "token"}}).inner == Inner(
        lr=1e-6, mode="token")


# --------------------------------------------------------------------------------------------
# strict YAML


@pytest.mark.parametrize("text, line, key, first", [
    ("name: a\nsteps: 12\nsteps: 3\n", 3, "steps", 2),
    # a second block of a section would reset the keys the first one set
    ("name: a\ninner:\n  lr: 0.5\nsteps: 1\ninner:\n  mode: token\n", 5, "inner", 2),
    ("name: a\ninner:\n  lr: 0.5\n  mode: token\n  lr: 2\n", 5, "inner.lr", 3),
    ("name: a\ninner: {lr: 1, lr: 2}\n", 2, "inner.lr", 2),
    ("name: a\nitems:\n  - {lr: 1}\n  - {mode: turn, lr: 1, mode: token}\n", 4,
     r"items\[1\].mode", 4),
    ("name: a\ntable: {'x': 1, x: 2}\n", 2, "table.x", 2),  # quoting does not make it another
])
def test_a_duplicate_key_is_an_error_naming_file_line_and_dotted_key(tmp_path, text, line,
                                                                      key, first):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^{p}: line {line}: {key}: duplicate key \(first "
                                          rf"set at line {first};"):
        load_config(Outer, p)


def test_merge_keys_still_work_and_may_be_overridden(tmp_path):
    # `<<:` brings in the anchored keys; a key written beside it wins (YAML's merge rule),
    # which is not a duplicate
    p = write(tmp_path, "name: a\nitems:\n  - &base {lr: 0.5, mode: token}\n"
                        "  - {<<: *base, lr: 2}\n")
    assert load_config(Outer, p).items == (Inner(lr=0.5, mode="token"),
                                           Inner(lr=2.0, mode="token"))


def test_a_duplicate_key_inside_an_override_value_is_an_error(tmp_path):
    p = write(tmp_path, "name: a\n")
    with pytest.raises(ConfigError, match=r"override 'inner=\{lr: 1, lr: 2\}': inner\.lr: "
                                          r"duplicate key"):
        load_config(Outer, p, ["inner={lr: 1, lr: 2}"])


def test_every_yaml_file_of_the_project_is_read_strictly():
    # one strict reader (a2tgpo.config.yaml_load): any other yaml.load/safe_load in the
    # package or the workflow would read a duplicate key silently again
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [*(root / "a2tgpo").rglob("*.py"), *(root / "workflow").rglob("*.smk"),
             root / "Snakefile"]
    loose = [f"{f.relative_to(root)}:{i}" for f in files
             for i, line in enumerate(f.read_text().splitlines(), 1)
             if re.search(r"yaml\.(safe_load|load|full_load|unsafe_load)(_all)?\(", line)
             and "Loader=_strict_loader()" not in line]
    assert not loose, loose
