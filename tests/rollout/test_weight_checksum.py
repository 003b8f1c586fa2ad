"""Weight checksums (a2tgpo/rollout/weight_checksum.py): the same for the same values in any
layout, different for any changed value. The engine side on a real vLLM model is
tests/rollout/test_vllm_engine.py."""

import torch

from a2tgpo.rollout import weight_checksum as wc


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g) for n, shape in
            [("q", (8, 4)), ("k", (4, 4)), ("v", (4, 4)), ("norm", (4,))]}


def test_the_checksum_ignores_layout_and_zero_padding():
    w = _weights()
    fused = {"qkv": torch.cat([w["q"], w["k"], w["v"]]), "norm": w["norm"]}
    assert wc.state_checksum(w) == wc.state_checksum(fused)
    # transposed, reordered, padded with zeros (vLLM's vocabulary padding), -0.0 for 0.0
    padded = torch.cat([fused["qkv"].t().flip(0).reshape(-1), torch.zeros(7),
                        torch.tensor([-0.0])])
    assert wc.tensor_checksum(padded) == wc.tensor_checksum(fused["qkv"])
    # bf16 values widen to float32 exactly: the same numbers, the same checksum
    b = w["q"].bfloat16()
    assert wc.tensor_checksum(b) == wc.tensor_checksum(b.float())


def test_any_changed_value_changes_the_checksum():
    w = _weights()
    base = wc.state_checksum(w)
    for name, t in w.items():
        for i in range(t.numel()):
            changed = dict(w, **{name: t.clone()})
            changed[name].view(-1)[i] = torch.nextafter(t.view(-1)[i], torch.tensor(1e9))
            assert wc.state_checksum(changed) != base, (name, i)
    assert wc.state_checksum(_weights(seed=1)) != base
    # one element a float step up, another one down: their bit patterns move by +1 and -1,
    # which a plain sum of bit patterns would not see (the mix makes them not cancel)
    q = w["q"].clone().view(-1)
    q[0] = torch.nextafter(q[0], torch.tensor(1e9) * q[0].sign())  # |q0| up: bits + 1
    q[1] = torch.nextafter(q[1], torch.tensor(0.0))  # |q1| down: bits - 1
    assert wc.state_checksum(dict(w, q=q.view(8, 4))) != base


def test_a_tied_weight_counts_once():
    emb = torch.randn(6, 4)
    tied = {"embed": emb, "lm_head": emb}
    assert wc.state_checksum(tied) == wc.tensor_checksum(emb)
    untied = {"embed": emb, "lm_head": emb.clone()}
    assert wc.state_checksum(untied) != wc.state_checksum(tied)


def test_workers_shards_add_up_and_replicas_count_once():
    w = _weights()
    # tp 2: q, k, v sharded by rows, norm replicated on both workers
    shards = [{"qkv": wc.state_checksum({n: w[n][r::2] for n in "qkv"}),
               "norm": wc.tensor_checksum(w["norm"])} for r in (0, 1)]
    assert wc.combine_workers(shards) == wc.state_checksum(w)
    assert wc.combine_workers([{"a": 5, "b": 7}]) == 12


class _Gemm(torch.nn.Module):
    """A linear layer whose weight lives only in its kernel (vLLM CPU's packed GEMM)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        self.input_size_per_partition = weight.shape[1]
        packed = weight.t().contiguous()  # what the kernel keeps
        self.quant_method = type("M", (), {"apply": staticmethod(
            lambda layer, x, bias=None: x @ packed)})()


def test_an_emptied_linear_weight_is_read_back_through_its_kernel():
    w = torch.randn(5, 7)
    model = torch.nn.Module()
    model.proj = _Gemm(w)
    model.norm = torch.nn.Parameter(torch.randn(7))
    got = wc.module_checksums(model, rows=3)  # identity rows 3 at a time: 3 + 3 + 1
    assert got == {"proj.weight": wc.tensor_checksum(w),
                   "norm": wc.tensor_checksum(model.norm)}
