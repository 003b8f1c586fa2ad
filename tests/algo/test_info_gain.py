"""Information gain from per-turn gold-answer log-probabilities."""

import math

import torch

from a2tgpo.algo.info_gain import information_gain

D = torch.float64


def test_by_hand():
    # values after: question only, tool call 1, tool call 2 (a 3rd column unused: P = 2)
    v = torch.tensor([[-2.0, -1.0, -0.5, 9.9]], dtype=D)
    P = torch.tensor([2])
    ig, mask = information_gain(gold_logprob_BK1=v, num_tool_calls_B=P, value="prob")
    # prob: e^-1 − e^-2, e^-0.5 − e^-1; the third turn does not exist
    torch.testing.assert_close(ig, torch.tensor([[math.exp(-1) - math.exp(-2),
                                                  math.exp(-0.5) - math.exp(-1), 0.0]], dtype=D),
                               atol=1e-12, rtol=0)
    assert mask.tolist() == [[True, True, False]]
    ig, mask = information_gain(gold_logprob_BK1=v, num_tool_calls_B=P, value="log_prob")
    torch.testing.assert_close(ig, torch.tensor([[1.0, 0.5, 0.0]], dtype=D), atol=1e-12, rtol=0)
    # released code: the first value only sets the baseline
    ig, mask = information_gain(gold_logprob_BK1=v, num_tool_calls_B=P, value="log_prob",
                                first_turn="skip")
    assert mask.tolist() == [[False, True, False]] and ig[0, 1].item() == 0.5


def test_non_finite_values_drop_only_their_igs():
    v = torch.tensor([[-1.0, float("nan"), -0.5, -0.2]], dtype=D)
    ig, mask = information_gain(gold_logprob_BK1=v, num_tool_calls_B=torch.tensor([3]),
                                value="log_prob")
    # v1 is NaN: IG of turns 1 and 2 use it and are absent; turn 3 = −0.2 − (−0.5)
    assert mask.tolist() == [[False, False, True]]
    assert abs(ig[0, 2].item() - 0.3) < 1e-12 and torch.isfinite(ig).all()


def test_no_tool_calls_no_ig():
    ig, mask = information_gain(gold_logprob_BK1=torch.zeros(2, 3, dtype=D),
                                num_tool_calls_B=torch.tensor([0, 1]))
    assert mask.tolist() == [[False, False], [True, False]]


# --------------------------------------------------------------------------------------------
# tool-call index -> turn index


def test_ig_by_turn_skips_turns_without_a_call():
    from a2tgpo.algo.info_gain import ig_by_turn

    # row 0: turns search, invalid (retried, no call), search, answer -> calls at turns 0, 2;
    #   call 0's IG 0.5 -> turn 0, call 1's IG -0.25 -> turn 2 (not turn 1);
    # row 1: turns search, search(final, cut by length) -> call 1 is on the final turn, which
    #   keeps no IG (the final turn is credited with the outcome only); call 0 absent (mask)
    ig_BC = torch.tensor([[0.5, -0.25], [0.75, 0.125]], dtype=D)
    mask_BC = torch.tensor([[True, True], [False, True]])
    calls_BK = torch.tensor([[True, False, True, False], [True, True, False, False]])
    ig, mask = ig_by_turn(ig_BC=ig_BC, ig_mask_BC=mask_BC, tool_call_BK=calls_BK,
                          num_turns_B=torch.tensor([4, 2]))
    assert mask.tolist() == [[True, False, True, False], [False, False, False, False]]
    assert ig.tolist() == [[0.5, 0.0, -0.25, 0.0], [0.0, 0.0, 0.0, 0.0]]


def test_ig_by_turn_without_calls_and_with_too_few_columns():
    import pytest

    from a2tgpo.algo.info_gain import ig_by_turn

    ig, mask = ig_by_turn(ig_BC=torch.zeros(2, 0, dtype=D), ig_mask_BC=torch.zeros(2, 0).bool(),
                          tool_call_BK=torch.zeros(2, 3).bool(), num_turns_B=torch.tensor([1, 3]))
    assert not mask.any() and ig.shape == (2, 3)
    # two calls in a row but one IG column: the caller's data is inconsistent
    with pytest.raises(ValueError, match="more tool calls"):
        ig_by_turn(ig_BC=torch.zeros(1, 1, dtype=D), ig_mask_BC=torch.ones(1, 1).bool(),
                   tool_call_BK=torch.tensor([[True, True, False]]),
                   num_turns_B=torch.tensor([3]))
