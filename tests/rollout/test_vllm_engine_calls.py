"""The vLLM engine's processes and the trainer's stop, without vLLM (the main venv).

a2tgpo/rollout/vllm_engine.py keeps the job's stop signals (SIGTERM, SIGUSR1) out of the
processes it starts, never waits on an engine process that has ended, and treats an aborted or
dead engine after a stop request as the stop. Here the processes are plain Python ones and the
`LLM` a stand-in; the real engine under a real SIGTERM is tests/train/test_vllm_ranks.py.
"""

import json
import signal
import subprocess
import sys
import threading
import types

import psutil
import pytest

from a2tgpo.ops import preemption
from a2tgpo.ops.preemption import StopRequested, request_stop
from a2tgpo.rollout import vllm_engine
from a2tgpo.rollout.engine import SamplingParams
from a2tgpo.rollout.vllm_engine import (
    EngineDead,
    VllmEngine,
    _stop_signals_blocked,
    _unprotected,
    visible_devices,
    watched_call,
)

SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


@pytest.fixture
def sleeper():
    """A running process (psutil), ended after the test."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield psutil.Process(proc.pid)
    proc.kill()
    proc.wait()


@pytest.fixture
def ended():
    """A process (psutil) that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    p = psutil.Process(proc.pid)
    proc.kill()
    proc.wait()
    return p


@pytest.fixture
def stop():
    """request() files a stop request, as the trainer's signal handler does; cleared after."""
    yield lambda: request_stop("SIGTERM")
    preemption._requests.clear()


# --------------------------------------------------------------------------------------------
# the stop signals kept out of the engine's processes

# vLLM's start-up in miniature, in a fresh interpreter whose resource tracker is not running
# yet (spawning a process starts it, and starting it unblocks SIGTERM): a process started by
# multiprocessing's spawn inside the block, which then installs a SIGTERM handler as vLLM's
# engine core and workers do (one that exits 3)
SPAWN = """
import json, multiprocessing, signal, sys, time

def engine(ready):
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))
    ready.send(True)
    time.sleep(600)

if __name__ == "__main__":
    from a2tgpo.rollout.vllm_engine import _stop_signals_blocked

    ctx = multiprocessing.get_context("spawn")
    ready, ready_w = ctx.Pipe(duplex=False)  # a pipe: no resource tracker before the block
    with _stop_signals_blocked():
        proc = ctx.Process(target=engine, args=(ready_w,))
        proc.start()
    ready.poll(120)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    print(json.dumps({"pid": proc.pid, "mine": sorted(int(s) for s in mask)}), flush=True)
    proc.join(600)
"""


def test_processes_started_meanwhile_keep_sigterm_blocked_through_their_handler(tmp_path):
    script = tmp_path / "spawn.py"
    script.write_text(SPAWN)
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = json.loads(driver.stdout.readline())
        engine = psutil.Process(line["pid"])
        # the starting thread got its own mask back; the child blocks SIGTERM and SIGUSR1 in
        # every thread, its handler notwithstanding
        assert signal.SIGTERM not in line["mine"] and signal.SIGUSR1 not in line["mine"]
        assert _unprotected([engine]) == []
        engine.send_signal(signal.SIGTERM)
        # kill() queues it at once: pending, not delivered, and the process runs on
        assert int(_status(engine.pid)["ShdPnd"], 16) & SIGTERM_BIT
        assert engine.status() != psutil.STATUS_ZOMBIE
    finally:
        driver.kill()
        driver.wait()
        for p in psutil.Process().children(recursive=True):
            p.kill()


def test_unprotected_names_a_process_that_sigterm_would_reach(sleeper):
    found = _unprotected([sleeper])
    assert found and f"process {sleeper.pid}" in found[0] and "SIGTERM/SIGUSR1" in found[0]


def test_a_signal_that_arrives_during_the_block_is_delivered_after_it():
    got = []
    previous = signal.signal(signal.SIGUSR1, lambda *a: got.append("SIGUSR1"))
    try:
        with _stop_signals_blocked():
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
            assert got == []
        assert got == ["SIGUSR1"]
    finally:
        signal.signal(signal.SIGUSR1, previous)


# --------------------------------------------------------------------------------------------
# calls that do not outlive the engine's processes


def test_watched_call_returns_and_raises_as_the_call_does(sleeper):
    assert watched_call(lambda x, y=0: x + y, (2,), {"y": 3}, [sleeper], what="t") == 5
    with pytest.raises(KeyError, match="boom"):
        watched_call(lambda: {}["boom"], (), {}, [sleeper], what="t")
    # no processes (an in-process engine): in the caller's own thread
    assert watched_call(threading.get_ident, (), {}, [], what="t") == threading.get_ident()


def test_a_call_into_an_ended_engine_raises_instead_of_waiting(ended):
    never = threading.Event()
    # a stand-in for vLLM's utility call on a dead engine core: no answer comes (it gives up
    # after 60 s, so that a broken watch fails this test instead of hanging it)
    with pytest.raises(EngineDead, match=f"pid {ended.pid}.*during collective_rpc"):
        watched_call(lambda: never.wait(60), (), {}, [ended], what="collective_rpc",
                     poll_s=0.05)


# --------------------------------------------------------------------------------------------
# VllmEngine's calls: an aborted or dead engine, with and without a stop request


class FakeLLM:
    """The parts of vllm.LLM that VllmEngine calls; `finish` is what generate reports, and
    `block` makes every call wait (an engine that never answers)."""

    def __init__(self, finish="length", block=False):
        self.finish, self.block, self.calls = finish, threading.Event() if block else None, []

    def _answer(self, name):
        self.calls.append(name)
        if self.block is not None:
            self.block.wait(60)

    def generate(self, prompts, params, use_tqdm):
        self._answer("generate")
        out = types.SimpleNamespace(token_ids=[7], logprobs=[{7: types.SimpleNamespace(
            logprob=-0.5)}], finish_reason=self.finish, stop_reason=None)
        return [types.SimpleNamespace(outputs=[out]) for _ in prompts]

    def collective_rpc(self, method, args=()):
        self._answer(method)

    def reset_prefix_cache(self):
        self._answer("reset_prefix_cache")

    def sleep(self, level):
        self._answer("sleep")

    def wake_up(self):
        self._answer("wake_up")


class FakeLLMEngine:
    """The parts of vLLM's LLMEngine that `VllmEngine.submit` / `wait_any` / `cancel` call: one
    request finishes per step, the latest added first (the reverse of submission), its one
    sampled id the prompt's first id; `finish` is its finish reason, `block` makes step wait."""

    def __init__(self, llm, finish="length", block=False):
        self.llm, self.finish, self.block = llm, finish, block
        self.running: dict[str, list[int]] = {}
        self.aborted: list[str] = []

    def add_request(self, rid, prompt, params):
        assert params["output_kind"] == "FINAL_ONLY" and params["seed"] is not None
        self.running[rid] = prompt["prompt_token_ids"]

    def step(self):
        self.llm._answer("step")
        if self.block:
            threading.Event().wait(60)
        rid, prompt = self.running.popitem()
        out = types.SimpleNamespace(token_ids=[prompt[0]], logprobs=[{prompt[0]: types.
                                    SimpleNamespace(logprob=-0.5)}],
                                    finish_reason=self.finish, stop_reason=None)
        return [types.SimpleNamespace(request_id=rid, finished=True, outputs=[out])]

    def has_unfinished_requests(self):
        return bool(self.running)

    def abort_request(self, rids):
        self.aborted += rids
        for r in rids:
            self.running.pop(r, None)


@pytest.fixture
def fake_vllm(monkeypatch):
    """Stand-ins for the vllm modules VllmEngine imports in its calls."""
    class EngineDeadError(Exception):
        pass

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(
        SamplingParams=lambda **kw: kw))
    monkeypatch.setitem(sys.modules, "vllm.inputs", types.SimpleNamespace(TokensPrompt=dict))
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", types.SimpleNamespace(
        RequestOutputKind=types.SimpleNamespace(FINAL_ONLY="FINAL_ONLY")))
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.exceptions",
                        types.SimpleNamespace(EngineDeadError=EngineDeadError))
    monkeypatch.setattr(vllm_engine, "STOP_GRACE_S", 0.1)
    monkeypatch.setattr(vllm_engine, "WATCH_S", 0.05)
    return EngineDeadError


def _engine(llm, procs):
    """A VllmEngine around `llm` whose engine processes are `procs` (no vLLM started)."""
    eng = VllmEngine.__new__(VllmEngine)
    eng.llm, eng.procs, eng.gone = llm, procs, None
    eng._in_flight, eng._submitted = {}, 0
    eng.sleep_enabled, eng.asleep, eng.weight_chunk_bytes = True, False, 1 << 20
    return eng


PARAMS = SamplingParams(max_tokens=4)


def test_aborted_requests_are_the_stop_only_after_a_stop_request(fake_vllm, sleeper, stop):
    eng = _engine(FakeLLM(finish="abort"), [sleeper])
    with pytest.raises(RuntimeError, match="finish_reason='abort'"):
        eng.generate([[1, 2]], PARAMS)
    stop()
    with pytest.raises(StopRequested, match="aborted 2 of 2 requests"):
        eng.generate([[1, 2], [3]], PARAMS)


def test_a_dead_engine_is_an_error_or_after_a_stop_request_the_stop(fake_vllm, ended, stop):
    import torch

    eng = _engine(FakeLLM(block=True), [ended])
    with pytest.raises(EngineDead, match=f"pid {ended.pid}.*during generate"):
        eng.generate([[1, 2]], PARAMS)
    for call in (eng.sleep, eng.wake, lambda: eng.update_weights({"w": torch.zeros(2)})):
        with pytest.raises(EngineDead):
            call()
    assert eng.llm.calls == ["generate"]  # known dead: not called again
    stop()
    with pytest.raises(StopRequested, match="stop requested.*during generate"):
        eng.generate([[1, 2]], PARAMS)
    # the step under way ends without its engine: nothing to free, wake or send
    eng.sleep()
    eng.wake()
    eng.update_weights({"w": torch.zeros(2)})
    assert eng.llm.calls == ["generate"]


def test_vllms_engine_dead_error_counts_as_a_dead_engine(fake_vllm, sleeper, stop):
    eng = _engine(FakeLLM(), [sleeper])

    def dead(*a, **kw):
        raise fake_vllm("EngineCore encountered an issue")

    eng.llm.wake_up = dead
    with pytest.raises(EngineDead, match="EngineDeadError"):
        eng.wake()
    stop()
    eng.wake()  # after the stop request: skipped
    eng.llm.generate = dead
    with pytest.raises(StopRequested):
        eng.generate([[1]], PARAMS)


# --------------------------------------------------------------------------------------------
# the per-trajectory schedule's calls (submit, wait_any, cancel)


def _streaming(procs, **engine_kw):
    llm = FakeLLM()
    llm.llm_engine = FakeLLMEngine(llm, **engine_kw)
    return _engine(llm, procs)


def test_each_finished_request_sets_its_own_future(fake_vllm, sleeper):
    eng = _streaming([sleeper])
    futs = [eng.submit([10 + i, 1], PARAMS, seed=i) for i in range(3)]
    eng.wait_any()  # one finishes per step: the last submitted
    assert [f.done() for f in futs] == [False, False, True]
    while not all(f.done() for f in futs):
        eng.wait_any()
    assert [f.result().token_ids for f in futs] == [(10,), (11,), (12,)]
    assert not eng._in_flight
    eng.wait_any()  # nothing in flight: returns at once, asks nothing
    assert eng.llm.calls == ["step"] * 3


def test_submitted_requests_aborted_are_the_stop_only_after_a_stop_request(fake_vllm, sleeper,
                                                                           stop):
    eng = _streaming([sleeper], finish="abort")
    eng.submit([1], PARAMS, seed=0)
    with pytest.raises(RuntimeError, match="finish_reason='abort'"):
        eng.wait_any()
    stop()
    eng.submit([1], PARAMS, seed=0)
    with pytest.raises(StopRequested, match="aborted 1 requests"):
        eng.wait_any()


def test_a_dead_engine_while_waiting_is_engine_dead_or_the_stop(fake_vllm, ended, stop):
    eng = _streaming([ended], block=True)
    fut = eng.submit([1], PARAMS, seed=0)
    with pytest.raises(EngineDead, match=f"pid {ended.pid}.*during generate"):
        eng.wait_any()
    assert not fut.done()
    eng.cancel()  # the engine is gone: nothing to abort, nothing left in flight
    assert not eng._in_flight and eng.llm.llm_engine.aborted == []
    stop()
    with pytest.raises(StopRequested):
        eng.submit([1], PARAMS, seed=0)


def test_cancel_aborts_what_is_in_flight(fake_vllm, sleeper):
    eng = _streaming([sleeper])
    futs = [eng.submit([i + 1], PARAMS, seed=i) for i in range(2)]
    eng.cancel()
    assert eng.llm.llm_engine.aborted == ["a2tgpo-1", "a2tgpo-2"]
    assert not eng._in_flight and not any(f.done() for f in futs)


def test_visible_devices_maps_local_indices_through_the_parent_list():
    assert visible_devices((2, 3), None) == "2,3"
    # the launcher gave the node's GPUs 4..7: local GPU 1 is physical 5
    assert visible_devices((1,), "4,5,6,7") == "5"
    with pytest.raises(ValueError, match="beyond CUDA_VISIBLE_DEVICES"):
        visible_devices((4,), "4,5,6,7")
