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
