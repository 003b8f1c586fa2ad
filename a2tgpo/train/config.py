"""The resolved training config: everything `a2tgpo train <config.yaml>` needs, in one file.

The DAG writes one per grid cell (backbone x method x beta x gamma x seed); it is also what a
person edits to rerun a cell by hand. The method's full settings are inlined, so a resolved
file is self-contained and diffable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from a2tgpo.algo.methods import MethodConfig
from a2tgpo.config import SEED_LIMIT, InvalidKey, check_device, option
from a2tgpo.model.backbone import BackboneConfig
from a2tgpo.retrieval.retriever import RetrievalConfig
from a2tgpo.rollout.agent import AgentConfig
from a2tgpo.tracking import TrackingConfig


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and its schedule (A2TGPO App. B: lr 1e-6, AdamW)."""

    lr: float = option(1e-6, "Peak learning rate.", gt=0)
    betas: tuple[float, ...] = option((0.9, 0.999), "AdamW betas.", ge=0, lt=1)
    weight_decay: float = option(0.01, "AdamW weight decay.", ge=0)
    warmup_steps: int = option(0, "Linear warmup over this many optimizer updates.", ge=0)
    grad_clip: float = option(1.0, "Max gradient norm (0 = no clipping).", ge=0)

    def __post_init__(self) -> None:
        if len(self.betas) != 2:  # torch.optim.AdamW takes (beta1, beta2)
            raise InvalidKey("betas", f"AdamW takes two betas [beta1, beta2], got "
                             f"{list(self.betas)}")


@dataclass(frozen=True)
class ScheduleConfig:
    """Batch sizes and the step budget (A2TGPO App. B: 64 prompts, mini-batch 8, 240 steps)."""

    steps: int = option(240, "RL steps (one rollout batch each).", ge=1)
    prompts_per_step: int = option(64, "Questions per step (each rolled out method.rollout.n "
                                        "times).", ge=1)
    mini_batch_prompts: int = option(8, "Questions per optimizer update (prompts_per_step / "
                                         "this = updates per step).", ge=1)
    micro_batch_size: int = option(8, "Trajectories per forward/backward (memory knob only: "
                                       "losses use global denominators).", ge=1)
    micro_batch_tokens: int = option(
        0, "Token budget of an update's micro-batch: rows sorted by length are packed so that "
        "rows x longest row stays within it (padding only inside a micro-batch); 0 = "
        "micro_batch_size rows each. Memory knob only, like micro_batch_size.", ge=0)
    share_prompt: bool = option(
        False, "Run the columns all rows of a micro-batch share (system prompt and chat "
        "template) once, and the rest of each row on their keys and values: the same "
        "log-probs and gradients with less compute where prompts are a large part of the rows "
        "(the toy: 459 of about 830 tokens). Not with gradient_checkpointing (it needs the "
        "prefix's KV cache).")
    ppo_epochs: int = option(1, "Passes over each step's rollouts.", ge=1)
    eval_every: int = option(20, "Greedy validation on the dev split every N steps.", ge=1)
    eval_questions: int = option(0, "Dev questions per validation (0 = all).", ge=0)
    save_every: int = option(20, "Checkpoint every N steps (and at the end).", ge=1)
    keep_last: int = option(2, "Checkpoints kept besides those selection needs.", ge=1)
    max_nonfinite_steps: int = option(
        0, "Consecutive steps with a non-finite loss or gradient norm tolerated before "
        "training stops with an error (the newest checkpoint is from before them). Backend "
        "single skips such a step's updates; DeepSpeed applies them as it does (no skip in "
        "bf16/fp32), so there the next steps are usually non-finite too.", ge=0)
    optimizer_states: int = option(
        2, "Newest checkpoints that keep the optimizer state (backend/): with 2, a run whose "
        "newest checkpoint is found damaged resumes exactly from the one before; 1 saves the "
        "disk (12 B x parameters per checkpoint) and such a run stops instead.", ge=1)


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """The training settings a study sets once for all its cells (the study config's `train:`
    section) and each cell's resolved TrainConfig carries: both inherit them, so every key is
    declared and documented once."""

    optim: OptimConfig = option(doc="AdamW and its warm-up.", factory=OptimConfig)
    schedule: ScheduleConfig = option(doc="Batches and step budget.", factory=ScheduleConfig)
    rollout: AgentConfig = option(doc="Agent loop limits and sampling.", factory=AgentConfig)
    engine: Literal["hf", "vllm"] = option("hf", "Rollout engine.")
    old_logprobs: Literal["recompute", "engine"] = option(
        "recompute", "log π_old of the clipped ratio: recompute = a forward pass of the trainer "
        "over the batch (the papers' recipe), grouped as the update groups the rows, so that "
        "the first update's ratios are exactly 1, in bf16 too; engine = the log-probs the "
        "rollout engine sampled with, which saves that pass. Only with engine hf, which "
        "samples from the trainer's own model, and not exact: equal up to float noise (4e-5 at "
        "most on the toy in fp32), but in bf16 other batch shapes round differently (up to "
        "~1e-2 per token), which the turn clip (ε 3e-3) acts on. Methods with information gain "
        "always recompute.")
    device: str = option("auto", "torch device; auto = cuda when available.")
    backend: Literal["single", "deepspeed"] = option(
        "single", "single = one process (CPU or one GPU); deepspeed = ZeRO across processes.")
    zero_stage: int = option(2, "DeepSpeed ZeRO stage (1 or 2; backend deepspeed).", ge=1, le=3)
    ig_batch_size: int = option(8, "Trajectories per information-gain forward.", ge=1)
    gradient_checkpointing: bool = option(
        False, "Recompute each decoder layer's activations in backward instead of keeping them "
        "(activation memory ~ layers x hidden per token instead of all intermediates; about "
        "one more forward of compute).")
    reference: Literal["copy", "zero3", "zero3_offload"] = option(
        "copy", "Where the frozen reference policy of KL methods lives: copy = a full copy on "
        "every rank's device (2 bytes x parameters per GPU in bf16); zero3 = partitioned over "
        "the ranks by DeepSpeed ZeRO-3 (1/world each, gathered layer by layer); zero3_offload "
        "= the partitions in CPU memory. zero3* need backend deepspeed.")
    rollout_tp: int = option(
        1, "engine vllm: ranks (GPUs) per rollout engine, tensor parallel; the first rank of "
        "each group runs the group's rollouts (1 = one engine per rank).", ge=1)
    engine_memory_share: float = option(
        0.6, "engine vllm: share of its GPUs' memory the engine takes (vLLM "
        "gpu_memory_utilization; the released A2TGPO/AT2PO scripts: 0.6).", gt=0, le=1)
    engine_kv_cache_gb: float | None = option(
        None, "engine vllm: fixed KV cache size in GiB; null = vLLM's own (the memory share on "
        "GPU, its CPU default on CPU).", gt=0)
    engine_sleep: bool = option(
        True, "engine vllm: release the engine's memory (vLLM sleep level 1) during the "
        "log-prob passes and the update, wake it for rollouts; a no-op where vLLM has no sleep "
        "mode (CPU).")
    weight_sync: Literal["bytes", "ipc"] = option(
        "bytes", "engine vllm: how each step's weights reach the engine. bytes = serialized "
        "through host memory (several host copies of the model per rank) and sleep level 1 "
        "(the stale weights saved to host memory and restored); ipc = handles to the "
        "trainer's own tensors (CUDA IPC on GPU, shared memory on CPU: no copy before the "
        "engine's load) and sleep level 2 (the weights dropped, woken before the sync, the KV "
        "cache after it). a2tgpo/rollout/vllm_engine.py has the design.")
    offload_optimizer: bool = option(
        False, "Keep the optimizer state (DeepSpeed ZeRO-1/2: fp32 master weights, Adam "
        "moments, gradient partitions, 12-16 B x parameters / ranks; one process: the AdamW "
        "moments) in pinned host memory from after each update until the next, so the rollout "
        "engine that shares the GPU gets that memory; costs a device-host copy each way per "
        "step. The plan moves the term from the rollout phase to host memory.")
    stop_margin_s: float = option(
        300.0, "Time budget under SLURM: before each step the trainer reads the job's end time "
        "and, when the longest of the last steps plus the last save would end less than this "
        "many seconds before it, saves and exits 75 (resumable) instead of being killed "
        "mid-step. The profile's --signal=TERM@N is the second line: it stops at the next "
        "rollout wave.", ge=0)

    def __post_init__(self) -> None:
        check_device("device", self.device)
        if self.stop_margin_s < 0:
            raise ValueError(f"stop_margin_s must be >= 0, got {self.stop_margin_s}")
        if self.zero_stage == 3:
            # ZeRO-3 shards the parameters: each rank's rollouts and log-prob passes would
            # need lockstep forwards on every rank
            raise ValueError("zero_stage 3 is not supported by RL training (rollouts need the "
                             "full parameters on every rank); use zero_stage 1 or 2")
        if self.zero_stage not in (1, 2):
            raise ValueError(f"zero_stage must be 1 or 2, got {self.zero_stage}")
        if self.schedule.share_prompt and self.gradient_checkpointing:
            raise ValueError("schedule.share_prompt runs each row on the prompt's KV cache, "
                             "which gradient_checkpointing turns off: use one of the two")
        if self.old_logprobs == "engine" and self.engine != "hf":
            raise ValueError("old_logprobs engine needs engine hf (it samples from the "
                             "trainer's model); vLLM's log-probs come from other kernels and "
                             "precision: use old_logprobs recompute")
        if self.reference != "copy" and self.backend != "deepspeed":
            raise ValueError(f"reference {self.reference} partitions the reference over "
                             "DeepSpeed ranks: it needs backend deepspeed (use reference copy)")
        if self.rollout_tp < 1:
            raise ValueError(f"rollout_tp must be >= 1, got {self.rollout_tp}")
        if not 0 < self.engine_memory_share <= 1:
            raise ValueError(f"engine_memory_share must be in (0, 1], got "
                             f"{self.engine_memory_share}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig(TrainSettings):
    """One training run (one grid cell): the study's TrainSettings, then the cell's own keys."""

    run_dir: str = option(doc="Output folder of this run (metrics.jsonl, checkpoints/, ...).")
    results_dir: str = option(doc="The study's results folder (the local MLflow store lives "
                                  "there).")
    study: str = option("toy", "Study name (MLflow experiment).")
    cell: str = option("", "Grid cell path, e.g. backbone~toy/method~grpo/beta~0/seed~1.")
    seed: int = option(1, "Seed of data order, sampling and initialisation of anything random.",
                       ge=0, lt=SEED_LIMIT)
    backbone: BackboneConfig = option(doc="Starting policy (the toy: the warm-started model).")
    method: MethodConfig = option(doc="The method, fully resolved (config/methods/<id>.yaml).")
    train_file: str = option(doc="Prepared training questions (parquet).")
    dev_file: str = option(doc="Prepared dev questions for validation and selection (parquet).")
    corpus: str = option(doc="Retrieval corpus (wiki-18 format JSONL).")
    index: str | None = option(None, "Faiss index (dense retrieval in process).")
    retrieval: RetrievalConfig = option(doc="Search tool.", factory=RetrievalConfig)
    tracking: TrackingConfig = option(doc="metrics.jsonl + MLflow.", factory=TrackingConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        s = self.schedule
        if s.prompts_per_step % s.mini_batch_prompts:
            raise ValueError("schedule.prompts_per_step must be a multiple of "
                             "schedule.mini_batch_prompts")
        if min(s.steps, s.prompts_per_step, s.mini_batch_prompts, s.micro_batch_size,
               s.ppo_epochs) < 1:
            raise ValueError("schedule sizes must be >= 1")
        style = self.method.answer_style
        if style != self.rollout.prompt_style:
            raise ValueError(f"method.reward {self.method.reward!r} scores {style} answers, but "
                             f"rollout.prompt_style {self.rollout.prompt_style!r} asks for the "
                             "other format: every reward would be 0")
        buf = self.method.dapo.overlong_buffer
        if buf > self.rollout.max_response_tokens:
            raise ValueError(f"method.dapo.overlong_buffer ({buf}) exceeds "
                             f"rollout.max_response_tokens ({self.rollout.max_response_tokens})")
        if self.rollout.max_response_tokens >= self.backbone.max_model_len:
            raise ValueError(
                f"rollout.max_response_tokens ({self.rollout.max_response_tokens}) leaves no "
                f"room for a prompt in backbone.max_model_len ({self.backbone.max_model_len}): "
                "a trajectory is its prompt plus up to max_response_tokens of turns and "
                "observations, and must fit the backbone's context; lower "
                f"rollout.max_response_tokens or raise max_model_len in the file of backbone "
                f"{self.backbone.id}")


@dataclass(frozen=True)
class SftConfig:
    """The supervised warm start (sft section)."""

    seed: int = option(0, "Seed of the demonstration choices, the data order and torch.", ge=0,
                       lt=SEED_LIMIT)
    datasets: tuple[str, ...] = option(
        ("toy_nq/train", "toy_hotpotqa/train"),
        "World QA files <dataset>/<split> (qa/<dataset>/<split>.jsonl) to write demonstrations "
        "for; their rows need metadata.lookups.")
    max_questions: int | None = option(
        None, "Use at most this many questions (a seeded sample); null = all.", ge=1)
    imperfect_fraction: float = option(
        0.25, "Share of demonstrations that are deliberately imperfect (guess, early answer, "
        "wrong query), so the starting policy leaves RL room to improve.", ge=0, le=1)
    early_answer_fraction: float = option(
        0.0, "Share of multi-hop demonstrations that answer after the first hop (drawn before "
        "imperfect_fraction, which applies to the rest); above 0.5 the greedy starting policy "
        "stops early on multi-hop questions and RL has to learn the second search.", ge=0, le=1)
    guess_fraction: float = option(
        0.0, "Share of all demonstrations that answer without searching, with a name from the "
        "question (drawn first, before early_answer_fraction and imperfect_fraction); above 0.5 "
        "the greedy starting policy answers from memory instead of searching, as a base model "
        "does, and RL has to learn to use the tool.", ge=0, le=1)
    plan_thought: bool = option(
        False, "The first thought of a multi-hop demonstration also says how many searches the "
        "question takes (\"I need to find X. The question takes 2 searches.\"): whether to "
        "search again after a hop then reads the agent's own recent plan instead of the "
        "question's wording far back in the prompt.")
    kind_draws: int = option(
        1, "Independent draws of the demonstration kinds (seeds seed, seed+1, ...); epoch e "
        "trains on draw e mod kind_draws, so which question was imperfect cannot be memorised.",
        ge=1)
    # toy defaults, measured on 2 CPU cores: 12 epochs of the 540 training demonstrations
    # take about 250 s and give greedy dev EM 0.45 (0.81 single-hop, 0.31 bridge)
    epochs: int = option(12, "Passes over the demonstrations.", ge=1)
    lr: float = option(5e-3, "Peak AdamW learning rate.", gt=0)
    warmup_ratio: float = option(0.05, "Share of the steps with a linear warm-up to lr.",
                                 ge=0, le=1)
    weight_decay: float = option(0.01, "AdamW weight decay.", ge=0)
    batch_size: int = option(4, "Sequences per optimiser step.", ge=1)
    grad_clip: float = option(1.0, "Gradient-norm clip (0 = off).", ge=0)
    max_seq_len: int = option(
        2048, "Demonstrations longer than this (prompt + response tokens) are left out.", ge=1)
    log_every: int = option(10, "Optimiser steps between loss updates of the progress bar.", ge=1)

    def __post_init__(self) -> None:
        if not 0.0 <= self.imperfect_fraction <= 1.0:
            raise ValueError("imperfect_fraction must be in [0, 1]")
        if not 0.0 <= self.early_answer_fraction <= 1.0:
            raise ValueError("early_answer_fraction must be in [0, 1]")
        if not 0.0 <= self.guess_fraction <= 1.0:
            raise ValueError("guess_fraction must be in [0, 1]")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError("warmup_ratio must be in [0, 1)")
        if min(self.epochs, self.batch_size, self.max_seq_len, self.log_every,
               self.kind_draws) < 1:
            raise ValueError("epochs, batch_size, max_seq_len, log_every and kind_draws must be "
                             ">= 1")
        if self.lr <= 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("lr must be > 0, weight_decay and grad_clip >= 0")
        if self.max_questions is not None and self.max_questions < 1:
            raise ValueError("max_questions must be >= 1 or null")
        for d in self.datasets:
            if d.count("/") != 1 or not all(d.split("/")):
                raise ValueError(f"datasets entry {d!r} must be <dataset>/<split>")
