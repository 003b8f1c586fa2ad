"""Worker of test_distributed.py: a few RL updates of a tiny Qwen3 through a training backend.

    python ds_worker.py --out DIR                                # results in DIR/single
    python -m deepspeed.launcher.runner --num_gpus 2 --master_port P
        ds_worker.py --out DIR --zero-stages 2 3                 # in DIR/zero2, DIR/zero3

Every rank builds the same seeded model and the same synthetic RL batch, takes rows
r::world_size of each mini-batch, and computes `policy_loss` with the mini-batch's global token
and sequence counts and dp_size = world size, as the training loop does. The mini-batches have
different sizes (so a different number of micro-batches per update) and each update uses
another aggregation mode. After the second update it saves the backend state; after the last
it builds a fresh model and backend, loads that state and repeats the updates from there, which
must give the same losses and weights (a resume). The main rank writes result.json (losses,
grad norms, resume and HF-export differences) and weights.pt (final weights) per run.

Loss reported per update: L_u = (1 / W) Σ_ranks Σ_micro-batches ℓ, where each micro-batch
loss ℓ carries the factor W (masks.aggregate_loss), so L_u is the loss of the whole, unsplit
mini-batch, whatever W and the micro-batch size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from a2tgpo.algo.losses import policy_loss
from a2tgpo.algo.masks import local_denominators
from a2tgpo.train.distributed import (DeepSpeedBackend, SingleBackend, init_distributed,
                                       shutdown_distributed)

ROWS, LENGTH, PROMPT, VOCAB = 24, 16, 4, 64
MINI_BATCHES = ((0, 8), (8, 20), (20, 24))  # row ranges: 8, 12 and 4 rows
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
MICRO_BATCH = 2
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


def token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """log π(x_t | x_<t), 0 at t = 0 (as rl.token_logprobs). (b, T) -> (b, T)."""
    logits = model(input_ids=ids).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


def synthetic_batch(model) -> dict[str, torch.Tensor]:
    """Seeded ids, loss mask (prompt and random observation tokens masked, one row fully),
    per-row advantages, and old log-probs near the initial policy's (so some ratios clip)."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    mask = (torch.rand(ROWS, LENGTH, generator=g) > 0.25).float()
    mask[:, :PROMPT] = 0
    mask[3] = 0  # a sequence without loss tokens: counts for no sequence
    adv = torch.randn(ROWS, 1, generator=g).expand(ROWS, LENGTH).contiguous()
    with torch.no_grad():
        old = token_logprobs(model, ids) + 0.2 * torch.randn(ROWS, LENGTH, generator=g)
    return {"ids": ids, "mask": mask, "adv": adv, "old": old}


def make_backend(zero_stage: int | None, seed: int):
    """A fresh model, client AdamW and scheduler in a backend (None: SingleBackend)."""
    model = build_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=0.01)
    # a client scheduler stepped by the loop, as in rl.py: it must reach ZeRO's param groups
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)
    if zero_stage is None:
        backend = SingleBackend(model, optimizer, grad_clip=GRAD_CLIP)
    else:
        # 2 nominal micro-batches per update: the actual counts (2, 3, 1 per rank) differ, and
        # DeepSpeed must neither divide the loss by 2 nor step after 2 backward calls
        backend = DeepSpeedBackend(model, optimizer, zero_stage=zero_stage, grad_clip=GRAD_CLIP,
                                   micro_batches_per_step=2, micro_batch_size=MICRO_BATCH)
    return backend, scheduler


def update(backend, batch, u: int) -> tuple[float, float]:
    """One optimizer update on mini-batch u; returns (global loss L_u, grad norm)."""
    start, stop = MINI_BATCHES[u]
    mine = list(range(start, stop))[backend.rank::backend.world_size]
    tokens, seqs = local_denominators(batch["mask"][mine])
    tokens, seqs = backend.all_reduce_sum(tokens), backend.all_reduce_sum(seqs)
    local = 0.0
    for s in range(0, len(mine), MICRO_BATCH):
        rows = mine[s: s + MICRO_BATCH]
        dev = {k: v[rows].to(backend.device) for k, v in batch.items()}
        loss, _ = policy_loss(
            logp_BT=token_logprobs(backend.model, dev["ids"]), old_logp_BT=dev["old"],
            adv_BT=dev["adv"], mask_BT=dev["mask"], ratio_level="token", clip_low=0.2,
            clip_high=0.28, agg_mode=AGG_MODES[u], global_tokens=tokens, global_seqs=seqs,
            dp_size=backend.world_size)
        backend.backward(loss)
        local += loss.item()
    grad_norm = backend.step()
    return backend.all_reduce_sum(local) / backend.world_size, grad_norm


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


def run(zero_stage: int | None, batch: dict[str, torch.Tensor], out: Path) -> None:
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
        return
    init_distributed()
    try:
        for stage in args.zero_stages:
            run(stage, batch, args.out / f"zero{stage}")
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
