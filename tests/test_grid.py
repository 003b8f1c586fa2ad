"""The grid: sets expand with exclusions, β grids need β readers, cells resolve to configs."""

import dataclasses

import pytest

from a2tgpo.algo.methods import METHODS
from a2tgpo.cell import Cell
from a2tgpo.config import ConfigError, from_dict
from a2tgpo.grid import (
    CellSet,
    GridConfig,
    TrainSection,
    cell_config,
    cells_of,
    match_cells,
    validate_grid,
)
from a2tgpo.model.backbone import BackboneConfig
from a2tgpo.retrieval.retriever import RetrievalConfig
from a2tgpo.tracking import TrackingConfig
from a2tgpo.train.config import TrainConfig, TrainSettings


def test_float_noise_is_normalised_away():
    # 0.1 + 0.2 = 0.30000000000000004 in binary floating point; a set must still say 0.3
    s = CellSet(methods=("a2tgpo",), betas=(0.1 + 0.2, 0.7 - 0.2))
    assert s.betas == (0.3, 0.5)  # not 0.30000000000000004, 0.49999999999999994
    # two spellings of one β are one β listed twice: each of its cells would be made twice
    with pytest.raises(ValueError, match=r"^betas\[1\]: 0\.3 is listed twice \(betas\[0\]\)$"):
        CellSet(methods=("a2tgpo",), betas=(0.1 + 0.2, 0.1 * 3))


def test_train_section_and_train_config_share_one_declaration_of_each_setting():
    # the same Field objects (doc, default, type), not re-declarations that drift apart
    shared = TrainSettings.__dataclass_fields__
    for cls in (TrainSection, TrainConfig):
        assert issubclass(cls, TrainSettings)
        for name, f in shared.items():
            assert cls.__dataclass_fields__[name] is f, f"{cls.__name__}.{name} re-declared"
    # only the shared settings have one name in both
    assert set(TrainSection.__dataclass_fields__) & set(TrainConfig.__dataclass_fields__) \
        == set(shared)


def test_strict_keys_of_the_shared_settings():
    with pytest.raises(ConfigError, match=r"s.yaml: train.zero_stag: unknown key \(did you mean "
                       r"'zero_stage'\?\)"):
        from_dict(TrainSection, {"zero_stag": 3}, source="s.yaml", path="train")
    with pytest.raises(ConfigError, match=r"zero_stage: 4 is out of range: must be >= 1 and <= 3"):
        from_dict(TrainSection, {"zero_stage": 4})
    # ZeRO-3 shards the parameters that every rank's rollouts need: refused before any job
    with pytest.raises(ConfigError, match="zero_stage 3 is not supported by RL training"):
        from_dict(TrainSection, {"zero_stage": 3})


BETAS = {"grpo": 0.0, "a2tgpo": 0.3, "tree_grpo": 0.0}  # own β, as validate_grid returns


def test_cells_of_expands_and_excludes():
    grid = GridConfig(sets={
        "main": CellSet(methods=("grpo", "tree_grpo", "a2tgpo"), seeds=(1, 2),
                        only=("b2:tree_grpo",)),
        "beta": CellSet(methods=("a2tgpo", "grpo"), betas=(0.0, 0.5), backbones=("b1",),
                        exclude=("b1:grpo",)),
    })
    main = cells_of(grid, "main", ("b1", "b2"), BETAS)
    # b1: grpo, a2tgpo (tree_grpo only on b2) x 2 seeds = 4; b2: 3 methods x 2 seeds = 6
    assert len(main) == 10
    assert Cell("b2", "tree_grpo", 0.0, 1) in main
    assert not any(c.method == "tree_grpo" and c.backbone == "b1" for c in main)
    # methods keep their own beta: a2tgpo 0.3, grpo 0
    assert {c.beta for c in main if c.method == "a2tgpo"} == {0.3}
    beta = cells_of(grid, "beta", ("b1", "b2"), BETAS)
    # grpo excluded on b1; a2tgpo at both betas, one seed
    assert [c.path for c in beta] == ["backbone~b1/method~a2tgpo/beta~0/seed~1",
                                      "backbone~b1/method~a2tgpo/beta~0.5/seed~1"]


def test_a_beta_grid_over_a_method_that_does_not_read_beta_is_an_error():
    # IGPO's estimator is igpo_family, but without adaptive clipping β changes nothing: its
    # cells would be one run under six names
    grid = GridConfig(sets={"abl": CellSet(methods=("a2tgpo", "igpo"), betas=(0.0, 0.5))},
                      default=("abl",))
    with pytest.raises(ConfigError, match=r"^study.yaml: grid.sets.abl.betas: method 'igpo' "
                       r"\(methods\[1\]\) does not read β .* in set 'abl'$"):
        validate_grid(grid, ("toy",), "config/methods", "study.yaml")
    ok = GridConfig(sets={"abl": CellSet(methods=("a2tgpo",), betas=(0.0, 0.5)),
                          "main": CellSet(methods=("igpo", "grpo"))})
    own = validate_grid(ok, ("toy",), "config/methods", "study.yaml")
    assert own == {"a2tgpo": 0.3, "igpo": 0.0, "grpo": 0.0}
    assert [c.beta for c in cells_of(ok, "abl", ("toy",), own)] == [0.0, 0.5]
    assert [c.beta for c in cells_of(ok, "main", ("toy",), own)] == [0.0, 0.0]


def test_validate_grid_names_the_bad_entry(tmp_path):
    grid = GridConfig(sets={"main": CellSet(methods=("grpo", "nosuch"))})
    with pytest.raises(ConfigError, match=r"grid.sets.main.methods\[1\].*nosuch"):
        validate_grid(grid, ("toy",), str(tmp_path), "config.yaml")
    grid = GridConfig(sets={"main": CellSet(methods=("grpo",), backbones=("qwen",))})
    with pytest.raises(ConfigError, match=r"grid.sets.main.backbones\[0\]"):
        validate_grid(grid, ("toy",), str(tmp_path), "config.yaml")
    with pytest.raises(ValueError, match="default set"):
        GridConfig(sets={"main": CellSet(methods=("grpo",))}, default=("paper",))


@pytest.mark.parametrize("cellset, entry, why", [
    # the set trains b1 alone: leaving out b2's grpo cell leaves out nothing
    (CellSet(methods=("grpo", "a2tgpo"), backbones=("b1",), exclude=("b2:grpo",)),
     "exclude[0]: 'b2:grpo'", "backbone 'b2' is not one of its backbones (b1)"),
    (CellSet(methods=("grpo",), exclude=("b1:a2tgpo",)),
     "exclude[0]: 'b1:a2tgpo'", "method 'a2tgpo' is not one of its methods (grpo)"),
    # `only` already runs tree_grpo on b2 alone
    (CellSet(methods=("grpo", "tree_grpo"), only=("b2:tree_grpo",), exclude=("b1:tree_grpo",)),
     "exclude[0]: 'b1:tree_grpo'", "its `only` runs tree_grpo on b2 alone"),
    # an `only` naming a backbone the set does not train would run grpo nowhere
    (CellSet(methods=("grpo",), backbones=("b1",), only=("b2:grpo",)),
     "only[0]: 'b2:grpo'", "backbone 'b2' is not one of its backbones (b1)"),
])
def test_an_exclusion_that_matches_no_cell_is_refused(cellset, entry, why):
    grid = GridConfig(sets={"main": cellset})
    with pytest.raises(ConfigError) as e:
        validate_grid(grid, ("b1", "b2"), "config/methods", "study.yaml")
    assert str(e.value) == f"study.yaml: grid.sets.main.{entry} matches no cell of the set: {why}"


def _resolve(cell, train):
    return cell_config(
        cell, study="s", results_root="res/s", backbone=BackboneConfig(id="toy", path="m"),
        train=train, methods_dir="config/methods", retrieval=RetrievalConfig(),
        tracking=TrackingConfig(mlflow=False), train_file="t.parquet", dev_file="d.parquet",
        corpus="c.jsonl", index="i.faiss")


def test_cell_config_takes_every_shared_setting_from_the_train_section():
    train = from_dict(TrainSection, {
        "optim": {"lr": 3e-5}, "schedule": {"steps": 5}, "rollout": {"max_turn_tokens": 77},
        "engine": "vllm", "device": "cpu", "backend": "deepspeed", "zero_stage": 1,
        "ig_batch_size": 5, "rollout_tp": 2, "engine_memory_share": 0.4,
        "engine_kv_cache_gb": 3.0, "engine_sleep": False, "gradient_checkpointing": True,
        "reference": "zero3", "stop_margin_s": 42.0, "offload_optimizer": True,
        "weight_sync": "ipc"})
    cfg = _resolve(Cell("toy", "grpo", 0.0, 1), train)
    # old_logprobs engine needs engine hf: checked on a section of its own below
    for name in set(TrainSettings.__dataclass_fields__) - {"old_logprobs"}:
        assert getattr(cfg, name) == getattr(train, name) != getattr(TrainSettings(), name)
    hf = from_dict(TrainSection, {"old_logprobs": "engine"})
    assert _resolve(Cell("toy", "grpo", 0.0, 1), hf).old_logprobs == "engine" != \
        TrainSettings().old_logprobs


def test_cell_config_layers_overrides_in_order():
    train = from_dict(TrainSection, {
        "rollout": {"max_response_tokens": 600},
        # the method default overlong buffer (2000) exceeds 600 until the override fixes it
        "overrides": ["method.rollout.n=4", "method.dapo.overlong_buffer=100"],
        "method_overrides": {"at2po*": ["method.rollout.n=5"], "at2po": ["method.rollout.n=7"]},
    })
    cfg = _resolve(Cell("toy", "dapo", 0.0, 3), train)
    assert cfg.run_dir == "res/s/runs/backbone~toy/method~dapo/beta~0/seed~3"
    assert (cfg.seed, cfg.method.rollout.n, cfg.method.dapo.overlong_buffer) == (3, 4, 100)
    # both patterns match at2po and apply in the order written: the exact key comes last
    assert _resolve(Cell("toy", "at2po", 0.0, 1), train).method.rollout.n == 7
    assert _resolve(Cell("toy", "at2po_release", 0.0, 1), train).method.rollout.n == 5
    a2 = _resolve(Cell("toy", "a2tgpo", 0.5, 1), train)
    assert a2.method.advantage.beta == 0.5
    # apart from what the overrides name, the method is the table's
    assert dataclasses.replace(a2.method, advantage=METHODS["a2tgpo"].advantage,
                               rollout=METHODS["a2tgpo"].rollout,
                               dapo=METHODS["a2tgpo"].dapo) == METHODS["a2tgpo"]


def test_cell_config_errors_name_the_cell_and_key():
    bad = from_dict(TrainSection, {"overrides": ["method.rollout.nn=4"]})
    with pytest.raises(ConfigError, match=r"backbone~toy/method~grpo.*rollout.*nn"):
        _resolve(Cell("toy", "grpo", 0.0, 1), bad)
    too_long = from_dict(TrainSection, {"rollout": {"max_response_tokens": 600}})
    with pytest.raises(ConfigError, match="cell backbone~toy/method~dapo.*overlong_buffer"):
        _resolve(Cell("toy", "dapo", 0.0, 1), too_long)
    sneaky = from_dict(TrainSection, {"overrides": ["method.advantage.beta=0.2"]})
    with pytest.raises(ConfigError, match="set betas in grid.sets"):
        _resolve(Cell("toy", "a2tgpo", 0.3, 1), sneaky)


def test_a_regime_set_gets_its_own_cells_and_overrides():
    grid = GridConfig(sets={"main": CellSet(methods=("grpo",)),
                            "bench": CellSet(methods=("grpo",), seeds=(1, 2), regime="long")})
    train = from_dict(TrainSection, {
        "schedule": {"steps": 8, "prompts_per_step": 4},
        "overrides": ["method.rollout.n=4"],
        "method_overrides": {"grpo": ["schedule.prompts_per_step=8"]},
        "regimes": {"long": ["schedule.steps=40", "method.rollout.n=8"]}})
    own = validate_grid(grid, ("toy",), "config/methods", "s.yaml", regimes=("long",))
    main, bench = (cells_of(grid, n, ("toy",), own) for n in ("main", "bench"))
    assert [c.path for c in bench] == ["backbone~toy/regime~long/method~grpo/beta~0/seed~1",
                                       "backbone~toy/regime~long/method~grpo/beta~0/seed~2"]
    assert not set(main) & set(bench)  # seed 1 of both sets: two runs, two folders
    plain, long = _resolve(main[0], train), _resolve(bench[0], train)
    assert (plain.schedule.steps, plain.method.rollout.n) == (8, 4)
    # the regime comes after the method overrides, which still apply where it is silent
    assert (long.schedule.steps, long.method.rollout.n, long.schedule.prompts_per_step) \
        == (40, 8, 8)
    assert long.run_dir == "res/s/runs/backbone~toy/regime~long/method~grpo/beta~0/seed~1"
    with pytest.raises(ConfigError, match=r"^s.yaml: grid.sets.bench.regime: 'long' is not one "
                       r"of train.regimes \(none defined\)$"):
        validate_grid(grid, ("toy",), "config/methods", "s.yaml")
    bad = from_dict(TrainSection, {"regimes": {"long": ["schedule.stepz=40"]}})
    with pytest.raises(ConfigError, match=r"cell backbone~toy/regime~long/.*schedule.stepz"):
        _resolve(bench[0], bad)


def test_rerun_selectors_name_the_plain_cell_unless_a_regime_is_given():
    cells = [Cell("toy", "grpo", 0.0, 1), Cell("toy", "grpo", 0.0, 1, regime="bench"),
             Cell("toy", "grpo", 0.0, 2, regime="bench")]
    assert match_cells(cells, ["method=grpo", "seed=1"]) == [cells[0]]
    assert match_cells(cells, ["regime=bench", "seed=1"]) == [cells[1]]
    assert match_cells(cells, ["regime=bench"]) == cells[1:]
    with pytest.raises(ValueError, match="expected backbone=, regime="):
        match_cells(cells, ["regim=bench"])


def test_papers_selection_keeps_every_checkpoint():
    # 240 steps saved every 20 -> checkpoints 0, 20, ..., 240 = 13; nothing may be pruned
    train = from_dict(TrainSection, {"selection": "test_avg",
                                     "schedule": {"steps": 240, "save_every": 20,
                                                  "keep_last": 2}})
    assert _resolve(Cell("toy", "grpo", 0.0, 1), train).schedule.keep_last >= 13
    dev = from_dict(TrainSection, {"schedule": {"keep_last": 2}})
    assert _resolve(Cell("toy", "grpo", 0.0, 1), dev).schedule.keep_last == 2


def test_cells_of_makes_one_cell_per_track():
    grid = GridConfig(sets={"main": CellSet(methods=("grpo",))})
    cells = cells_of(grid, "main", ("b",), BETAS, ("multi_hop", "single_hop"))
    assert [c.data for c in cells] == ["multi_hop", "single_hop"]
