"""Checkpoints: exact resume, atomicity and pruning, HF loadability, preemption, data order."""

import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from a2tgpo.model.toy import ToyBackboneConfig, build_model, build_tokenizer
from a2tgpo.ops.preemption import EXIT_PREEMPTED, PreemptionHandler
from a2tgpo.train.checkpoint import (
    BACKEND_DIR,
    COMPLETE,
    HASH_CHUNK,
    DamagedCheckpoint,
    DataExhausted,
    DataOrder,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)

TINY = ToyBackboneConfig(
    vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
)
TEXTS = ["Who directed The Silent Harbor?", "<think> reasoning </think>",
         "<answer> The final answer is \\[ \\boxed{Drouora} \\] </answer>"] * 10
REPO = Path(__file__).resolve().parents[2]
N_ITEMS, BATCH, EPOCHS = 6, 2, 2  # 3 batches an epoch: a resume after 3 steps is at a boundary


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TINY, iter(TEXTS))


def fresh(tokenizer, seed):
    """Model, AdamW and a warm-up schedule; `seed` sets the initial weights."""
    model = build_model(replace(TINY, seed=seed), tokenizer).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return model, opt, sched


def train(model, opt, sched, order, steps):
    """Next-token CE on random ids whose shape and values use all three global RNGs."""
    vocab = model.config.vocab_size
    losses = []
    for _ in range(steps - order.batches):  # the steps not yet run (one batch each)
        items = torch.tensor(order.next_batch(BATCH))
        length = random.randint(4, 8)
        offset = int(np.random.randint(vocab))
        ids = (torch.randint(0, vocab, (BATCH, length)) + offset + items[:, None]) % vocab
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def save(run_dir, step, model, tokenizer, opt, sched=None, **kw):
    kw.setdefault("keep_last", 2)
    return save_checkpoint(run_dir, step, model=model, tokenizer=tokenizer, optimizer=opt,
                           scheduler=sched, trainer_state={"step": step}, **kw)


def test_exact_resume(tmp_path, tokenizer):
    model, opt, sched = fresh(tokenizer, seed=0)
    seed_all(0)
    order = DataOrder(N_ITEMS, EPOCHS, seed=7)
    straight = train(model, opt, sched, order, 6)
    assert len(straight) == 6

    model_a, opt_a, sched_a = fresh(tokenizer, seed=0)
    seed_all(0)
    order_a = DataOrder(N_ITEMS, EPOCHS, seed=7)
    first = train(model_a, opt_a, sched_a, order_a, 3)
    state = {"step": 3, "data": order_a.state_dict(), "best_dev": 0.25}
    path = save_checkpoint(tmp_path, 3, model=model_a, tokenizer=tokenizer, optimizer=opt_a,
                           scheduler=sched_a, trainer_state=state, keep_last=2)
    saved_rng = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())

    # everything a restarted process would have differently: other RNG states, other weights
    seed_all(123)
    model_b, opt_b, sched_b = fresh(tokenizer, seed=1)
    assert not torch.equal(model_b.lm_head.weight, model_a.lm_head.weight)
    assert latest_checkpoint(tmp_path) == path
    loaded = load_checkpoint(path, model=model_b, optimizer=opt_b, scheduler=sched_b)
    assert loaded == state
    assert random.getstate() == saved_rng[0]
    assert np.array_equal(np.random.get_state()[1], saved_rng[1])
    assert torch.equal(torch.get_rng_state(), saved_rng[2])
    order_b = DataOrder(N_ITEMS, EPOCHS, seed=7)
    order_b.load_state_dict(loaded["data"])
    rest = train(model_b, opt_b, sched_b, order_b, 6)

    assert first + rest == straight
    assert sched_b.state_dict()["last_epoch"] == sched.state_dict()["last_epoch"] == 6
    for (name, a), (_, b) in zip(model.state_dict().items(), model_b.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    # the tied head is still tied after loading the weights in place
    assert model_b.lm_head.weight.data_ptr() == model_b.model.embed_tokens.weight.data_ptr()


def test_model_dir_loads_with_auto_classes(tmp_path, tokenizer):
    model, opt, _ = fresh(tokenizer, seed=0)
    path = save(tmp_path, 5, model, tokenizer, opt)
    assert (path / "model" / "model.safetensors").is_file()
    assert (path / "model" / "config.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(path / "model", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path / "model")
    ids = torch.tensor([tok.encode(TEXTS[0], add_special_tokens=False)])
    assert ids.tolist() == [tokenizer.encode(TEXTS[0], add_special_tokens=False)]
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


def test_atomicity_and_pruning(tmp_path, tokenizer, monkeypatch):
    model, opt, sched = fresh(tokenizer, seed=0)
    ckpts = tmp_path / "checkpoints"
    steps = lambda: [checkpoint_step(p) for p in list_checkpoints(tmp_path)]  # noqa: E731

    assert latest_checkpoint(tmp_path) is None and list_checkpoints(tmp_path) == []
    for step in (1, 2, 3, 4, 5):
        save(tmp_path, step, model, tokenizer, opt, sched, keep_last=2, keep_steps={1, 3})
    assert steps() == [1, 3, 4, 5]
    meta = (ckpts / "step_000005" / "meta.json").read_text()
    assert '"step": 5' in meta and '"state.pt"' in meta

    # what a job killed mid-save or mid-prune can leave: a hidden temporary directory, and a
    # step directory without the marker; neither counts, the next save removes both
    partial = ckpts / ".step_000006.x1y2.tmp" / "model"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"trunc")
    (ckpts / "step_000007" / "model").mkdir(parents=True)
    assert latest_checkpoint(tmp_path) == ckpts / "step_000005"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(ckpts / "step_000007", model=model)

    # an exception during a save leaves nothing behind
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(tokenizer, "save_pretrained", boom)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, 8, model, tokenizer, opt)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == ckpts / "step_000005"

    save(tmp_path, 9, model, tokenizer, opt, sched, keep_last=1, keep_steps={3})
    assert steps() == [3, 9]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000003", "step_000009"]
    assert (ckpts / "step_000009" / COMPLETE).is_file()

    # a truncated file is caught by the sizes in meta.json rather than loaded
    state_pt = ckpts / "step_000009" / "state.pt"
    state_pt.write_bytes(state_pt.read_bytes()[:-1])
    with pytest.raises(ValueError, match="damaged: state.pt"):
        load_checkpoint(ckpts / "step_000009", model=model)

    with pytest.raises(ValueError, match="keep_last"):
        save(tmp_path, 10, model, tokenizer, opt, keep_last=0)
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 10, model=model, tokenizer=tokenizer, optimizer=opt,
                        trainer_state={"x": object()}, keep_last=1)


def _flip_byte(path):
    """Damage a file in place without changing its size: the middle byte, inverted."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_same_size_damage_is_caught_and_the_run_falls_back(tmp_path, tokenizer, caplog):
    model, opt, sched = fresh(tokenizer, seed=0)
    ckpts = tmp_path / "checkpoints"

    def backend(tmp):  # what a training backend writes: its optimizer state in backend/
        (tmp / BACKEND_DIR).mkdir()
        (tmp / BACKEND_DIR / "shard_0.pt").write_bytes(os.urandom(4096))

    for step in (1, 2, 3):
        save(tmp_path, step, model, tokenizer, opt, sched, keep_last=3, extra_state=backend,
             optimizer_states=2)
    # the newest two keep the optimizer state, each with its files' hashes
    assert [(ckpts / f"step_00000{i}" / BACKEND_DIR / "sha256.json").is_file()
            for i in (1, 2, 3)] == [False, True, True]
    assert not (ckpts / "step_000001" / BACKEND_DIR).exists()
    for i in (1, 2, 3):
        verify_checkpoint(ckpts / f"step_00000{i}")

    # weights damaged in place: same size, so the sizes alone would pass
    _flip_byte(ckpts / "step_000003" / "model" / "model.safetensors")
    with pytest.raises(DamagedCheckpoint, match="model/model.safetensors has sha256"):
        verify_checkpoint(ckpts / "step_000003")
    with pytest.raises(DamagedCheckpoint, match="model/model.safetensors"):
        load_checkpoint(ckpts / "step_000003", model=model)
    with caplog.at_level("WARNING"):
        assert resume_checkpoint(tmp_path) == ckpts / "step_000002"
    assert "step_000003 is damaged: model/model.safetensors" in caplog.text
    # kept for inspection under a name nothing lists or prunes
    assert (ckpts / "damaged_step_000003" / COMPLETE).is_file()
    assert [checkpoint_step(p) for p in list_checkpoints(tmp_path)] == [1, 2]

    # the optimizer state is checked too: step 2's, then the run falls back to step 1
    _flip_byte(ckpts / "step_000002" / BACKEND_DIR / "shard_0.pt")
    with pytest.raises(DamagedCheckpoint, match="backend/shard_0.pt has sha256"):
        verify_checkpoint(ckpts / "step_000002")
    assert resume_checkpoint(tmp_path) == ckpts / "step_000001"
    # the training state too, and nothing left: a fresh run
    _flip_byte(ckpts / "step_000001" / "state.pt")
    assert resume_checkpoint(tmp_path) is None
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "damaged_step_000001", "damaged_step_000002", "damaged_step_000003"]

    # a later save prunes checkpoints, not the damaged ones
    for step in (4, 5):
        save(tmp_path, step, model, tokenizer, opt, sched, keep_last=1)
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "damaged_step_000001", "damaged_step_000002", "damaged_step_000003", "step_000005"]
    with pytest.raises(ValueError, match="optimizer_states"):
        save(tmp_path, 6, model, tokenizer, opt, optimizer_states=0)


def wait_for(predicate):
    for _ in range(200):
        if predicate():
            return True
        time.sleep(0.005)
    return False


def test_preemption_handler(tmp_path, tokenizer, monkeypatch):
    assert EXIT_PREEMPTED not in (0, 1, 2) and EXIT_PREEMPTED == 75
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    model, opt, _ = fresh(tokenizer, seed=0)
    save_tokenizer = tokenizer.save_pretrained

    def save_while_signalled(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal arrives during the save
        wait_for(lambda: len(handler.received) == 2)
        return save_tokenizer(*a, **k)

    with PreemptionHandler() as handler:
        assert not handler.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert wait_for(lambda: handler.requested)  # and the test process is still alive
        monkeypatch.setattr(tokenizer, "save_pretrained", save_while_signalled)
        path = save(tmp_path, 1, model, tokenizer, opt)
    assert handler.received == ["SIGUSR1", "SIGTERM"]
    assert (path / COMPLETE).is_file() and latest_checkpoint(tmp_path) == path
    assert {s: signal.getsignal(s) for s in before} == before


def test_data_order_is_seeded():
    def run(seed):
        order = DataOrder(10, 3, seed=seed)
        return [order.next_batch(3) for _ in range(9)]

    a = run(0)
    assert a == run(0) and a != run(1)
    # 3 batches of 3 per epoch, the tenth item's slot skipped; no repeats within an epoch
    for epoch in range(3):
        items = sum(a[3 * epoch:3 * epoch + 3], [])
        assert len(set(items)) == 9 and set(items) <= set(range(10))


@pytest.mark.parametrize("split", range(9))
def test_data_order_resume(split):
    def run(order, n):
        return [order.next_batch(3) for _ in range(n)]

    full = run(DataOrder(10, 3, seed=5), 9)
    first = DataOrder(10, 3, seed=5)
    head = run(first, split)
    resumed = DataOrder(10, 3, seed=5)
    resumed.load_state_dict(first.state_dict())
    # split in (3, 6) is exactly at an epoch boundary: the next epoch starts, not zero steps
    assert resumed.batches == split
    assert head + run(resumed, 9 - split) == full


def test_data_order_exhaustion_and_misuse():
    order = DataOrder(4, 2, seed=0)
    for _ in range(4):
        order.next_batch(2)
    with pytest.raises(DataExhausted, match=r"after 4 batches: all 2 epochs of 4 items"):
        order.next_batch(2)
    with pytest.raises(ValueError, match="batch size"):
        DataOrder(4, 1, seed=0).next_batch(5)
    with pytest.raises(ValueError, match="resumed with"):
        DataOrder(5, 2, seed=0).load_state_dict(DataOrder(4, 2, seed=0).state_dict())


def test_data_order_resumes_into_more_epochs():
    # a run extended to more steps: 2 epochs saved after 4 batches of 3 out of 10 items
    # (epoch 0: batches 1-3, epoch 1: batch 4), resumed into 3 epochs, serves what an order
    # of 3 epochs from the start serves
    straight = DataOrder(10, 3, seed=5)
    expect = [straight.next_batch(3) for _ in range(9)]
    short = DataOrder(10, 2, seed=5)
    head = [short.next_batch(3) for _ in range(4)]
    longer = DataOrder(10, 3, seed=5)
    longer.load_state_dict(short.state_dict())
    assert head + [longer.next_batch(3) for _ in range(5)] == expect
    # fewer epochs than saved: refused
    with pytest.raises(ValueError, match="resumed with"):
        DataOrder(10, 1, seed=5).load_state_dict(short.state_dict())


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed")
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                    reason="needs Linux's resettable peak resident memory")
@pytest.mark.expensive  # ~40 s on 2 cores: CI runs it in its expensive step (.ci/run)
def test_saving_a_zero2_model_does_not_copy_its_weights(tmp_path):
    """Under ZeRO-1/2 every parameter is a view of one flat buffer; a save of the live module
    through save_pretrained clones each of them on the device that holds the weights (GPU 0,
    beside the awake rollout engine). The trainer's save (`save_checkpoint`, as `rl.save`
    calls it) holds one weights shard in host memory at a time instead.

    Bound (save_memory_worker.py's model: 327 MB of fp32 weights in 32 MiB shards): the save
    may add one shard (33.6 MB) or, when a tensor is larger than a shard, that tensor (25.2 MB
    here), plus the checkpoint hashing's buffers (8 threads x HASH_CHUNK = 33.6 MB) and 16 MiB
    for the interpreter and the files' metadata: 0.26 of the weights. Cloning the weights adds
    0.93 of them (measured with `model.save_pretrained` in place of `save_weights`; the
    fixed save measured 0.19)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", MALLOC_MMAP_THRESHOLD_="65536",
               MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name(
        "save_memory_worker.py")), "--out", str(tmp_path / "run")], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    assert m["parameter_storages"] == 1  # ZeRO-2 flattened them: the case that clones
    bound = (max(m["shard_bytes"], m["largest_tensor_bytes"]) + 8 * HASH_CHUNK + 16 * 2**20)
    assert m["growth_bytes"] < bound, (m, bound / m["weights_bytes"])
    # and what was written is the model
    ckpt = latest_checkpoint(tmp_path / "run")
    loaded = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    assert sum(p.numel() for p in loaded.parameters()) * 4 == m["weights_bytes"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
