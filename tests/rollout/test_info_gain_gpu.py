"""The information-gain scorer on a GPU: KV-reuse equals the naive reference (fp32 and bf16)."""

import pytest
import torch

from a2tgpo.rollout.info_gain import score_gold_logprobs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype, atol", [
    (torch.float32, 1e-4),   # TF32 is off for matmuls by default: only summation order differs
    (torch.bfloat16, 0.1),   # 8 mantissa bits; mean log-probs of ~-7 move by a few 1e-2
])
def test_kv_equals_naive_on_gpu(dtype, atol):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg).to("cuda", dtype).eval()
    g = torch.Generator().manual_seed(1)
    trajs, probes = [], []
    for k in range(4):  # 0..3 tool calls, different lengths: padding is exercised
        ids = torch.randint(5, 1000, (40 + 30 * k,), generator=g).tolist()
        trajs.append((ids, [40] + [40 + 30 * (t + 1) for t in range(k)]))
        probes.append((torch.randint(5, 1000, (12,), generator=g).tolist(), (4, 8)))
    fast, _, _ = score_gold_logprobs(model, trajs, probes, method="kv", batch_size=4)
    slow, _, _ = score_gold_logprobs(model, trajs, probes, method="naive", batch_size=4)
    for a, b in zip(fast, slow, strict=True):
        assert len(a) == len(b)
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < atol
