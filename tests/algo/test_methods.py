"""The method table, its files, and the framework-agnostic `turn_advantages` entry point."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from a2tgpo.algo import turn_advantages
from a2tgpo.algo.advantages import grpo_advantages, igpo_family_advantages
from a2tgpo.algo.methods import METHODS, METHODS_DIR, MethodConfig, get_method, render_method_yaml
from a2tgpo.config import ConfigError, load_config

REQUIRED = {"react", "grpo", "dapo", "gspo", "tree_grpo", "gigpo", "igpo", "aepo", "at2po",
            "a2tgpo", "a2tgpo_release", "a2tgpo_tgn", "a2tgpo_tgn_sqrt"}


def test_table_has_every_method_and_files_match():
    assert REQUIRED <= set(METHODS)
    files = {p.stem for p in Path(METHODS_DIR).glob("*.yaml")}
    assert files == set(METHODS)
    for mid, cfg in METHODS.items():
        path = Path(METHODS_DIR) / f"{mid}.yaml"
        # the committed file is the rendering of the table, and loads back to the same method
        assert path.read_text() == render_method_yaml(cfg), \
            f"{path} is stale: a2tgpo methods --write"
        assert load_config(MethodConfig, path) == cfg
        assert "# default (our choice)" not in path.read_text() or mid in ("dapo",), mid


def test_unknown_method_lists_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match="unknown method 'grp0'; valid: .*a2tgpo.*grpo"):
        get_method("grp0")


def test_method_file_overrides_and_validation(tmp_path):
    (tmp_path / "mine.yaml").write_text("id: mine\nname: Mine\npaper: x\n"
                                        "advantage: {estimator: grpo, norm_std: false}\n")
    assert get_method("mine", tmp_path).advantage.norm_std is False
    (tmp_path / "bad.yaml").write_text("id: bad\nname: B\npaper: x\nloss: {adaptive_clip: true}\n")
    with pytest.raises(ConfigError, match="adaptive_clip needs advantage.estimator igpo_family"):
        get_method("bad", tmp_path)


def test_adaptive_clip_is_the_one_switch_and_beta_its_strength(tmp_path):
    (tmp_path / "igpo_b.yaml").write_text(
        "id: igpo_b\nname: B\npaper: x\nadvantage: {estimator: igpo_family, beta: 0.3}\n"
        "info_gain: {enabled: true}\n")
    with pytest.raises(ConfigError, match=r"igpo_b.yaml: <root>: advantage.beta is 0.3, but "
                       r"loss.adaptive_clip is false"):
        get_method("igpo_b", tmp_path)
    # switched on, β = 0 is allowed (clip scales of 1: the fixed clip)
    on = dataclasses.replace(METHODS["a2tgpo"], advantage=dataclasses.replace(
        METHODS["a2tgpo"].advantage, beta=0.0))
    assert on.reads_beta and on.loss.adaptive_clip
    # the table: only A2TGPO and its released reading read β; γ is read by the igpo_family
    # and gigpo estimators
    assert {m for m, c in METHODS.items() if c.reads_beta} == {"a2tgpo", "a2tgpo_release"}
    assert {m for m, c in METHODS.items() if c.reads_gamma} == {
        "gigpo", "igpo", "a2tgpo", "a2tgpo_tgn", "a2tgpo_tgn_sqrt", "a2tgpo_release"}


def test_ablation_cells_differ_by_one_switch():
    tgn, sq, full = (METHODS[m].advantage for m in ("a2tgpo_tgn", "a2tgpo_tgn_sqrt", "a2tgpo"))
    assert (tgn.ig_norm, tgn.sqrt_rescale, tgn.beta) == ("turn_group", False, 0.0)
    assert (sq.sqrt_rescale, sq.beta) == (True, 0.0)
    assert (full.sqrt_rescale, full.beta) == (True, 0.3) and METHODS["a2tgpo"].loss.adaptive_clip
    rel = METHODS["a2tgpo_release"]
    assert (rel.info_gain.value, rel.info_gain.first_turn, rel.advantage.process_weight,
            rel.loss.agg_mode) == ("log_prob", "skip", 0.3, "token-mean")


TRAJ = [  # one prompt, three rollouts (the worked example of test_advantages.py)
    {"group": "q", "reward": 1.0, "info_gain": [0.2, 0.4]},
    {"group": "q", "reward": 0.0, "info_gain": [0.0]},
    {"group": "q", "reward": 0.0, "info_gain": []},
]


def test_turn_advantages_a2tgpo_matches_tensor_function():
    out = turn_advantages("a2tgpo", TRAJ)
    adv, clip, _ = igpo_family_advantages(
        ig_BK=torch.tensor([[0.2, 0.4, 0], [0, 0, 0], [0, 0, 0]], dtype=torch.float64),
        ig_mask_BK=torch.ones(3, 3, dtype=torch.bool), num_turns_B=torch.tensor([3, 2, 1]),
        outcome_B=torch.tensor([1.0, 0, 0], dtype=torch.float64), group_B=[0, 0, 0], beta=0.3)
    assert [len(o.advantages) for o in out] == [3, 2, 1]  # tool-call turns, then the answer
    for b, o in enumerate(out):
        assert o.advantages == pytest.approx(adv[b, :len(o.advantages)].tolist(), abs=1e-12)
        assert o.clip_scales == pytest.approx(clip[b, :len(o.advantages)].tolist(), abs=1e-12)
    # a fixed-clip cell returns no clip scales; hparams override the method's settings:
    # adaptive clipping at strength β = 0 is c = 1 + 0·(2σ − 1) = 1 on every turn
    assert turn_advantages("a2tgpo_tgn", TRAJ)[0].clip_scales is None
    assert turn_advantages("a2tgpo", TRAJ, beta=0.0)[0].clip_scales == [1.0, 1.0, 1.0]


def test_turn_advantages_grpo_broadcasts_and_none_is_zero():
    out = turn_advantages("grpo", TRAJ)
    ref = grpo_advantages(reward_B=torch.tensor([1.0, 0, 0], dtype=torch.float64),
                          group_B=[0, 0, 0])
    assert out[0].advantages == pytest.approx([ref[0].item()] * 3, abs=1e-12)
    assert turn_advantages("react", TRAJ)[1].advantages == [0.0, 0.0]
    # a None IG is an absent one (released code's first turn)
    skip = turn_advantages("a2tgpo_release", [{**t, "info_gain": [None] + t["info_gain"][1:]}
                                              for t in TRAJ])
    assert len(skip[0].advantages) == 3 and math.isfinite(skip[0].advantages[0])


def test_turn_advantages_gigpo_and_trees():
    gig = turn_advantages("gigpo", [
        {"group": 0, "reward": 1.0, "num_turns": 2, "anchors": ["q", "a"]},
        {"group": 0, "reward": 0.0, "num_turns": 2, "anchors": ["q", "b"]}])
    assert len(gig[0].advantages) == 2 and gig[0].advantages[0] > gig[0].advantages[1] > 0
    # a tree: root r -> a (leaf), r -> b -> {c, d}; three leaves with rewards 1, 0, 1
    leaves = [
        {"group": 0, "tree": 0, "reward": 1.0, "nodes": ["r", "a"], "entropies": [0, 0.5]},
        {"group": 0, "tree": 0, "reward": 0.0, "nodes": ["r", "b", "c"],
         "entropies": [0, 1.0, 0.2]},
        {"group": 0, "tree": 0, "reward": 1.0, "nodes": ["r", "b", "d"],
         "entropies": [0, 1.0, 0.6]},
    ]
    out = turn_advantages("at2po_child_mean", leaves)
    # leaf z (population std): rewards 1,0,1 -> mean 2/3, std sqrt(2/9);
    # c = −(2/3)/s, d = a = (1/3)/s; b = mean(c, d) = −(1/6)/s  (s = sqrt(2/9) + 1e-6)
    s = math.sqrt(2 / 9) + 1e-6
    assert out[0].advantages == pytest.approx([(1 / 3) / s], abs=1e-9)
    assert out[1].advantages == pytest.approx([-(1 / 6) / s, -(2 / 3) / s], abs=1e-9)
    assert out[2].advantages == pytest.approx([-(1 / 6) / s, (1 / 3) / s], abs=1e-9)
    tg = turn_advantages("tree_grpo", [{**leaf, "tree": 0} for leaf in leaves])
    assert [len(o.advantages) for o in tg] == [1, 2, 2]
    with pytest.raises(ValueError, match="same leaf"):
        turn_advantages("at2po", [leaves[0], leaves[0]])
