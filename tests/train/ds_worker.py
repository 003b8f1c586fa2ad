"""Worker of test_distributed.py: a few RL updates of a tiny Qwen3 through the trainer's own
update (`a2tgpo.train.update.update_mini_batch`) on a training backend.

    python ds_worker.py --out DIR                                # results in DIR/single
    python -m deepspeed.launcher.runner --num_gpus 2 --master_port P
        ds_worker.py --out DIR --zero-stages 2 3                 # in DIR/zero2, DIR/zero3

Every rank builds the same seeded model and the same synthetic RL batch and calls
`update_mini_batch` with each mini-batch's rows, as the training loop does: the function takes
rows rank::world_size, in micro-batches, with the mini-batch's global token and sequence counts
and dp_size = world size. The mini-batches have different sizes (so a different number of
micro-batches per update, and an empty micro-batch on one rank), and each update uses another
loss: token-level ratio with dual clip, turn-level ratio with adaptive clip scales, sequence-level
ratio with a KL term. After the second update it saves the backend state; after the last it
builds a fresh model and backend, loads that state and repeats the updates from there, which
must give the same losses and weights (a resume). The main rank writes result.json (losses,
grad norms, resume and HF-export differences) and weights.pt (final weights) per run.

Loss reported per update: L_u = Σ_ranks Σ_micro-batches ℓ / W, where each micro-batch loss ℓ
carries the factor W (masks.aggregate_loss), so L_u is the loss of the whole, unsplit
mini-batch, whatever W and the micro-batch size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from a2tgpo.algo.methods import LossConfig
from a2tgpo.rollout.trajectory import Batch
from a2tgpo.train.distributed import (
    DeepSpeedBackend,
    SingleBackend,
    init_distributed,
    shutdown_distributed,
)
from a2tgpo.train.reference import ReferencePolicy
from a2tgpo.train.update import (
    UpdateBatch,
    UpdateLog,
    batched_logprobs,
    micro_batches,
    update_mini_batch,
)

ROWS, LENGTH, PROMPT, VOCAB = 24, 16, 4, 64
MINI_BATCHES = ((0, 8), (8, 21), (21, 24))  # row ranges: 8, 13 and 3 rows
LOSSES = (
    LossConfig(ratio_level="token", clip_low=0.2, clip_high=0.28, dual_clip=3.0,
               agg_mode="token-mean"),
    LossConfig(ratio_level="turn", clip_low=0.1, clip_high=0.15, dual_clip=None,
               adaptive_clip=True, agg_mode="seq-mean-token-mean"),
    LossConfig(ratio_level="sequence", clip_low=0.1, clip_high=0.12, dual_clip=None,
               agg_mode="seq-mean-token-sum", kl_coef=0.05, kl_kind="low_var_kl"),
)
MICRO_BATCH = 2
REF_ROWS = list(range(2, 15))  # 13 rows for the reference passes: uneven over 2 ranks
# update 1 packs by tokens instead: every row is 16 tokens, so 2 rows per 40-token micro-batch
# (7 rows on rank 0 -> 4 micro-batches, 6 on rank 1 -> 3 and an empty one)
BUDGETS = (0, 40, 0)
SAVE_AFTER = 2  # updates done when the state is saved
LR, GRAD_CLIP = 1e-2, 0.5
# Adam's step is lr·g/eps for |g| << eps, so at eps = 1e-8 a 1-ulp difference in a near-zero
# gradient (reduction order across ranks) moves a weight by ~1e-5; 1e-6 bounds that
# amplification (lr/eps) to 1e4 and lets the weights be compared tightly
ADAM_EPS = 1e-6


def build_model(seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def synthetic_batch(model) -> UpdateBatch:
    """Seeded ids, loss mask (prompt and random observation tokens masked, one row fully),
    two turns per row, per-row advantages, clip scales per turn, and old/reference log-probs
    near the initial policy's (so some ratios clip and the KL is not 0)."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    mask = (torch.rand(ROWS, LENGTH, generator=g) > 0.25).long()
    mask[:, :PROMPT] = 0
    mask[3] = 0  # a sequence without loss tokens: counts for no sequence
    positions = torch.arange(LENGTH).expand(ROWS, LENGTH)
    turn_id = torch.where(mask.bool(), (positions >= LENGTH // 2).long(), -1)
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask,
                  turn_id=turn_id, position_ids=positions.clone(),
                  rollout_logprobs=torch.zeros(ROWS, LENGTH),
                  turn_mask=torch.ones(ROWS, 2, dtype=torch.bool),
                  tool_call=torch.tensor([[True, False]]).expand(ROWS, 2).clone(),
                  prompt_lengths=torch.full((ROWS,), PROMPT), group_ids=list(range(ROWS)))
    adv = torch.randn(ROWS, 1, generator=g).expand(ROWS, LENGTH).contiguous()
    clip_scale = 1 + 0.3 * (2 * torch.rand(ROWS, 2, generator=g) - 1)
    current = batched_logprobs(model, batch, list(range(ROWS)), ROWS, "cpu")
    return UpdateBatch(batch=batch,
                       old_logp=current + 0.2 * torch.randn(ROWS, LENGTH, generator=g),
                       adv=adv,
                       ref_logp=current + 0.3 * torch.randn(ROWS, LENGTH, generator=g),
                       clip_scale=torch.gather(clip_scale, 1, turn_id.clamp(min=0)))


def make_backend(zero_stage: int | None, seed: int):
    """A fresh model, client AdamW and scheduler in a backend (None: SingleBackend)."""
    model = build_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=0.01)
    # a client scheduler stepped by the loop, as in rl.py: it must reach ZeRO's param groups
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)
    if zero_stage is None:
        backend = SingleBackend(model, optimizer, grad_clip=GRAD_CLIP)
    else:
        # 2 nominal micro-batches per update: the actual counts (2, 4, 1 per rank) differ, and
        # DeepSpeed must neither divide the loss by 2 nor step after 2 backward calls
        backend = DeepSpeedBackend(model, optimizer, zero_stage=zero_stage, grad_clip=GRAD_CLIP,
                                   micro_batches_per_step=2, micro_batch_size=MICRO_BATCH)
    return backend, scheduler


def update(backend, data: UpdateBatch, u: int) -> tuple[float, float]:
    """One optimizer update on mini-batch u by the trainer's function; returns (global loss
    L_u, grad norm)."""
    start, stop = MINI_BATCHES[u]
    log = UpdateLog()
    grad_norm = update_mini_batch(backend, data, list(range(start, stop)), LOSSES[u],
                                  micro_batch_size=MICRO_BATCH, micro_batch_tokens=BUDGETS[u],
                                  norm_length=LENGTH, log=log)
    return backend.all_reduce_sum(float(np.sum(log.terms["total"]))), grad_norm


def export_round_trip(backend, weights: dict[str, torch.Tensor], directory: Path) -> float:
    """Save `weights` as checkpoint.py would (HF format, from the unwrapped module, which holds
    only shards under ZeRO-3), load them back; returns the largest difference."""
    from transformers import Qwen3ForCausalLM

    # a copy: save_pretrained (transformers 5) empties the state_dict it is given
    backend.unwrapped.save_pretrained(directory, state_dict=dict(weights))
    loaded = Qwen3ForCausalLM.from_pretrained(directory).state_dict()
    if loaded.keys() != weights.keys():
        return float("inf")
    return max(float((loaded[k] - weights[k]).abs().max()) for k in weights)


def run(zero_stage: int | None, batch: UpdateBatch, out: Path) -> None:
    """Train, save after SAVE_AFTER updates, resume into fresh objects; results to `out`."""
    backend, scheduler = make_backend(zero_stage, seed=0)
    backend.model.train()
    losses, norms = [], []
    state_dir = out / "state"
    for u in range(len(MINI_BATCHES)):
        if u == SAVE_AFTER:
            if backend.is_main:
                state_dir.mkdir(parents=True)
            backend.barrier()
            backend.save_state(state_dir)
            saved_weights = backend.hf_state_dict()  # what the HF checkpoint folder would hold
            saved_scheduler = scheduler.state_dict()
        loss, norm = update(backend, batch, u)
        scheduler.step()
        losses.append(loss)
        norms.append(norm)
    weights = backend.hf_state_dict()

    # resume: a fresh process's objects (other init seed), restored from the saved state
    resumed, resumed_scheduler = make_backend(zero_stage, seed=1)
    if zero_stage is None:  # SingleBackend's weights come from the HF checkpoint
        resumed.unwrapped.load_state_dict(saved_weights)
    resumed.load_state(state_dir)
    resumed_scheduler.load_state_dict(saved_scheduler)
    resumed.model.train()
    resumed_losses = []
    for u in range(SAVE_AFTER, len(MINI_BATCHES)):
        resumed_losses.append(update(resumed, batch, u)[0])
        resumed_scheduler.step()
    resumed_weights = resumed.hf_state_dict()

    if backend.is_main:
        resume_diff = max(float((weights[k] - resumed_weights[k]).abs().max()) for k in weights)
        torch.save(weights, out / "weights.pt")
        (out / "result.json").write_text(json.dumps({
            "world_size": backend.world_size, "losses": losses, "grad_norms": norms,
            "resumed_losses": resumed_losses, "resume_max_abs_diff": resume_diff,
            "export_max_abs_diff": export_round_trip(backend, weights, out / "hf")},
            indent=1))
    backend.close()
    resumed.close()


def reference_pass(placement: str, batch: UpdateBatch, out: Path) -> None:
    """log π_ref of REF_ROWS through `ReferencePolicy` at `placement`, the rows split over the
    ranks by `micro_batches` (2 rows each: 4 micro-batches on rank 0, 3 and an empty one on
    rank 1), gathered; the main rank writes OUT/reference_<placement>.pt (len(REF_ROWS), L)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    ref = ReferencePolicy(build_model(seed=0), placement, "cpu")
    lengths = dict(enumerate(batch.batch.attention_mask.sum(1).tolist()))
    plan = micro_batches(lengths, REF_ROWS, world, max_rows=MICRO_BATCH)[rank]
    parts = [ref.logprobs(batch.batch, plan)]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, ref.logprobs(batch.batch, plan))
    ref.close()
    if rank == 0:
        full = torch.zeros(ROWS, LENGTH)
        for rows, values in parts:
            full[rows] = values
        out.mkdir(parents=True, exist_ok=True)
        torch.save(full[REF_ROWS], out / f"reference_{placement}.pt")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--zero-stages", type=int, nargs="*", default=[],
                   help="DeepSpeed runs, one after the other in these processes (results in "
                        "OUT/zero<stage>); none: one SingleBackend run (results in OUT/single)")
    p.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = p.parse_args()
    # one thread: the same float results in every process, and the ranks share 2 cores
    torch.set_num_threads(1)

    batch = synthetic_batch(build_model(seed=0))
    if not args.zero_stages:
        run(None, batch, args.out / "single")
        reference_pass("copy", batch, args.out / "single")
        return
    init_distributed()
    try:
        for stage in args.zero_stages:
            run(stage, batch, args.out / f"zero{stage}")
        for placement in ("zero3", "zero3_offload"):
            reference_pass(placement, batch, args.out)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
