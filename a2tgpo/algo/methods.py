"""The one method table: every method id, its functions and its default hyperparameters.

A method is data: an advantage estimator (+ its settings), information-gain settings, a policy
loss (ratio level, clip rule, aggregation, KL, entropy), a rollout shape and a reward style.
`METHODS` holds the built-in ids; `config/methods/<id>.yaml` holds the same settings, with the
source of every number, as the files the experiment grid reads (a test keeps the two equal).
The additive ablation cells of both papers are methods too, so every table cell is a grid point.

Citations: A2TGPO = arXiv 2605.06200 (App. B = its hyperparameter appendix); AT2PO = arXiv
2601.04767; see ../shared/spec/algorithms.md for the sections named below.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from a2tgpo.algo.types import AggMode
from a2tgpo.config import ConfigError, load_config, option

Estimator = Literal["none", "grpo", "gigpo", "igpo_family", "tree_grpo", "at2po"]


@dataclass(frozen=True)
class AdvantageConfig:
    """Advantage estimator and its settings (unused keys are ignored by other estimators)."""

    estimator: Estimator = option("grpo", "Which estimator computes the advantages.")
    norm_std: bool = option(True, "grpo/tree_grpo: divide by the group std (False = Dr.GRPO).")
    eps: float = option(1e-6, "Added to every std denominator.", gt=0)
    gamma: float = option(1.0, "igpo_family/gigpo: discount over turns.", ge=0, le=1)
    ig_norm: Literal["joint", "separate", "turn_group", "none"] = option(
        "turn_group", "igpo_family: IG normalisation pool (joint = IGPO paper, separate = IGPO "
        "code, turn_group = A2TGPO).")
    outcome_mode: Literal["added", "discounted"] = option(
        "added", "igpo_family: outcome added to every turn (A2TGPO) or the last discounted "
        "reward of the accumulation (IGPO).")
    sqrt_rescale: bool = option(True, "igpo_family: divide the accumulated IG by √n (A2TGPO).")
    process_weight: float = option(
        1.0, "igpo_family: weight α of the accumulated IG term (paper 1.0, released code 0.3).",
        ge=0)
    beta: float = option(
        0.0, "Strength β of adaptive clipping (loss.adaptive_clip, igpo_family): c = 1 + "
        "β(2σ(îg) − 1); must be 0 without adaptive clipping.", ge=0)
    omega: float = option(1.0, "gigpo: weight ω of the step advantage.", ge=0)
    gigpo_mode: Literal["mean_norm", "mean_std_norm"] = option(
        "mean_std_norm", "gigpo: normalisation of episode and step advantages.")
    similarity_threshold: float | None = option(
        None, "gigpo: anchor similarity threshold (difflib ratio); null = exact match.", ge=0, le=1)
    tree_mode: Literal["sum", "two_stage"] = option(
        "sum", "tree_grpo: prompt z + tree z (sum) or prompt then tree (two_stage, tree_2norm).")
    value_mode: Literal["child_weighted_linear", "child_softmax", "child_mean", "leaf_mean"] = \
        option("child_weighted_linear", "at2po: node value from children (linear = paper Eq. 3, "
               "softmax = released code).")
    adv_mode: Literal["node_value", "diff_parent", "diff_global", "diff_localglobal"] = option(
        "node_value", "at2po: node advantage (A = V is the paper's best).")
    leaf_norm: bool = option(True, "at2po: z-score leaf rewards within each tree.")


# IGPO's gold-answer probe, appended after a turn to score the gold answer; "{gt}" marks where
# the answer goes (replaced literally, so braces elsewhere are fine)
IGPO_TEMPLATE = ("\nNow there's enough information to answer\n</think>\n<answer>\n{gt}"
                 "\n</answer><|im_end|>")


@dataclass(frozen=True)
class InfoGainConfig:
    """Information gain (IGPO, A2TGPO)."""

    enabled: bool = option(False, "Compute per-turn information gain during rollouts.")
    value: Literal["prob", "log_prob"] = option(
        "prob", "prob = exp(mean log p) differences (paper Eq. 3); log_prob = released code.")
    first_turn: Literal["question", "skip"] = option(
        "question", "question = first IG against the question alone (paper); skip = the first "
        "tool call only sets the baseline (released code).")
    probe_template: str = option(
        IGPO_TEMPLATE,
        "Text appended after each turn to score the gold answer ({gt}); the papers' IGPO "
        "template by default. It must be an answer the backbone would write: a model trained on "
        "another answer format gives the gold answer a probability of about 0 after every turn, "
        "and the information gain is then 0.")

    def __post_init__(self) -> None:
        if self.probe_template.count("{gt}") != 1:
            raise ValueError("info_gain.probe_template must contain '{gt}' exactly once")


@dataclass(frozen=True)
class LossConfig:
    """Policy loss: ratio, clipping, aggregation, KL and entropy terms."""

    ratio_level: Literal["token", "sequence", "turn"] = option(
        "token", "token = PPO/GRPO; sequence = GSPO; turn = ATPO/A2TGPO.")
    clip_low: float = option(0.2, "ε_low: lower bound 1 − ε_low (scaled by c when adaptive).",
                             ge=0, lt=1)
    clip_high: float = option(0.2, "ε_high: upper bound 1 + ε_high.", ge=0)
    dual_clip: float | None = option(3.0, "Dual-clip constant c for A < 0; null = none.", gt=1)
    upper_clip: Literal["hard", "gradient_preserving"] = option(
        "hard", "gradient_preserving = AEPO's clip that keeps the gradient above 1 + ε_high.")
    adaptive_clip: bool = option(
        False, "The switch of A2TGPO's adaptive clipping: per-turn clip scales of strength "
        "advantage.beta (igpo_family only).")
    agg_mode: AggMode = option("token-mean", "Loss aggregation over the mini-batch.")
    kl_coef: float = option(0.0, "KL-to-reference loss coefficient; 0 = no reference model.", ge=0)
    kl_kind: Literal["k1", "k2", "k3", "low_var_kl", "abs", "mse"] = option(
        "low_var_kl", "KL estimator.")
    entropy_coef: float = option(0.0, "Entropy bonus coefficient.", ge=0)
    entropy_adv_alpha: float = option(
        0.0, "AEPO entropy-aware advantage Ã = A(1 + α·z(H)); 0 = off.", ge=0)


@dataclass(frozen=True)
class RolloutShapeConfig:
    """How the G rollouts of a prompt are produced."""

    shape: Literal["chains", "tree_random", "tree_entropy", "aepo"] = option(
        "chains", "chains = n independent rollouts; tree_random = Tree-GRPO; tree_entropy = "
        "AT2PO; aepo = entropy-triggered branching.")
    n: int = option(16, "Rollouts (leaves) per prompt.", ge=1)
    tree_m: int = option(0, "Trees per prompt (Tree-GRPO) or initial chains (AT2PO).", ge=0)
    tree_n: int = option(0, "Tree-GRPO: nodes expanded per iteration.", ge=0)
    tree_l: int = option(0, "Expansion rounds.", ge=0)
    tree_k: int = option(0, "Tree-GRPO: leaves kept per tree; AT2PO: nodes expanded per round.",
                         ge=0)
    expansion_penalty: float = option(0.05, "AT2PO: α in H(n) − α·(siblings − 1).", ge=0)
    node_select: Literal["entropy", "random"] = option(
        "entropy", "AT2PO: expand the top-K nodes by score, or K random nodes (ablation).")
    aepo_initial: int = option(0, "AEPO: initial chains per prompt.", ge=0)
    aepo_branch_probability: float = option(0.5, "AEPO: branch when p >= this.", ge=0, le=1)
    aepo_entropy_weight: float = option(0.2, "AEPO: w in p = U + w(H − H_init).", ge=0)

    def __post_init__(self) -> None:
        # checked with the config, before any job starts, not at the first rollout
        m, n_exp, iters, k = self.tree_m, self.tree_n, self.tree_l, self.tree_k
        if self.shape == "tree_random":
            if not (m >= 1 and n_exp >= 0 and iters >= 0 and 1 <= k <= 1 + iters * n_exp):
                raise ValueError(f"Tree-GRPO needs M >= 1 and 1 <= K <= 1 + L·N leaves "
                                 f"(tree_m={m}, tree_n={n_exp}, tree_l={iters}, tree_k={k})")
            if self.n != m * k:
                raise ValueError(f"Tree-GRPO yields tree_m·tree_k = {m * k} trajectories per "
                                 f"question, but rollout.n = {self.n}")
        if self.shape == "tree_entropy" and not (m >= 1 and iters >= 0 and k >= 0):
            raise ValueError(f"AT2PO needs tree_m >= 1, tree_l >= 0, tree_k >= 0 (tree_m={m}, "
                             f"tree_l={iters}, tree_k={k})")


@dataclass(frozen=True)
class DapoConfig:
    """DAPO's sampling-side pieces."""

    dynamic_sampling: bool = option(False, "Drop groups with no reward spread; refill.")
    filter_metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = option(
        "seq_reward", "Metric whose spread decides whether a group is kept.")
    gen_batch_multiplier: int = option(1, "Prompts generated per batch, as a multiple.", ge=1)
    max_num_gen_batches: int = option(10, "Give up after this many generation batches.", ge=1)
    overlong_buffer: int = option(0, "Overlong shaping buffer L_buf in tokens; 0 = off.", ge=0)
    overlong_factor: float = option(1.0, "Penalty at the maximum length.", ge=0)


@dataclass(frozen=True)
class MethodConfig:
    """One method (config/methods/<id>.yaml)."""

    id: str = option(doc="Method id: file name, grid value, MLflow tag, table row.")
    name: str = option(doc="Display name in tables and plots (report.method_labels may "
                                "override it).")
    paper: str = option(doc="Where the method is defined (arXiv id and section).")
    train: bool = option(True, "False = evaluation only (ReAct).")
    reward: Literal["a2tgpo", "search_r1", "search_r1_format"] = option(
        "a2tgpo", "Reward function (algo/rewards.py); the papers ran every method with A2TGPO's "
        "EM + format reward.")
    advantage: AdvantageConfig = option(doc="Advantage estimator.", factory=AdvantageConfig)
    info_gain: InfoGainConfig = option(doc="Information gain.", factory=InfoGainConfig)
    loss: LossConfig = option(doc="Policy loss.", factory=LossConfig)
    rollout: RolloutShapeConfig = option(doc="Rollout shape.", factory=RolloutShapeConfig)
    dapo: DapoConfig = option(doc="DAPO sampling pieces.", factory=DapoConfig)

    @property
    def answer_style(self) -> Literal["a2tgpo", "search_r1"]:
        """The answer format the reward reads: a2tgpo = \\boxed{}, search_r1 = <answer> tags
        (algo/rewards.py score_response); the prompt style must ask for it."""
        return "search_r1" if self.reward.startswith("search_r1") else "a2tgpo"

    def __post_init__(self) -> None:
        a, lo = self.advantage, self.loss
        if lo.adaptive_clip and a.estimator != "igpo_family":
            raise ValueError("loss.adaptive_clip needs advantage.estimator igpo_family")
        if a.beta != 0 and not lo.adaptive_clip:
            # β is only the strength: without the switch it would change nothing, and a β grid
            # would train identical runs under different names
            raise ValueError(f"advantage.beta is {a.beta}, but loss.adaptive_clip is false: β "
                             "is the adaptive-clip strength; set loss.adaptive_clip: true or "
                             "beta: 0")
        if a.estimator == "igpo_family" and not self.info_gain.enabled:
            raise ValueError("advantage.estimator igpo_family needs info_gain.enabled")
        if a.estimator == "at2po" and self.rollout.shape not in ("tree_random", "tree_entropy"):
            raise ValueError("advantage.estimator at2po needs a tree rollout shape")
        if a.estimator == "tree_grpo" and self.rollout.shape != "tree_random":
            raise ValueError("advantage.estimator tree_grpo needs rollout.shape tree_random")

    @property
    def reads_beta(self) -> bool:
        """Whether advantage.beta changes training: β is the adaptive-clip strength."""
        return self.loss.adaptive_clip

    @property
    def reads_gamma(self) -> bool:
        """Whether advantage.gamma changes training: the turn discount of these estimators."""
        return self.advantage.estimator in ("igpo_family", "gigpo")


# --------------------------------------------------------------------------------------------
# the table


def _grpo_like(id: str, name: str, paper: str, **parts) -> MethodConfig:
    # shared baseline settings of A2TGPO/AT2PO App. B: KL 0.001 low_var_kl, clip 0.2, n 16,
    # token-mean (algorithms.md §2, last paragraph)
    loss = dict(kl_coef=0.001, kl_kind="low_var_kl")
    loss.update(parts.pop("loss", {}))
    return MethodConfig(id=id, name=name, paper=paper, loss=LossConfig(**loss), **parts)


def _a2tgpo(id: str, name: str, *, adaptive_clip: bool = True, **adv) -> MethodConfig:
    # A2TGPO §4 and App. B.4; released script ATGPO_multihop_qwen3_4B.sh (algorithms.md §9)
    settings = dict(estimator="igpo_family", ig_norm="turn_group", outcome_mode="added",
                    gamma=1.0, sqrt_rescale=True, process_weight=1.0,
                    beta=0.3 if adaptive_clip else 0.0)
    settings.update(adv)
    return MethodConfig(
        id=id, name=name, paper="arXiv 2605.06200 §4 (Eq. 6-12), App. B.4",
        advantage=AdvantageConfig(**settings),
        info_gain=InfoGainConfig(enabled=True, value="prob", first_turn="question"),
        loss=LossConfig(ratio_level="turn", clip_low=3e-3, clip_high=4e-3, dual_clip=None,
                        adaptive_clip=adaptive_clip, agg_mode="seq-mean-token-mean",
                        kl_coef=0.0),
    )


def _at2po(id: str, name: str, *, select: str = "entropy", ratio: str = "turn",
           estimator: str = "at2po", **adv) -> MethodConfig:
    # AT2PO §4-5, App. B; ATPO_qwen3_4B.sh (algorithms.md §8): M=10, L=2, K=6 -> 22 leaves
    loss = (LossConfig(ratio_level="turn", clip_low=3e-3, clip_high=4e-3, dual_clip=None,
                       agg_mode="seq-mean-token-mean", kl_coef=0.0) if ratio == "turn"
            else LossConfig(kl_coef=0.0))
    return MethodConfig(
        id=id, name=name, paper="arXiv 2601.04767 §4-5, Tables 3-4",
        advantage=AdvantageConfig(estimator=estimator, **adv), loss=loss,
        rollout=RolloutShapeConfig(shape="tree_entropy", n=22, tree_m=10, tree_l=2, tree_k=6,
                                   node_select=select),
    )


def _build() -> dict[str, MethodConfig]:
    methods = [
        MethodConfig(id="react", name="ReAct", paper="arXiv 2210.03629 (prompting only)",
                     train=False, advantage=AdvantageConfig(estimator="none")),
        _grpo_like("grpo", "GRPO", "arXiv 2402.03300; algorithms.md §2"),
        _grpo_like(
            "dapo", "DAPO", "arXiv 2503.14476; A2TGPO App. B (algorithms.md §3)",
            loss=dict(clip_high=0.28),
            dapo=DapoConfig(dynamic_sampling=True, filter_metric="seq_reward",
                            gen_batch_multiplier=3, overlong_buffer=2000, overlong_factor=1.0)),
        _grpo_like("gspo", "GSPO", "arXiv 2507.18071; algorithms.md §4",
                   loss=dict(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4,
                             dual_clip=None, agg_mode="seq-mean-token-mean")),
        _grpo_like("tree_grpo", "Tree-GRPO", "arXiv 2509.21240; algorithms.md §7.1",
                   advantage=AdvantageConfig(estimator="tree_grpo"),
                   rollout=RolloutShapeConfig(shape="tree_random", n=6, tree_m=2, tree_n=2,
                                              tree_l=1, tree_k=3)),
        _grpo_like("gigpo", "GiGPO", "arXiv 2505.10978; algorithms.md §6",
                   advantage=AdvantageConfig(estimator="gigpo", gamma=0.95, omega=1.0,
                                             gigpo_mode="mean_std_norm",
                                             similarity_threshold=0.9)),
        _grpo_like("igpo", "IGPO", "arXiv 2510.14967; algorithms.md §5",
                   advantage=AdvantageConfig(estimator="igpo_family", ig_norm="joint",
                                             outcome_mode="discounted", gamma=1.0,
                                             sqrt_rescale=False, beta=0.0),
                   info_gain=InfoGainConfig(enabled=True, value="prob", first_turn="question"),
                   loss=dict(agg_mode="seq-mean-token-sum", entropy_coef=0.001)),
        MethodConfig(
            id="aepo", name="AEPO", paper="arXiv 2510.14545; algorithms.md §7.2",
            loss=LossConfig(upper_clip="gradient_preserving", entropy_adv_alpha=0.2,
                            kl_coef=0.0),
            rollout=RolloutShapeConfig(shape="aepo", n=16, aepo_initial=8)),
        # A2TGPO and its additive ablation cells (Tables 2 and 4); IGPO is the first cell
        _a2tgpo("a2tgpo_tgn", "IGPO + turn-group norm", adaptive_clip=False,
                sqrt_rescale=False),
        _a2tgpo("a2tgpo_tgn_sqrt", "IGPO + TGN + D_t/√n", adaptive_clip=False),
        _a2tgpo("a2tgpo", "A2TGPO"),
        # the released code's reading (algorithms.md §9.2-9.3): log-prob IG, no first-turn IG,
        # process weight 0.3, token-mean
        dataclasses.replace(
            _a2tgpo("a2tgpo_release", "A2TGPO (released code)", process_weight=0.3),
            info_gain=InfoGainConfig(enabled=True, value="log_prob", first_turn="skip"),
            loss=LossConfig(ratio_level="turn", clip_low=3e-3, clip_high=4e-3, dual_clip=None,
                            adaptive_clip=True, agg_mode="token-mean", kl_coef=0.0)),
        # AT2PO and its ablations (AT2PO Table 4 additive cells; Table 3 credit variants)
        _at2po("at2po_random_grpo", "random tree + GRPO loss", select="random", ratio="token",
               estimator="grpo"),
        _at2po("at2po_random_atpo", "random tree + ATPO", select="random", estimator="grpo"),
        _at2po("at2po_entropy_atpo", "entropy tree + ATPO", estimator="grpo"),
        _at2po("at2po", "AT2PO"),
        _at2po("at2po_release", "AT2PO (released code)", value_mode="child_softmax"),
        _at2po("at2po_child_mean", "AT2PO child-mean", value_mode="child_mean"),
        _at2po("at2po_leaf_mean", "AT2PO leaf-mean", value_mode="leaf_mean"),
        _at2po("at2po_diff_parent", "AT2PO A=V−V_parent", adv_mode="diff_parent"),
        _at2po("at2po_diff_root", "AT2PO A=V−V_root", adv_mode="diff_global"),
        _at2po("at2po_diff_localglobal", "AT2PO A=L+G", adv_mode="diff_localglobal"),
    ]
    return {m.id: m for m in methods}


METHODS: dict[str, MethodConfig] = _build()
METHODS_DIR = Path(__file__).resolve().parents[2] / "config" / "methods"


def method_ids(methods_dir: str | Path | None = None) -> list[str]:
    """Every method id: the built-in table's and `<methods_dir>/*.yaml`'s."""
    return sorted(set(METHODS) | {p.stem for p in Path(methods_dir or METHODS_DIR).glob("*.yaml")})


def get_method(method_id: str, methods_dir: str | Path | None = None) -> MethodConfig:
    """A method by id: `<methods_dir>/<id>.yaml` when it exists, else the built-in table.

    Unknown ids fail with the list of valid ones.
    """
    path = Path(methods_dir or METHODS_DIR) / f"{method_id}.yaml"
    if path.exists():
        cfg = load_config(MethodConfig, path)
        if cfg.id != method_id:
            raise ConfigError(f"{path}: id: {cfg.id!r} does not match the file name")
        return cfg
    if method_id not in METHODS:
        valid = method_ids(path.parent)
        raise ConfigError(f"unknown method {method_id!r}; valid: {', '.join(valid)}")
    return METHODS[method_id]




# --------------------------------------------------------------------------------------------
# config/methods/<id>.yaml: the table rendered with the source of every value

# where each value comes from: (method prefix or "*", dotted key) -> citation; the first match
# in this order wins: exact method id, method family prefix, "*"
_SHARED = "A2TGPO/AT2PO App. B shared baseline table (algorithms.md §2)"
_A2 = "A2TGPO"
CITATIONS: dict[tuple[str, str], str] = {
    ("*", "reward"): "A2TGPO §B.1 / AT2PO deep_research_em.py: EM + format, r in {-1,0,1} "
                     "(algorithms.md §10.2)",
    ("*", "advantage.eps"): "verl GRPO / IGPO code: 1e-6 in the std denominator",
    ("*", "advantage.norm_std"): "verl norm_adv_by_std_in_grpo=True (algorithms.md §2)",
    ("*", "advantage.estimator"): "verl adv_estimator=grpo (algorithms.md §2)",
    ("*", "train"): "trained with RL",
    ("*", "loss.ratio_level"): "verl compute_policy_loss_vanilla: token ratio (algorithms.md §2)",
    ("*", "loss.upper_clip"): "verl vanilla PPO clip (algorithms.md §2)",
    ("*", "loss.adaptive_clip"): "fixed clip bounds (only A2TGPO adapts them)",
    ("*", "loss.entropy_coef"): "verl entropy_coeff 0 (algorithms.md §2)",
    ("*", "loss.entropy_adv_alpha"): "no entropy-aware advantage (AEPO only)",
    ("*", "rollout.shape"): "independent chains, as GRPO samples n per prompt",
    ("*", "info_gain.enabled"): "no information gain (IGPO family only)",
    ("*", "rollout.n"): "A2TGPO App. B.4: rollout size 16",
    ("*", "loss.kl_coef"): _SHARED + ": KL 0.001",
    ("*", "loss.kl_kind"): "verl use_kl_loss low_var_kl (algorithms.md §2)",
    ("*", "loss.clip_low"): _SHARED + ": clip 0.2",
    ("*", "loss.clip_high"): _SHARED + ": clip 0.2",
    ("*", "loss.dual_clip"): "verl clip_ratio_c = 3.0 (algorithms.md §2)",
    ("*", "loss.agg_mode"): _SHARED + ": token-mean",
    ("react", "train"): "A2TGPO Table 1: ReAct is prompting only",
    ("react", "advantage.estimator"): "no training, no advantages",
    ("dapo", "loss.clip_high"): "DAPO clip-higher 0.28 (A2TGPO App. B; algorithms.md §3)",
    ("dapo", "dapo.dynamic_sampling"): "DAPO dynamic sampling on (algorithms.md §3.5)",
    ("dapo", "dapo.gen_batch_multiplier"): "A2TGPO App. B: generation batch = 3x training batch",
    ("dapo", "dapo.overlong_buffer"): "A2TGPO App. B: overlong buffer 2000 (L_max 6192)",
    ("dapo", "dapo.overlong_factor"): "A2TGPO App. B: overlong penalty factor 1.0",
    ("dapo", "dapo.filter_metric"): "AT2PO AEPO script: filter_groups.metric=seq_reward",
    ("dapo", "dapo.max_num_gen_batches"): "default (our choice): verl's default is 0 (no limit)",
    ("gspo", "loss.ratio_level"): "GSPO sequence-level ratio (algorithms.md §4)",
    ("gspo", "loss.clip_low"): "A2TGPO/AT2PO baselines: clip_ratio_low=3e-4 (GSPO paper)",
    ("gspo", "loss.clip_high"): "A2TGPO/AT2PO baselines: clip_ratio_high=4e-4 (GSPO paper)",
    ("gspo", "loss.dual_clip"): "verl compute_policy_loss_gspo: no dual clip",
    ("gspo", "loss.agg_mode"): "verl GSPO hard-codes seq-mean-token-mean",
    ("tree_grpo", "advantage.estimator"): "Tree-GRPO ray_trainer_ts adv_estimator=tree",
    ("tree_grpo", "rollout"): "Tree-GRPO train_multihopqa_tree_search.sh: M=2, N=2, L=1, K=3",
    ("tree_grpo", "advantage.tree_mode"): "Tree-GRPO adv_estimator=tree: prompt z + tree z",
    ("gigpo", "advantage"): "verl-agent run_search.sh / core_gigpo.py: gamma 0.95, omega 1, "
                            "mean_std_norm, similarity threshold 0.9",
    ("igpo", "advantage"): "IGPO paper (A2TGPO §3 Eq. 4-5): joint pool, outcome as the last "
                           "discounted reward, gamma 1",
    ("igpo", "info_gain"): "IGPO paper Eq. 3: probability difference, first turn vs the query",
    ("igpo", "loss.agg_mode"): "IGPO ppo_trainer.yaml: seq-mean-token-sum",
    ("igpo", "loss.entropy_coef"): "IGPO train.sh: entropy_coeff 0.001",
    ("aepo", "loss.upper_clip"): "AEPO compute_policy_loss_entropy_balanced_clipping (GPPO)",
    ("aepo", "loss.entropy_adv_alpha"): "AEPO entropy-aware advantage, 0.2 (algorithms.md §7.2)",
    ("aepo", "loss.kl_coef"): "AT2PO repo AEPO script: KL 0",
    ("aepo", "rollout"): "AT2PO repo AEPO vllm_rollout_with_tools.py: 8 initial chains, "
                         "branch p >= 0.5, entropy weight 0.2, target 16",
    ("a2tgpo", "advantage"): "A2TGPO §4 Eq. 6-11: turn-group norm, D/sqrt(n) + R_hat, gamma 1, "
                             "beta 0.3; process weight 1 (paper Eq. 9)",
    ("a2tgpo", "info_gain"): "A2TGPO §3 Eq. 2-3 (paper reading, algorithms.md §9.3)",
    ("a2tgpo", "loss"): "A2TGPO Eq. 10-12, App. B.4: turn ratio, eps 3e-3/4e-3, "
                        "seq-mean-token-mean, no KL",
    ("a2tgpo_tgn", "advantage"): "A2TGPO Table 2 cell: + turn-group norm (no rescale, beta 0)",
    ("a2tgpo_tgn_sqrt", "advantage"): "A2TGPO Table 2 cell: + D_t rescaling (beta 0)",
    ("a2tgpo_release", "advantage"): "released script ATGPO_multihop_qwen3_4B.sh: "
                                     "igpo_adv_rescale_alpha=0.3 (algorithms.md §9.2)",
    ("a2tgpo_release", "info_gain"): "released ray_trainer._compute_igpo_reward: log-prob "
                                     "difference, no query-only baseline",
    ("a2tgpo_release", "loss.agg_mode"): "released script keeps verl's token-mean",
    ("at2po", "rollout"): "AT2PO ATPO_qwen3_4B.sh: M=10, L=2, K=6 -> 22 leaves per tree",
    ("at2po", "loss"): "AT2PO Eq. 4-5 (compute_policy_loss_gspo_turn): eps 3e-3/4e-3, "
                       "seq-mean-token-mean, KL 0",
    ("at2po", "advantage"): "AT2PO Eq. 3: child-weighted node value, A = V, leaf z-score",
    ("at2po_release", "advantage.value_mode"): "AT2PO code node_value_mode=child_softmax",
    ("at2po_random", "advantage"): "AT2PO Table 4 cell: GRPO outcome advantage over leaves",
    ("at2po_random", "rollout.node_select"): "AT2PO Table 4 cell: random tree expansion",
    ("at2po_random_grpo", "loss"): "AT2PO Table 4 cell: GRPO token loss",
    ("at2po_entropy", "advantage"): "AT2PO Table 4 cell: GRPO outcome advantage over leaves",
    ("at2po_child", "advantage.value_mode"): "AT2PO Table 3: child-mean",
    ("at2po_leaf", "advantage.value_mode"): "AT2PO Table 3: leaf-mean",
    ("at2po_diff_parent", "advantage.adv_mode"): "AT2PO Table 3: A = V - V_parent",
    ("at2po_diff_root", "advantage.adv_mode"): "AT2PO Table 3: A = V - V_root",
    ("at2po_diff_localglobal", "advantage.adv_mode"): "AT2PO Table 3: L + G",
}


def citation(method_id: str, key: str) -> str | None:
    """The source of `key` for `method_id` (most specific entry first), or None."""
    parts = key.split(".")
    prefixes = [method_id] + [p for p in sorted({m for m, _ in CITATIONS}, key=len, reverse=True)
                              if p != "*" and p != method_id and method_id.startswith(p)] + ["*"]
    for who in prefixes:
        for i in range(len(parts), 0, -1):  # the key itself, then its sections
            if (who, ".".join(parts[:i])) in CITATIONS:
                return CITATIONS[(who, ".".join(parts[:i]))]
    return None


# which keys a method's file shows: those its estimator, rollout shape and options use
ADVANTAGE_KEYS = {
    "none": [], "grpo": ["norm_std", "eps"], "tree_grpo": ["tree_mode", "norm_std", "eps"],
    "gigpo": ["gamma", "omega", "gigpo_mode", "similarity_threshold", "eps"],
    "igpo_family": ["ig_norm", "outcome_mode", "gamma", "sqrt_rescale", "process_weight", "beta",
                    "eps"],
    "at2po": ["value_mode", "adv_mode", "leaf_norm", "eps"],
}
ROLLOUT_KEYS = {
    "chains": ["n"], "tree_random": ["n", "tree_m", "tree_n", "tree_l", "tree_k"],
    "tree_entropy": ["n", "tree_m", "tree_l", "tree_k", "expansion_penalty", "node_select"],
    "aepo": ["n", "aepo_initial", "aepo_branch_probability", "aepo_entropy_weight"],
}


def relevant_settings(cfg: MethodConfig) -> dict:
    """The method as nested dicts, keeping only the keys it uses (the rest are defaults)."""
    from a2tgpo.config import to_dict

    d = to_dict(cfg)
    out = {k: d[k] for k in ("id", "name", "paper", "train", "reward")}
    out["advantage"] = {k: d["advantage"][k]
                        for k in ["estimator", *ADVANTAGE_KEYS[cfg.advantage.estimator]]}
    out["info_gain"] = d["info_gain"] if cfg.info_gain.enabled else {"enabled": False}
    if cfg.train:
        out["loss"] = d["loss"]
        out["rollout"] = {k: d["rollout"][k]
                          for k in ["shape", *ROLLOUT_KEYS[cfg.rollout.shape]]}
        if cfg.dapo.dynamic_sampling or cfg.dapo.overlong_buffer:
            out["dapo"] = d["dapo"]
    return out


def render_method_yaml(cfg: MethodConfig) -> str:
    """config/methods/<id>.yaml: the keys the method uses, each with where it comes from.

    A value no source sets for this method is marked `# default (our choice)`; keys a method
    does not use are left out (they take their documented defaults when loaded).
    """
    import json

    lines = [f"# {cfg.name}: generated from a2tgpo/algo/methods.py by `a2tgpo methods --write`;",
             "# edit the table there. Keys not listed take their defaults (`a2tgpo config-doc`).",
             ]

    def emit(data: dict, prefix: str, indent: int) -> None:
        for k, v in data.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                lines.append(" " * indent + f"{k}:")
                emit(v, key + ".", indent + 2)
                continue
            value = json.dumps(list(v) if isinstance(v, tuple) else v, ensure_ascii=False)
            if key in ("id", "name", "paper"):
                lines.append(" " * indent + f"{k}: {value}")
                continue
            cite = citation(cfg.id, key) or "default (our choice)"
            lines.append(" " * indent + f"{k}: {value}  # {cite}")

    emit(relevant_settings(cfg), "", 0)
    return "\n".join(lines) + "\n"


def write_method_files(out_dir: str | Path = METHODS_DIR) -> list[Path]:
    from a2tgpo.io import atomic_write_text

    paths = []
    for cfg in METHODS.values():
        path = Path(out_dir) / f"{cfg.id}.yaml"
        atomic_write_text(path, render_method_yaml(cfg))
        paths.append(path)
    return paths
