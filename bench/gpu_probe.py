"""GPU probe: what only a GPU shows of the colocated training path, on one GPU in minutes.

One DeepSpeed ZeRO-2 step in bf16 over NCCL (world size 1) of an A2TGPO cell, through the
trainer's own functions (train/update.py, rollout/info_gain.py, rl.token_advantages,
train/memory.py, checkpoint.save_checkpoint), on a Qwen3-1.7B-architecture model with random
weights and multi-turn trajectories of 4-6k tokens, while a second process holds what a vLLM
engine would hold on the same GPU (vLLM itself cannot be carried to the check machine): it
takes `--engine-share` of the device when awake and frees it asleep, and reports whether the
device had that much free first (vLLM's own start-up and wake checks). Each section prints as
it runs and catches its own out-of-memory error. Sections:

  start    after ZeRO-2 wrapped the model: allocated / reserved / device-free before and after
           the cache is released (what model loading and flattening leave cached), and
           whether the engine could start with and without the release
  logprob  the fused information-gain pass and the old-log-prob pass (`update_logprobs`),
           memory before and after the release; bf16: per-turn |mean delta log pi| between the
           fused pass's token log-probs and the update's path, against the method's eps
  update   one optimizer update: the first update's clip fraction and ratio mean (exactly 0
           and 1 when log pi_old comes from the update's path), peak reserved
  wake     the optimizer state offloaded, the cache released; whether the engine could wake
           with and without those
  save     peak device memory of a checkpoint save (`save_checkpoint`, host shards) and of
           `save_pretrained` on the live ZeRO-2 module (the save that clones the weights)
  plan     `a2tgpo.plan.memory_phases` for this probe's cell beside each measured phase peak

    python3 bench/gpu_probe.py            # one GPU (bench/gpu_check.sh runs it)
    python3 bench/gpu_probe.py --tiny     # the same code on CPU with a tiny model (gloo)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import socket
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

GIB = 2**30
# Qwen3-1.7B (config.json of Qwen/Qwen3-1.7B): 2.03B parameters with the tied embedding
QWEN3_1_7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
T0 = time.perf_counter()


def say(section: str, text: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {section}: {text}", flush=True)


@contextmanager
def guarded(section: str):
    """A section that reports its own failure (out of memory above all) and lets the next run."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        say(section, f"OUT OF MEMORY: {str(e).splitlines()[0]}")
    except Exception:
        say(section, "FAILED:\n" + traceback.format_exc())


def mem(device) -> str:
    from a2tgpo.train.memory import snapshot

    s = snapshot(device)
    if not s:
        return "no device memory pool (CPU)"
    return (f"allocated {s['allocated_gib']:.2f} GiB, reserved {s['reserved_gib']:.2f}, "
            f"device free {s['device_free_gib']:.2f}")


def free_gib(device) -> float:
    from a2tgpo.train.memory import snapshot

    return snapshot(device).get("device_free_gib", float("nan"))


# --------------------------------------------------------------------------------------------
# the engine's share of the GPU, held by another process


def _holder(conn, device_index: int) -> None:
    torch.cuda.set_device(device_index)
    torch.cuda.init()
    held: list[torch.Tensor] = []
    while True:
        cmd, arg = conn.recv()
        if cmd == "wake":
            free, _ = torch.cuda.mem_get_info()
            try:
                held.append(torch.empty(int(arg), dtype=torch.uint8, device="cuda"))
                conn.send(("ok", free))
            except torch.cuda.OutOfMemoryError:
                conn.send(("oom", free))
        elif cmd == "sleep":
            held.clear()
            torch.cuda.empty_cache()
            conn.send(("ok", 0))
        else:
            conn.send(("ok", 0))
            return


class EngineStandIn:
    """A process on the same GPU that takes `share` of its memory awake and frees it asleep."""

    def __init__(self, share: float, device) -> None:
        self.need = share * torch.cuda.get_device_properties(device).total_memory
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_holder, args=(child, torch.device(device).index or 0),
                                daemon=True)
        self.proc.start()

    def wake(self) -> tuple[bool, float]:
        self.conn.send(("wake", self.need))
        status, free = self.conn.recv()
        return status == "ok", free / GIB

    def sleep(self) -> None:
        self.conn.send(("sleep", None))
        self.conn.recv()

    def close(self) -> None:
        self.conn.send(("stop", None))
        self.conn.recv()
        self.proc.join(10)


# --------------------------------------------------------------------------------------------
# the cell


def trajectories(n_prompts: int, n: int, lengths: tuple[int, int], vocab: int, seed: int = 0):
    """Multi-turn trajectories with random ids: a 300-token prompt, three search turns of
    generated thinking + query and a ~500-token observation each, an answer turn; total
    length uniform in `lengths`."""
    from a2tgpo.rollout.trajectory import Trajectory, Turn

    rng = random.Random(seed)
    out = []
    for i in range(n_prompts * n):
        total = rng.randint(*lengths)
        prompt = min(300, total // 8)
        obs = min(500, total // 8)
        gen = total - prompt - 3 * obs
        cuts = sorted(rng.sample(range(1, gen), 3))
        sizes = [cuts[0], cuts[1] - cuts[0], cuts[2] - cuts[1], gen - cuts[2]]
        ids = lambda k: tuple(rng.randrange(1, vocab) for _ in range(k))  # noqa: E731
        turns = [Turn(ids(sz), tuple(-1.0 for _ in range(sz)), ids(obs) if k < 3 else (),
                      "search" if k < 3 else "answer", query="q" if k < 3 else None,
                      entropy=0.5)
                 for k, sz in enumerate(sizes)]
        out.append(Trajectory(ids(prompt), tuple(turns), f"q{i // n}", i // n, ("gold",),
                              reward=float(rng.random() < 0.4),
                              extra={"em": 0.0, "f1": 0.0, "format_ok": True}))
    return out


def turn_deltas(a_BL: torch.Tensor, b_BL: torch.Tensor, batch) -> torch.Tensor:
    """|mean over a turn's generated tokens of (a - b)| for every turn of every row."""
    out = []
    for b in range(a_BL.shape[0]):
        for k in range(int(batch.num_turns[b])):
            on = (batch.turn_id[b] == k) & batch.loss_mask[b].bool()
            if on.any():
                out.append(float((a_BL[b][on] - b_BL[b][on]).mean().abs()))
    return torch.tensor(out)


def plan_phases(args, arch: dict, method, schedule, device_total: float) -> dict[str, float]:
    """The plan's per-phase totals (bytes) for this probe's cell on one GPU."""
    from a2tgpo.algo.methods import METHODS  # noqa: F401 - the method table is loaded
    from a2tgpo.model.backbone import ArchitectureConfig, BackboneConfig
    from a2tgpo.plan import ModelSizes, count_parameters, memory_phases
    from a2tgpo.rollout.agent import AgentConfig
    from a2tgpo.train.config import TrainConfig

    a = ArchitectureConfig(model_type="qwen3", **arch)
    params, largest = count_parameters(a)
    cfg = TrainConfig(run_dir="probe", results_dir="probe", method=method, train_file="",
                      dev_file="", corpus="", schedule=schedule, backend="deepspeed",
                      zero_stage=2, engine="vllm", engine_memory_share=args.engine_share,
                      gradient_checkpointing=True, ig_batch_size=args.ig_batch,
                      offload_optimizer=True,
                      # the papers' split of the context: a quarter for the prompt (2000 of 8192)
                      rollout=AgentConfig(max_response_tokens=args.max_tokens * 3 // 4,
                                          max_turn_tokens=min(500, args.max_tokens * 3 // 4)),
                      backbone=BackboneConfig(id="probe", path="probe",
                                              max_model_len=args.max_tokens,
                                              architecture=a))
    phases = memory_phases(cfg, ModelSizes(a, params, largest), world=1, on_gpu=True,
                           capacity=device_total)
    return {ph: sum(t.bytes for t in ts) for ph, ts in phases.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model on CPU (smoke run)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4, help="rollouts per prompt")
    ap.add_argument("--min-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=6144)
    ap.add_argument("--engine-share", type=float, default=0.5,
                    help="the engine stand-in's share of the GPU (vLLM gpu_memory_utilization)")
    ap.add_argument("--ig-batch", type=int, default=4, help="trajectories per IG forward")
    args = ap.parse_args()
    if args.tiny:
        args.min_tokens, args.max_tokens, args.prompts, args.n = 96, 160, 2, 2
    on_gpu = torch.cuda.is_available() and not args.tiny
    if not on_gpu:
        os.environ["DS_ACCELERATOR"] = "cpu"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    import deepspeed
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from a2tgpo.algo.methods import METHODS
    from a2tgpo.rollout.info_gain import gold_logprob_matrix, score_gold_logprobs
    from a2tgpo.rollout.trajectory import collate
    from a2tgpo.train.checkpoint import save_checkpoint
    from a2tgpo.train.config import ScheduleConfig
    from a2tgpo.train.distributed import DeepSpeedBackend, shutdown_distributed
    from a2tgpo.train.memory import PhaseMemory, release, reset_peak, snapshot
    from a2tgpo.train.rl import token_advantages
    from a2tgpo.train.update import UpdateBatch, update_logprobs, update_policy

    arch = TINY if args.tiny else QWEN3_1_7B
    say("device", f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
                  f"{transformers.__version__}, deepspeed {deepspeed.__version__}, python "
                  f"{sys.version.split()[0]}")
    if on_gpu:
        p = torch.cuda.get_device_properties(0)
        say("device", f"{p.name}, {p.total_memory / GIB:.1f} GiB, bf16 "
                      f"{torch.cuda.is_bf16_supported()}")
    method = METHODS["a2tgpo"]
    schedule = ScheduleConfig(steps=1, prompts_per_step=args.prompts,
                              mini_batch_prompts=args.prompts, micro_batch_size=8,
                              micro_batch_tokens=max(16384, args.max_tokens))
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    phase_peak: dict[str, float] = {}

    # -- start: the model, ZeRO-2, then the engine -------------------------------------------
    with torch.device(device):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(**arch, attn_implementation="sdpa")).to(dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = sum(p.numel() for p in model.parameters())
    say("start", f"Qwen3 {params / 1e9:.2f}B parameters ({'random' if on_gpu else 'tiny'}), "
                 f"{dtype}, gradient checkpointing")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    backend = DeepSpeedBackend(model, optimizer, zero_stage=2, grad_clip=1.0)
    say("start", f"ZeRO-2 wrapped ({backend.device}); before release: {mem(device)}")
    before_free = free_gib(device)
    release(device)
    say("start", f"after release: {mem(device)}")
    engine = EngineStandIn(args.engine_share, device) if on_gpu else None
    if engine:
        need = engine.need / GIB
        say("start", f"engine start needs {need:.1f} GiB free: without release "
                     f"{before_free:.1f} ({'ok' if before_free >= need else 'FAIL'})")
        ok, free = engine.wake()
        say("start", f"engine start after release: free {free:.1f} GiB -> "
                     f"{'ok' if ok else 'FAIL (out of memory)'}; {mem(device)}")
        backend.offload_states()
        engine.sleep()  # the rollouts would run here; then the engine sleeps
    else:
        say("start", "engine stand-in skipped: no device memory pool on CPU")
        backend.offload_states()

    trajs = trajectories(args.prompts, args.n, (args.min_tokens, args.max_tokens),
                         arch["vocab_size"])
    batch = collate(trajs, 0)
    say("start", f"{len(trajs)} trajectories of {int(batch.attention_mask.sum(1).min())}-"
                 f"{int(batch.attention_mask.sum(1).max())} tokens, 4 turns each")
    memory = PhaseMemory(device)
    memory.boundary("rollout")

    # -- logprob: the fused IG pass and the old-log-prob pass --------------------------------
    gold_BP = old_BL = None
    with guarded("logprob"):
        probe = (list(range(5, 25)), (12, 16))
        reset_peak(device)
        values, fused_lps, _ = score_gold_logprobs(
            backend.unwrapped, [(t.token_ids(), t.probe_points()) for t in trajs],
            [probe] * len(trajs), batch_size=args.ig_batch, token_logprobs=True)
        gold_BP = gold_logprob_matrix(values)
        fused_BL = torch.zeros(batch.input_ids.shape)
        for b, lp in enumerate(fused_lps):
            fused_BL[b, 1: 1 + len(lp)] = torch.tensor(lp)
        _, old_BL = update_logprobs(backend, batch, schedule, seed=0)
        s = snapshot(device)
        say("logprob", f"IG + old passes done; before release: {mem(device)}"
                       + (f", phase peak reserved {s['peak_reserved_gib']:.2f}" if s else ""))
        memory.boundary("logprob")
        say("logprob", f"after release: {mem(device)}")
        d = turn_deltas(fused_BL, old_BL, batch)
        eps = method.loss.clip_low
        say("logprob", f"{dtype} per-turn |mean dlogpi| fused pass vs update path over "
                       f"{len(d)} turns: p50 {d.quantile(0.5):.2e}, p90 {d.quantile(0.9):.2e}, "
                       f"p99 {d.quantile(0.99):.2e}, max {d.max():.2e}; beyond eps_low {eps}: "
                       f"{float((d > eps).float().mean()):.1%} (the old pass the trainer used "
                       "before bf16 alignment)")

    # -- update: one optimizer update from the update's own log pi_old -----------------------
    with guarded("update"):
        if old_BL is None:
            raise RuntimeError("no old log-probs (the logprob section failed)")
        backend.reload_states()
        reset_peak(device)
        adv = token_advantages(method, batch, trajs, gold_BP, None)
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1.0)
        log = update_policy(backend, sched, UpdateBatch(batch, old_BL, adv.adv_BL, None,
                                                        adv.clip_BL),
                            method.loss, schedule, seed=0, norm_length=args.max_tokens)
        m = log.metrics()
        say("update", f"first update: pg_clipfrac {m['loss/pg_clipfrac']:.4f}, ratio_mean "
                      f"{m['loss/ratio_mean']:.6f} (on-policy: 0 and 1), grad norm "
                      f"{m['optim/grad_norm']:.3f}")
        s = snapshot(device)
        if s:
            phase_peak["update"] = s["peak_reserved_gib"]
        say("update", f"before offload: {mem(device)}"
                      + (f", phase peak reserved {s['peak_reserved_gib']:.2f}" if s else ""))

    # -- wake: offload, release, wake --------------------------------------------------------
    with guarded("wake"):
        before = free_gib(device)
        backend.offload_states()
        after_offload = free_gib(device)
        memory.boundary("update")
        say("wake", f"device free: after the update {before:.1f} GiB, after offload "
                    f"{after_offload:.1f}, after release {free_gib(device):.1f}; {mem(device)}")
        if engine:
            need = engine.need / GIB
            say("wake", f"engine wake needs {need:.1f} GiB: without offload and release "
                        f"{'ok' if before >= need else 'FAIL'}, with them "
                        f"{'ok' if free_gib(device) >= need else 'FAIL'}")
            ok, _ = engine.wake()
            say("wake", f"engine woke: {'ok' if ok else 'FAIL (out of memory)'}; "
                        f"{mem(device)}")

    # -- save: host shards vs save_pretrained on the live module -----------------------------
    for name, how in (("save_checkpoint (host shards)", "ours"),
                      ("save_pretrained on the live ZeRO-2 module", "live")):
        with guarded("save"), tempfile.TemporaryDirectory() as tmp:
            release(device)
            reset_peak(device)
            base = torch.cuda.memory_allocated(device) if on_gpu else 0
            t = time.perf_counter()
            if how == "ours":
                save_checkpoint(tmp, 0, model=backend.unwrapped, tokenizer=_NoTokenizer(),
                                optimizer=None, trainer_state={"step": 0}, keep_last=1)
            else:
                backend.unwrapped.save_pretrained(Path(tmp) / "live")
            took = time.perf_counter() - t
            if not on_gpu:
                say("save", f"{name}: {took:.1f} s (device peak: GPU only; on CPU "
                            "tests/train/test_checkpoint.py measures resident memory)")
                continue
            grew = (torch.cuda.max_memory_allocated(device) - base) / GIB
            weights = params * 2 / GIB
            say("save", f"{name}: device peak +{grew:.2f} GiB ({grew / weights:.2f} x the "
                        f"{weights:.2f} GiB of weights), {took:.1f} s")

    # -- plan ---------------------------------------------------------------------------------
    with guarded("plan"):
        total = (torch.cuda.get_device_properties(0).total_memory if on_gpu else 96 * GIB)
        plan = plan_phases(args, arch, method, schedule, total)
        measured = memory.metrics()
        for ph in ("logprob", "update"):
            peak = measured.get(f"memory/{ph}/phase_peak_reserved_gib", phase_peak.get(ph))
            engine_gib = 1.0  # the plan's asleep engine (ENGINE_ASLEEP_BYTES)
            say("plan", f"{ph}: plan {plan[ph] / GIB:.1f} GiB per GPU (incl. the asleep "
                        f"engine {engine_gib:.0f}, CUDA contexts 2, faiss 0), trainer measured "
                        f"peak reserved " + (f"{peak:.1f}" if peak is not None else "n/a"))
        say("plan", f"rollout: plan {plan['rollout'] / GIB:.1f} GiB per GPU (engine share "
                    f"{args.engine_share} of {total / GIB:.0f}); measured after wake: "
                    f"{mem(device)}")
    if engine:
        engine.close()
    backend.close()
    shutdown_distributed()
    say("done", f"{time.perf_counter() - T0:.0f} s")


class _NoTokenizer:
    """The probe measures the weights' save, not the tokenizer files'."""

    def save_pretrained(self, directory) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)


if __name__ == "__main__":
    main()
