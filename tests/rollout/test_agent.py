"""The agent loop with a scripted engine and a fixed retriever (hand-checkable ids)."""

import dataclasses

import pytest
from conftest import FixedRetriever

from a2tgpo.data.prompts import SEARCH_R1_INVALID
from a2tgpo.retrieval.retriever import RetrievalConfig, format_passages
from a2tgpo.rollout.agent import (
    CALL_LIMIT_WARNING,
    AgentConfig,
    Question,
    SearchTool,
    extract_query,
    prompt_ids,
    rollout_chains,
)
from a2tgpo.rollout.trajectory import collate

CFG = AgentConfig(max_turn_tokens=64, max_response_tokens=600, max_obs_tokens=400)
SEARCH = RetrievalConfig()  # passages per search and their length
QS = [Question("q1", "Who directed Foo", ("Bar",)), Question("q2", "Where is Baz", ("Qux",))]


def search_then_answer(user, turn, seed):
    if turn == 0:
        return f"<think> look it up </think> <search> {user.split()[-1].rstrip('?')} </search>"
    return "<think> found </think> <answer> The final answer is \\[ \\boxed{Bar} \\] </answer>"


def test_turns_ids_and_one_batched_search_per_wave(scripted, toy_tokenizer):
    engine, retriever = scripted(search_then_answer), FixedRetriever()
    tool = SearchTool(retriever, toy_tokenizer, CFG, SEARCH)
    trajs = rollout_chains(QS, 3, engine, tool, CFG, seed=0)
    assert len(trajs) == 6 and [t.group_id for t in trajs] == ["q1"] * 3 + ["q2"] * 3
    # one retriever call in wave 1 with all six queries, none in wave 2
    assert retriever.batches == [["Foo"] * 3 + ["Baz"] * 3]
    tok = toy_tokenizer
    for t in trajs:
        assert [turn.stop for turn in t.turns] == ["search", "answer"]
        first = t.turns[0]
        assert tok.decode(first.action_ids).endswith("</search>")  # stop string kept
        assert first.query in ("Foo", "Baz")
        hits = retriever.search([first.query], 3)[0]
        body = format_passages(hits, "a2tgpo", 1000)
        expected = (tok.encode(" <result>\n", add_special_tokens=False)
                    + tok.encode(body, add_special_tokens=False)
                    + tok.encode("\n</result>", add_special_tokens=False))
        assert list(first.obs_ids) == expected
        assert t.prompt_ids == tuple(prompt_ids(tok, t.question_id == "q1" and QS[0].question
                                                or QS[1].question, "a2tgpo"))
    # the engine's input in wave 2 is exactly prompt + action + observation
    wave2 = engine.calls[1]
    assert wave2 == [t.prefix_ids(1) for t in trajs]
    batch = collate(trajs, pad_id=tok.pad_token_id)
    assert int(batch.loss_mask.sum()) == sum(len(x.action_ids) for t in trajs for x in t.turns)


def test_tool_call_limit_stop_and_warn(scripted, toy_tokenizer):
    always = lambda user, turn, seed: "<search> again </search>"  # noqa: E731
    cfg = dataclasses.replace(CFG, max_tool_calls=2, max_response_tokens=2000)
    tool = SearchTool(FixedRetriever(), toy_tokenizer, cfg, SEARCH)
    t = rollout_chains(QS[:1], 1, scripted(always), tool, cfg, seed=0)[0]
    # two searches are answered; the third call ends the episode (A2TGPO)
    assert [x.stop for x in t.turns] == ["search", "search", "call_limit"]
    assert t.turns[-1].obs_ids == ()

    def then_answer(user, turn, seed):
        return "<search> again </search>" if turn < 3 else "<answer> \\boxed{x} </answer>"

    warn = dataclasses.replace(cfg, at_call_limit="warn")
    t = rollout_chains(QS[:1], 1, scripted(then_answer),
                       SearchTool(FixedRetriever(), toy_tokenizer, warn, SEARCH), warn, seed=0)[0]
    assert [x.stop for x in t.turns] == ["search", "search", "call_limit", "answer"]
    assert list(t.turns[2].obs_ids) == toy_tokenizer.encode(CALL_LIMIT_WARNING,
                                                            add_special_tokens=False)
    assert t.num_tool_calls == 2  # the warned call is not a tool call


def test_total_length_limit_counts_observations(scripted, toy_tokenizer):
    always = lambda user, turn, seed: "<search> again </search>"  # noqa: E731
    cfg = dataclasses.replace(CFG, max_response_tokens=120, max_tool_calls=50)
    t = rollout_chains(QS[:1], 1, scripted(always), SearchTool(FixedRetriever(), toy_tokenizer,
                                                               cfg, SEARCH), cfg, seed=0)[0]
    assert t.response_length() <= 120
    assert t.turns[-1].stop == "length" or t.response_length() == 120
    obs = sum(len(x.obs_ids) for x in t.turns)
    assert obs > 0  # observations used up part of the budget


def test_observation_budget_keeps_closing_tag(scripted, toy_tokenizer):
    cfg = dataclasses.replace(CFG, max_obs_tokens=5)
    t = rollout_chains(QS[:1], 1, scripted(search_then_answer),
                       SearchTool(FixedRetriever(), toy_tokenizer, cfg, SEARCH), cfg, seed=0)[0]
    head = toy_tokenizer.encode(" <result>\n", add_special_tokens=False)
    tail = toy_tokenizer.encode("\n</result>", add_special_tokens=False)
    assert len(t.turns[0].obs_ids) == len(head) + 5 + len(tail)
    assert list(t.turns[0].obs_ids[-len(tail):]) == tail


@pytest.mark.parametrize("action, stop", [
    ("I do not know<EOS>", "eos"),
    ("<search> </search>", "invalid"),                        # empty query
    ("rambling " * 40, "max_tokens"),
])
def test_invalid_actions_are_recorded(scripted, toy_tokenizer, action, stop):
    cfg = dataclasses.replace(CFG, max_turn_tokens=20)
    t = rollout_chains(QS[:1], 1, scripted(lambda u, k, s: action),
                       SearchTool(FixedRetriever(), toy_tokenizer, cfg, SEARCH), cfg, seed=0)[0]
    assert [x.stop for x in t.turns] == [stop]
    if stop == "eos":
        assert t.turns[0].action_ids[-1] == toy_tokenizer.eos_token_id


def test_search_r1_style_retries_invalid_actions(scripted, toy_tokenizer):
    calls = []

    def script(user, turn, seed):
        # Search-R1's invalid-action message carries no result tag, so the scripted engine's
        # turn counter does not move: count calls instead
        calls.append(1)
        return "hmm" * 30 if len(calls) == 1 else "<answer> Bar </answer>"

    cfg = dataclasses.replace(CFG, prompt_style="search_r1", on_invalid="retry",
                              max_turn_tokens=20)
    tool = SearchTool(FixedRetriever(), toy_tokenizer, cfg, SEARCH)
    t = rollout_chains(QS[:1], 1, scripted(script), tool, cfg, seed=0)[0]
    assert [x.stop for x in t.turns] == ["max_tokens", "answer"]
    assert list(t.turns[0].obs_ids) == toy_tokenizer.encode(SEARCH_R1_INVALID,
                                                            add_special_tokens=False)
    # Search-R1's prompt: instructions and question in the user turn
    assert "Question: Who directed Foo?" in toy_tokenizer.decode(t.prompt_ids)


def test_extract_query_takes_the_last_one():
    assert extract_query("<search> a </search> x <search>  b c </search>") == "b c"
    assert extract_query("no tags") is None


def test_a_stop_request_ends_the_rollout_at_the_next_wave(scripted, toy_tokenizer):
    # the stop arrives during wave 1 (its search): wave 1 completes, wave 2 never starts
    from a2tgpo.ops.preemption import PreemptionHandler, StopRequested, request_stop

    class StopOnSearch(FixedRetriever):
        def search(self, queries, topk):
            request_stop("SIGTERM")
            return super().search(queries, topk)

    engine = scripted(search_then_answer)
    tool = SearchTool(StopOnSearch(), toy_tokenizer, CFG, SEARCH)
    with PreemptionHandler():  # clears the request on exit
        with pytest.raises(StopRequested, match="SIGTERM"):
            rollout_chains(QS, 3, engine, tool, CFG, seed=0)
    assert len(engine.calls) == 1


def test_the_tool_counts_observations_the_budget_cuts(toy_tokenizer):
    tok, retriever = toy_tokenizer, FixedRetriever()
    body = tok.encode(format_passages(retriever.search(["Foo"], 3)[0], "a2tgpo", 1000),
                      add_special_tokens=False)
    # a budget of exactly the body's length cuts nothing; one token less cuts every observation
    for budget, cut in ((len(body), 0), (len(body) - 1, 2)):
        tool = SearchTool(retriever, tok, dataclasses.replace(CFG, max_obs_tokens=budget), SEARCH)
        obs = tool.observe(["Foo", "Foo"])
        assert (tool.observations, tool.cut) == (2, cut)
        assert len(obs[0]) == len(tool.head) + min(budget, len(body)) + len(tool.tail)
