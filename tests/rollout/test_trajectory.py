"""Trajectory types and collation on hand-written token ids."""

import pytest

from a2tgpo.algo.types import TreePath
from a2tgpo.rollout.trajectory import Trajectory, TrajectoryBuilder, Turn, collate


def two_trajectories():
    a = TrajectoryBuilder([1, 2, 3], question_id="qa", group_id="g", golden_answers=["x"])
    a.add_turn(Turn((4, 5), (-0.1, -0.2), (6, 7), "search", "q"), [1, 2, 3])
    a.add_turn(Turn((8,), (-0.3,), (), "answer"), [1, 2, 3, 4, 5, 6, 7])
    b = TrajectoryBuilder([1, 9], question_id="qb", group_id="g")
    b.add_turn(Turn((10, 11, 12), (-1.0, -1.0, -1.0), (), "eos"), [1, 9])
    return a.build(reward=1.0), b.build(reward=-1.0)


def test_collate_rows_by_hand():
    ta, tb = two_trajectories()
    batch = collate([ta, tb], pad_id=0)
    # row a: prompt 1 2 3 | turn 0: 4 5 | obs 6 7 | turn 1: 8
    # row b: prompt 1 9 | turn 0: 10 11 12 | padding
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8], [1, 9, 10, 11, 12, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 8, [1] * 5 + [0] * 3]
    assert batch.loss_mask.tolist() == [[0, 0, 0, 1, 1, 0, 0, 1], [0, 0, 1, 1, 1, 0, 0, 0]]
    assert batch.turn_id.tolist() == [[-1, -1, -1, 0, 0, -1, -1, 1],
                                      [-1, -1, 0, 0, 0, -1, -1, -1]]
    assert batch.rollout_logprobs.flatten().tolist() == pytest.approx(
        [0, 0, 0, -0.1, -0.2, 0, 0, -0.3] + [0, 0, -1, -1, -1, 0, 0, 0])
    assert batch.turn_mask.tolist() == [[True, True], [True, False]]
    # a's turn 0 searched; its final turn answered; b's only turn ended on eos
    assert batch.tool_call.tolist() == [[True, False], [False, False]]
    assert batch.num_turns.tolist() == [2, 1]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 4, 4, 4]]
    assert batch.group_ids == ["g", "g"]
    assert batch.prompt_lengths.tolist() == [3, 2]
    # observation tokens never carry loss; every sampled token does
    assert not (batch.loss_mask.bool() & (batch.turn_id < 0)).any()
    assert int(batch.loss_mask.sum()) == 3 + 3


def test_prefix_invariant_is_enforced():
    b = TrajectoryBuilder([1, 2], question_id="q", group_id=0)
    b.add_turn(Turn((3,), (-0.1,), (4,), "search"), [1, 2])
    with pytest.raises(AssertionError, match="differs from the trajectory so far at token 3"):
        b.add_turn(Turn((5,), (-0.1,), (), "answer"), [1, 2, 3, 99])  # obs token changed
    with pytest.raises(AssertionError, match="lengths 3 vs 4"):
        b.add_turn(Turn((5,), (-0.1,), (), "answer"), [1, 2, 3])


def test_turn_validation_and_helpers():
    with pytest.raises(ValueError, match="2 sampled ids but 1 logprobs"):
        Turn((1, 2), (-0.1,))
    with pytest.raises(ValueError, match="at least one sampled token"):
        Turn((), ())
    ta, tb = two_trajectories()
    assert ta.num_tool_calls == 1 and tb.num_tool_calls == 0
    assert ta.prefix_ids(1) == [1, 2, 3, 4, 5, 6, 7] and ta.token_ids()[-1] == 8
    # probe points: after the prompt, then after the search's observation
    assert ta.probe_points() == [3, 7] and tb.probe_points() == [2]
    assert ta.response_length() == 5 and ta.response_ids() == [4, 5, 6, 7, 8]


def test_branch_shares_exact_prefix():
    b = TrajectoryBuilder([1, 2], question_id="q", group_id=0)
    b.add_turn(Turn((3,), (-0.1,), (4,), "search"), [1, 2])
    b.node_ids = [7]
    c = b.branch(1)
    assert c.ids == [1, 2, 3, 4] and c.turns[0] is b.turns[0] and c.node_ids == [7]
    with pytest.raises(ValueError):
        b.branch(2)
    with pytest.raises(ValueError, match="one node per turn plus the root"):
        Trajectory((1,), b.turns, "q", 0, tree=TreePath(0, (0,), (0.0,)))
