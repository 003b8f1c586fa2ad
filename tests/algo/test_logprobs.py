"""Chunked log-probs from hidden states equal the full-vocabulary log-softmax, with gradients."""

import pytest
import torch

from a2tgpo.algo.logprobs import chunked_logprobs, entropy_from_logprobs

F32 = torch.float32


def full(hidden, head, target):
    """The reference: the whole (N, V) float32 log-softmax, then gather."""
    logp = torch.log_softmax(head(hidden).float(), dim=-1)
    return logp.gather(-1, target[:, None]).squeeze(-1), entropy_from_logprobs(logp_BTV=logp)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_equals_full_values_and_gradients(chunk):
    g = torch.Generator().manual_seed(chunk)
    N, H, V = 64, 16, 300
    hidden = torch.randn(N, H, generator=g, dtype=F32, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
        head.bias.copy_(torch.randn(V, generator=g))
    target = torch.randint(0, V, (N,), generator=g)
    # random weights on both outputs: every token's log-prob and entropy reach the gradient
    w_lp, w_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)

    def grads(fn):
        lp, ent = fn()
        loss = (w_lp * lp).sum() + (w_ent * ent).sum()
        gs = torch.autograd.grad(loss, [hidden, head.weight, head.bias])
        return lp.detach(), ent.detach(), gs

    lp0, ent0, g0 = grads(lambda: full(hidden, head, target))
    lp1, ent1, g1 = grads(lambda: chunked_logprobs(hidden_NH=hidden, project=head,
                                                   target_N=target, with_entropy=True,
                                                   chunk_tokens=chunk))
    # float32 round-off of the same operations on row blocks
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=0)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_no_entropy_and_empty_input():
    head = torch.nn.Linear(4, 9)
    lp, ent = chunked_logprobs(hidden_NH=torch.zeros(0, 4), project=head,
                               target_N=torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and ent is None
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_logprobs(hidden_NH=torch.zeros(2, 4), project=head,
                         target_N=torch.zeros(2, dtype=torch.long), chunk_tokens=0)


def test_trainer_token_logprobs_equal_the_full_logits_path():
    """update.token_logprobs (hidden states + chunked head) against the model's own logits, on
    a padded batch, values and gradients with respect to every parameter."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from a2tgpo.rollout.trajectory import Trajectory, Turn, collate
    from a2tgpo.train.update import token_logprobs

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True))
    g = torch.Generator().manual_seed(1)
    trajs = [Trajectory(tuple(torch.randint(1, 96, (3,), generator=g).tolist()),
                        (Turn(tuple(torch.randint(1, 96, (n,), generator=g).tolist()),
                              (0.0,) * n),), f"q{n}", 0) for n in (5, 9, 2)]
    batch = collate(trajs, 0)  # right-padded to 12 tokens
    rows = [0, 1, 2]
    params = [p for p in model.parameters()]

    def reference():
        ids = batch.input_ids
        logits = model(input_ids=ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        ent = entropy_from_logprobs(logp_BTV=logp)
        z = torch.zeros(3, 1)
        return torch.cat([z, lp], 1), torch.cat([z, ent], 1)

    mask = batch.loss_mask.float()
    out = {}
    for name, fn in (("full", reference), ("chunked", lambda: token_logprobs(
            model, batch, rows, with_entropy=True, chunk_tokens=5))):
        lp, ent = fn()
        loss = (mask * lp).sum() + 0.1 * (mask * ent).sum()
        out[name] = (lp.detach(), ent.detach(), torch.autograd.grad(loss, params))
    (lp0, e0, g0), (lp1, e1, g1) = out["full"], out["chunked"]
    torch.testing.assert_close(lp1[mask.bool()], lp0[mask.bool()], atol=1e-5, rtol=0)
    torch.testing.assert_close(e1[mask.bool()], e0[mask.bool()], atol=1e-5, rtol=0)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # the no-grad path (old and reference passes) gives the same values
    with torch.no_grad():
        lp2, _ = token_logprobs(model, batch, rows)
    torch.testing.assert_close(lp2[mask.bool()], lp0[mask.bool()], atol=1e-5, rtol=0)
