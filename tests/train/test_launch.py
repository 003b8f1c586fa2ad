"""`a2tgpo launch`: ranks get their rendezvous, a stop reaches them and nothing kills them, and a
failing rank stops the others. Real processes (a small rank script), no training."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from a2tgpo.ops.preemption import EXIT_PREEMPTED
from a2tgpo.train.launch import rank_envs, remove_shm_buffers

# each rank: a gloo all-reduce of its rank (the rendezvous works), then per MODE
RANK = textwrap.dedent("""
    import os, signal, sys, time
    import torch, torch.distributed as dist
    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    stopped = []
    signal.signal(signal.SIGTERM, lambda s, f: stopped.append(s))
    dist.init_process_group("gloo")
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    open(f"{out}/rank{rank}.env", "w").write(
        f"{os.environ['LOCAL_RANK']} {os.environ['WORLD_SIZE']} {x.item()} "
        f"{os.environ['OMP_NUM_THREADS']} {os.environ['MKL_NUM_THREADS']}")
    if mode == "done":
        # what DeepSpeed's CPU all-reduce leaves behind: one shared-memory buffer per rank,
        # named by uid, rendezvous address and port, and rank
        name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_"
                f"{os.environ['MASTER_PORT']}_{rank}")
        open(f"/dev/shm/{name}", "wb").write(b"x")
        open(f"{out}/rank{rank}.shm", "w").write(name)
        # leave the group first, as the trainer does (rl._close): gloo's destructors at exit,
        # with the other rank still in the group, sometimes abort (status 134; seen in CI)
        dist.destroy_process_group()
        sys.exit(0)
    if mode == "fail" and rank == 1:
        # os._exit: a normal exit runs gloo's destructors while rank 0 still holds the group,
        # and they sometimes abort ("terminate called without an active exception", status
        # 134 instead of 3: seen once in 4 runs under load)
        os._exit(3)
    open(f"{out}/rank{rank}.ready", "w").close()
    deadline = time.time() + 120
    while not stopped and time.time() < deadline:
        time.sleep(0.05)
    if mode == "stop":
        time.sleep(2)  # a checkpoint being written after the signal
        open(f"{out}/rank{rank}.saved", "w").close()
        sys.exit(75)
    sys.exit(1)  # fail mode, the surviving rank: should have been stopped by the launcher
""")


def _launch(tmp_path, mode, nproc=2):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    cmd = [sys.executable, "-m", "a2tgpo.cli", "launch", "--nproc", str(nproc), "--",
           sys.executable, str(script), str(tmp_path), mode]
    # the job's threads (the rule's, as Snakemake sets them): 2 and 3 for each of 2 ranks
    env = {**os.environ, "OMP_NUM_THREADS": "5", "MKL_NUM_THREADS": "6"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _wait_for(paths, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.05)


def test_remove_shm_buffers_touches_only_its_own_rendezvous(tmp_path):
    uid = os.getuid()
    own = [f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_29500_{r}" for r in (0, 1)]
    other = [f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_29501_0",   # another job's port
             f"deepspeed_allreduce_buffer_{uid}_127.0.0.2_29500_0",   # another address
             f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_29500_0x",  # not a rank suffix
             f"deepspeed_allreduce_buffer_{uid + 1}_127.0.0.1_29500_0"]  # another user's
    for name in own + other:
        (tmp_path / name).write_bytes(b"x")
    assert sorted(remove_shm_buffers("127.0.0.1", "29500", shm=str(tmp_path))) == own
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(other)


def test_ranks_get_their_rendezvous(tmp_path):
    proc = _launch(tmp_path, "done")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    # local rank, world size, the all-reduce of ranks 0 + 1, and each rank's share of the
    # job's 5 OMP threads (5 // 2) and 6 MKL threads (6 // 2)
    assert [(tmp_path / f"rank{r}.env").read_text() for r in (0, 1)] == ["0 2 1.0 2 3",
                                                                          "1 2 1.0 2 3"]
    # the ranks' shared-memory buffers are gone once the launcher is done
    names = [(tmp_path / f"rank{r}.shm").read_text() for r in (0, 1)]
    assert [n for n in names if os.path.exists(f"/dev/shm/{n}")] == []


def test_sigterm_reaches_every_rank_which_then_saves_and_exits_75(tmp_path):
    proc = _launch(tmp_path, "stop")
    _wait_for([tmp_path / f"rank{r}.ready" for r in (0, 1)], proc)
    proc.send_signal(signal.SIGTERM)  # to the launcher only, as a job script would get it
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    # every rank got it and finished its save after the signal: nobody was killed
    assert all((tmp_path / f"rank{r}.saved").exists() for r in (0, 1)), out[-3000:]


def test_a_failing_rank_stops_the_others_and_gives_its_status(tmp_path):
    proc = _launch(tmp_path, "fail")
    out, _ = proc.communicate(timeout=120)
    # rank 1 exited 3; rank 0 (waiting for a signal, up to 120 s) was stopped by the launcher
    # with SIGTERM, which makes it exit 1 at once; the job's status is rank 1's
    assert proc.returncode == 3, out[-3000:]
    assert "rank 1 exited with status 3" in out


def test_rank_envs_for_several_nodes():
    envs = rank_envs(2, nnodes=3, environ={"SLURM_NODEID": "1", "SLURM_JOB_ID": "7",
                                           "SLURM_JOB_NODELIST": "gpu[03-05]"})
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [
        ("2", "0", "6"), ("3", "1", "6")]
    assert {e["MASTER_ADDR"] for e in envs} == {"gpu03"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    with pytest.raises(ValueError, match="SLURM_NODEID"):
        rank_envs(2, nnodes=2, environ={})
