"""Same- vs cross-position Jaccard similarity of turns, worked out by hand."""

import json

import pytest

from a2tgpo.report import ReportInputError
from a2tgpo.report.plots import (
    jaccard,
    jaccard_by_step,
    jaccard_step,
    read_rollouts,
    turn_tokens,
)


def traj(step, group, index, *turns):
    return {"step": step, "group": group, "index": index, "reward": 0.0,
            "turns": [{"turn": k, "stop": stop, "text": text, "query": query}
                      for k, (stop, text, query) in enumerate(turns)]}


def rollouts():
    """One question q1 at step 1, three rollouts (token sets after lower-casing):

        r0: turn 0 query "Paris France"   -> {paris, france}
            turn 1 answer text "answer: Paris" (no query) -> {answer, paris}
        r1: turn 0 query "paris capital"  -> {paris, capital}
            turn 1 query "France capital" -> {france, capital}
        r2: turn 0 query "Berlin"         -> {berlin}

    Same position (pairs of different rollouts at one position):
        turn 0: r0-r1 |{paris}| / |{paris, france, capital}| = 1/3; r0-r2 0/3; r1-r2 0/3
                -> mean 1/9
        turn 1: r0-r1 {answer, paris} vs {france, capital}: 0/4 -> mean 0
        all 4 same-position pairs: (1/3 + 0 + 0 + 0) / 4 = 1/12
    Cross position (different rollouts, different positions):
        r0t0-r1t1 {paris, france} vs {france, capital}: 1/3
        r0t1-r1t0 {answer, paris} vs {paris, capital}: 1/3
        r0t1-r2t0 0/3, r1t1-r2t0 0/3
        -> (1/3 + 1/3 + 0 + 0) / 4 = 1/6
    Turns of one rollout (r0t0-r0t1) are never paired.
    """
    return [
        traj(1, "q1", 0, ("search", "<search>x</search>", "Paris France"),
             ("answer", "answer: Paris", None)),
        traj(1, "q1", 1, ("search", "t", "paris capital"), ("search", "t", "France capital")),
        traj(1, "q1", 2, ("search", "t", "Berlin")),
    ]


def test_jaccard_step_by_hand():
    s = jaccard_step(rollouts())
    assert s.same_by_turn == pytest.approx({0: 1 / 9, 1: 0.0})
    assert s.same == pytest.approx(1 / 12)
    assert s.cross == pytest.approx(1 / 6)
    assert (s.pairs_same, s.pairs_cross) == (4, 4)


def test_groups_pool_pairs_and_steps_split():
    # a second question at step 1 whose two rollouts have identical one-turn queries adds one
    # same-position pair of similarity 1: same = (1/3 + 0 + 0 + 0 + 1) / 5 = 4/15, and
    # turn 0: (1/3 + 0 + 0 + 1) / 4 = 1/3; cross pairs unchanged (1/6).
    # A rollout of step 2 lands in its own step (one rollout: no pairs at all).
    rows = rollouts() + [traj(1, "q2", 0, ("search", "t", "Rome")),
                         traj(1, "q2", 1, ("search", "t", "rome")),
                         traj(2, "q1", 0, ("search", "t", "x"))]
    by_step = jaccard_by_step(rows)
    assert sorted(by_step) == [1, 2]
    assert by_step[1].same == pytest.approx(4 / 15)
    assert by_step[1].same_by_turn[0] == pytest.approx(1 / 3)
    assert by_step[1].cross == pytest.approx(1 / 6)
    assert by_step[2].same is None and by_step[2].cross is None


def test_tokens_and_empty_sets():
    assert turn_tokens({"query": "  ", "text": "Who is X?"}) == {"who", "is", "x"}
    assert turn_tokens({"query": "A b", "text": "ignored"}) == {"a", "b"}
    assert jaccard(frozenset(), frozenset()) is None  # skipped, not 0 or 1
    assert jaccard(frozenset({"a"}), frozenset()) == 0.0


def test_read_rollouts_errors(tmp_path):
    assert read_rollouts(tmp_path) is None
    path = tmp_path / "rollouts.jsonl"
    good = json.dumps(rollouts()[0])
    path.write_text(good + "\n" + '{"step": 1')  # killed mid-line: last line ignored
    assert len(read_rollouts(tmp_path)) == 1
    path.write_text('{"step": 1\n' + good + "\n")
    with pytest.raises(ReportInputError, match=r"rollouts.jsonl:1: not valid JSON"):
        read_rollouts(tmp_path)
    path.write_text(json.dumps({"step": 1, "group": "q", "index": 0}) + "\n")
    with pytest.raises(ReportInputError, match=r"rollouts.jsonl:1: missing key 'turns'"):
        read_rollouts(tmp_path)
