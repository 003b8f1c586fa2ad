"""The failure breakdown: scripted episodes, one per outcome, through the real agent loop.

The FixedRetriever's observation for query q names q only ('"q"\\nq is a thing i.'), so
whether a golden answer was retrieved is decided by the query alone."""

import dataclasses

import pytest
from conftest import FixedRetriever

from a2tgpo.retrieval.retriever import RetrievalConfig
from a2tgpo.rollout.agent import AgentConfig, Question, SearchTool, rollout_chains
from a2tgpo.rollout.failures import (
    OUTCOMES,
    answer_retrieved,
    label_outcomes,
    outcome_metrics,
    outcome_shares,
)
from a2tgpo.train.episodes import score_trajectory

CFG = AgentConfig(max_turn_tokens=64, max_response_tokens=600, max_obs_tokens=400,
                  max_tool_calls=2)
SEARCH = RetrievalConfig()  # passages per search and their length


def answer(text: str) -> str:
    return f"<think> so </think> <answer> The final answer is \\[ \\boxed{{{text}}} \\] </answer>"


def search(query: str) -> str:
    return f"<think> look </think> <search> {query} </search>"


# question text -> the actions of turns 0, 1, ... (the question's words pick its script)
SCRIPTS = {
    "correct": [search("Bar"), answer("Bar")],
    "not copied": [search("Bar"), answer("Qux")],
    "early two hops": [search("Foo"), answer("Qux")],
    "missed one hop": [search("Foo"), answer("Qux")],
    "no search": [answer("Qux")],
    "bad format": [search("Foo"), "<think> so </think> <answer> Qux </answer>"],
    "call limit": [search("Foo")] * 5,
}
# (question, hops): the golden answer is "Bar" for each
QUESTIONS = [("correct", 1), ("not copied", 1), ("early two hops", 2), ("missed one hop", 1),
             ("no search", None), ("bad format", 1), ("call limit", 1)]
EXPECTED = ["correct", "not_copied", "stopped_early", "query_missed", "stopped_early",
            "format", "limit"]


def script(user, turn, seed):
    return SCRIPTS[user.rstrip("?")][turn]


@pytest.fixture
def episodes(scripted, toy_tokenizer):
    qs = {f"q{i}": Question(f"q{i}", text, ("Bar",), hop_type=("multi" if (hops or 0) > 1
                                                                  else "single"), hops=hops)
          for i, (text, hops) in enumerate(QUESTIONS)}
    tool = SearchTool(FixedRetriever(), toy_tokenizer, CFG, SEARCH)
    trajs = rollout_chains(list(qs.values()), 1, scripted(script), tool, CFG, seed=0)
    scored = []
    for t in trajs:  # as train.episodes.score writes extra
        s = score_trajectory(toy_tokenizer, t, "a2tgpo", training=False)
        scored.append(dataclasses.replace(t, extra={"em": s.em, "format_ok": s.format_ok,
                                                    "answer": s.answer}))
    return scored, qs


def test_each_scripted_episode_gets_its_outcome(episodes, toy_tokenizer):
    trajs, qs = episodes
    assert [t.turns[-1].stop for t in trajs][-1] == "call_limit"
    assert label_outcomes(trajs, toy_tokenizer, qs) == EXPECTED


def test_hop_count_decides_stopped_early_against_query_missed(episodes, toy_tokenizer):
    trajs, qs = episodes
    # "missed one hop" searched once for a one-hop question: with two hops it stopped early
    qs = {**qs, "q3": dataclasses.replace(qs["q3"], hops=2)}
    assert label_outcomes(trajs, toy_tokenizer, qs)[3] == "stopped_early"
    # and with no hop count, one search is enough not to count as early
    qs = {**qs, "q2": dataclasses.replace(qs["q2"], hops=None)}
    assert label_outcomes(trajs, toy_tokenizer, qs)[2] == "query_missed"


def test_shares_overall_and_by_hop_type(episodes, toy_tokenizer):
    trajs, qs = episodes
    m = outcome_metrics(trajs, toy_tokenizer, qs, "val/outcome")
    # 7 episodes, expected outcomes above: stopped_early twice, every other outcome once
    assert m["val/outcome/stopped_early"] == pytest.approx(2 / 7)
    assert m["val/outcome/correct"] == pytest.approx(1 / 7)
    assert sum(m[f"val/outcome/{o}"] for o in OUTCOMES) == pytest.approx(1.0)
    # the only multi-hop question stopped early; the 6 single ones share the rest
    assert m["val/outcome/multi/stopped_early"] == 1.0
    assert m["val/outcome/single/stopped_early"] == pytest.approx(1 / 6)
    assert m["val/outcome/single/limit"] == pytest.approx(1 / 6)


def test_outcome_shares_list_every_outcome_and_skip_unknown_hop_types():
    m = outcome_shares(["correct", "limit", "correct"], ["a", None, "a"], "x")
    assert m["x/correct"] == pytest.approx(2 / 3) and m["x/limit"] == pytest.approx(1 / 3)
    assert m["x/a/correct"] == 1.0 and m["x/a/format"] == 0.0
    assert not any(k.startswith("x/None") for k in m)
    assert outcome_shares([], [], "x") == {}


def test_answer_retrieved_is_a_whole_word_match_after_normalisation():
    assert answer_retrieved('"The Foo"\nThe Foo was born in 1912.', ["1912"])
    assert answer_retrieved("Directed by Jo-Ann Smith.", ["jo ann smith", "x"]) is False
    assert answer_retrieved("Directed by JoAnn Smith.", ["Jo-Ann Smith"])  # punctuation dropped
    assert not answer_retrieved("Born in 19120.", ["1912"])
    assert not answer_retrieved("Bovilleton is a city.", ["Boville"])
    assert not answer_retrieved("anything", [""])
