"""a2tgpo/rollout/weight_handles.py: a state dict reaches another process as handles to the
sender's memory, not as a copy (the `ipc` weight sync). The receiver here is a spawned process,
as vLLM's engine core is; the whole sync through vLLM is tests/rollout/test_weight_sync.py."""

import multiprocessing
import pickle

import pytest
import torch

from a2tgpo.rollout.weight_handles import pack, unpack


def _receive(conn, cuda_uuid):
    """In the spawned process: unpack, report each tensor's values and whether it lives in
    shared memory, then add 1 in place to every tensor (the sender sees it only if both map the
    same memory)."""
    pairs = unpack(conn.recv_bytes(), cuda_uuid)
    conn.send([(name, t.cpu().tolist(), t.is_shared()) for name, t in pairs])
    with torch.no_grad():
        for _, t in pairs:
            t.add_(1)
    if cuda_uuid is not None:
        torch.cuda.synchronize()
    del pairs
    conn.send("done")


def _round_trip(packed):
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_receive, args=(theirs, packed.cuda_uuid))
    proc.start()
    theirs.close()  # the receiver's end lives in the receiver only: its exit ends recv()
    try:
        ours.send_bytes(packed.payload)
        got = ours.recv()
        assert ours.recv() == "done"
    except EOFError:
        pytest.fail("the receiving process failed (its traceback is above)")
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    return got


def test_cpu_tensors_arrive_as_the_senders_shared_memory():
    model = torch.nn.Linear(3, 2)
    state = model.state_dict()
    before = {k: v.clone() for k, v in state.items()}
    packed = pack(state)
    # Linear(3, 2): weight 6 + bias 2 float32 = 32 bytes moved into shared memory, once
    assert packed.copied == 32 and packed.cuda_uuid is None
    got = _round_trip(packed)
    assert [(n, v) for n, v, _ in got] == [(k, v.tolist()) for k, v in before.items()]
    assert all(shared for _, _, shared in got)
    # the receiver's in-place +1 is visible in the model's own parameters: the same memory
    torch.testing.assert_close(model.weight.detach(), before["weight"] + 1)
    torch.testing.assert_close(model.bias.detach(), before["bias"] + 1)
    assert model.weight.is_shared() and pack(model.state_dict()).copied == 0  # moved once


def test_a_large_tensor_is_a_handle_of_a_few_hundred_bytes_and_tied_storage_counts_once():
    big = torch.zeros(1 << 20)  # 4 MiB of float32
    packed = pack({"a": big, "b": big, "c": big[10:20]})  # one storage, three tensors
    assert packed.copied == 4 << 20  # the one storage, counted once
    # handles, not data: 3 tensors' rebuild calls and fd couriers, ~1 KB against 4 MiB
    assert len(packed.payload) < 2000
    got = _round_trip(packed)
    assert [n for n, _, _ in got] == ["a", "b", "c"]
    # a, b and c share one storage: +1 from each of the three lands on big[10:20] three times
    assert float(big[0]) == 2.0 and float(big[15]) == 3.0


def test_a_payload_naming_anything_but_a_tensor_rebuild_is_refused():
    class Evil:
        def __reduce__(self):
            import os
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="posix.system is not a tensor rebuild"):
        unpack(pickle.dumps([("w", Evil())]))


def test_tensors_on_several_devices_or_a_cuda_tensor_without_its_gpu_are_refused():
    with pytest.raises(ValueError, match="meta"):
        pack({"w": torch.zeros(2, device="meta")})
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="several devices"):
            pack({"a": torch.zeros(2), "b": torch.zeros(2, device="cuda")})


@pytest.mark.gpu  # bench/gpu_check.sh runs it (vLLM is not on the device: the handles alone)
def test_cuda_tensors_arrive_as_ipc_handles_to_the_senders_device_memory():
    model = torch.nn.Linear(64, 32).cuda()
    state = model.state_dict()
    before = {k: v.clone() for k, v in state.items()}
    packed = pack(state)
    assert packed.copied == 0 and packed.cuda_uuid == str(
        torch.cuda.get_device_properties(0).uuid)
    got = _round_trip(packed)
    assert [(n, v) for n, v, _ in got] == [(k, v.tolist()) for k, v in before.items()]
    torch.cuda.ipc_collect()
    torch.testing.assert_close(model.weight.detach(), before["weight"] + 1)
