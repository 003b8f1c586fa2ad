"""Masks, turn broadcasting and aggregation: hand cases and split invariance."""

import pytest
import torch

from a2tgpo.algo.masks import (
    AGG_MODES,
    aggregate_loss,
    gather_turns,
    local_denominators,
    masked_mean,
    masked_sum,
    turn_mask_from_counts,
    turn_sum_count,
)

D = torch.float64

# two trajectories, 7 tokens: prompt (−1), turn 0, observation (−1), turn 1, padding (−1)
TURN_ID = torch.tensor([[-1, 0, 0, -1, 1, 1, -1],
                        [-1, -1, 0, 0, 0, -1, -1]])
MASK = (TURN_ID >= 0).to(D)


def test_masked_sum_mean_ignore_masked_values_even_nan():
    v = torch.tensor([[1.0, float("nan")], [3.0, 5.0]], dtype=D)
    m = torch.tensor([[1, 0], [1, 1]])
    assert masked_sum(v, m).item() == 9.0
    torch.testing.assert_close(masked_mean(v, m, dim=1), torch.tensor([1.0, 4.0], dtype=D))
    assert masked_mean(v, torch.zeros_like(m)).item() == 0.0  # empty mask: 0, not NaN


def test_gather_turns_by_hand():
    vals = torch.tensor([[10.0, 20.0], [30.0, 40.0]], dtype=D)
    out = gather_turns(vals, TURN_ID)
    assert out.tolist() == [[0, 10, 10, 0, 20, 20, 0], [0, 0, 30, 30, 30, 0, 0]]
    assert gather_turns(vals, TURN_ID, fill=1.0)[0, 0].item() == 1.0


def test_turn_sum_count_by_hand():
    v = torch.arange(14, dtype=D).reshape(2, 7)
    # row 0: turn 0 = tokens 1,2 -> sum 3, 2 tokens; turn 1 = tokens 4,5 -> 9, 2
    # row 1: turn 0 = tokens 9,10,11 -> 30, 3; turn 1 absent -> 0, 0 (the -1 tokens are dropped)
    s, c = turn_sum_count(v, TURN_ID, 2)
    torch.testing.assert_close(s, torch.tensor([[3.0, 9.0], [30.0, 0.0]], dtype=D))
    torch.testing.assert_close(c, torch.tensor([[2.0, 2.0], [3.0, 0.0]], dtype=D))


def test_turn_mask_from_counts():
    assert turn_mask_from_counts(torch.tensor([0, 2, 3]), 3).tolist() == [
        [False, False, False], [True, True, False], [True, True, True]]


def test_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=D)
    # token-mean: (1+2+3+4)/4 = 2.5
    assert aggregate_loss(loss, mask, "token-mean").item() == 2.5
    # seq-mean-token-mean: mean(2, 4) = 3
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == 3.0
    # seq-mean-token-sum: mean(6, 4) = 5
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == 5.0
    # seq-mean-token-sum-norm with L = 10: 5 / 10
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_length=10).item() == 0.5
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        aggregate_loss(loss, mask, "token-sum")


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("seed", range(5))
def test_split_into_micro_batches_and_ranks_is_exact(mode, seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 12, 9
    x = torch.randn(B, T, dtype=D, generator=g, requires_grad=True)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(D)
    mask[3] = 0  # a row with no loss tokens
    weight = torch.randn(B, T, dtype=D, generator=g)

    def per_token(xx, ww):
        return torch.tanh(xx) * ww  # any nonlinear per-token loss

    full = aggregate_loss(per_token(x, weight), mask, mode, norm_length=T)
    (g_full,) = torch.autograd.grad(full, x)

    tokens, seqs = local_denominators(mask)
    dp = 2
    ranks = [range(0, 6), range(6, 12)]
    total = 0.0
    for rank in ranks:  # each rank splits its half into micro-batches of 2 and 1 rows
        rows = list(rank)
        rank_loss = 0.0
        for micro in (rows[:2], rows[2:4], rows[4:5], rows[5:]):
            rank_loss = rank_loss + aggregate_loss(
                per_token(x[micro], weight[micro]), mask[micro], mode, global_tokens=tokens,
                global_seqs=seqs, dp_size=dp, norm_length=T)
        total = total + rank_loss / dp  # the all-reduce averages over ranks
    (g_split,) = torch.autograd.grad(total, x)
    torch.testing.assert_close(total, full, atol=1e-12, rtol=0)
    torch.testing.assert_close(g_split, g_full, atol=1e-12, rtol=0)


def test_turn_sum_count_and_local_denominators_by_hand():
    from a2tgpo.algo.masks import turn_sum_count

    v = torch.ones(2, 7, dtype=D)
    s, c = turn_sum_count(v, TURN_ID, 2)
    # row 0: two tokens in each turn; row 1: three tokens in turn 0, none in turn 1
    assert s.tolist() == [[2, 2], [3, 0]] and c.tolist() == [[2, 2], [3, 0]]
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 0]])
    assert local_denominators(mask) == (3.0, 2.0)  # the empty row is not a sequence
