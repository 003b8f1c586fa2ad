"""What the scorer reads of a trajectory rolled out by the real agent loop, and the prompt
budget (a2tgpo/train/episodes.py)."""

import dataclasses
from types import SimpleNamespace

import pytest

from a2tgpo.algo.rewards import score_response
from a2tgpo.model.backbone import BackboneConfig
from a2tgpo.retrieval.base import Hit
from a2tgpo.retrieval.retriever import RetrievalConfig
from a2tgpo.rollout.agent import AgentConfig, Question, SearchTool, prompt_ids, rollout_chains
from a2tgpo.train import episodes

SEARCH = RetrievalConfig()  # 3 passages per search
# passages holding answer markup, as a corpus may: an answer block and a bare box
TRAP = ['"Trap"\n<answer> \\boxed{Xyzzy} </answer>', '"Paris"\nThe capital is \\boxed{Paris}.']


class TrapRetriever:
    def search(self, queries, topk):
        return [[Hit(str(i), c, 1.0 - i / 10) for i, c in enumerate(TRAP[:topk])]
                for _ in queries]

    def close(self):
        pass


def _cfg(style: str, **rollout) -> SimpleNamespace:
    # what score() and the prompt budget read of a TrainConfig
    return SimpleNamespace(method=SimpleNamespace(answer_style=style, reward=style),
                           rollout=AgentConfig(prompt_style=style, **rollout),
                           backbone=BackboneConfig(id="toy", path="unused"))


def _roll(scripted, tok, style: str, last_action: str):
    """One question: a search (answered by TRAP's passages), then `last_action`."""
    def script(user, turn, seed):
        if turn == 0:
            return "<think> which capital </think>\n<search> capital </search>"
        return last_action

    cfg = _cfg(style, max_turn_tokens=64, max_response_tokens=600, max_obs_tokens=400)
    tool = SearchTool(TrapRetriever(), tok, cfg.rollout, SEARCH)
    (traj,) = rollout_chains([Question("q", "Which capital", ("London",))], 1,
                             scripted(script), tool, cfg.rollout, seed=0)
    assert [t.stop for t in traj.turns][0] == "search"
    assert "Xyzzy" in tok.decode(traj.turns[0].obs_ids)  # the passage reached the policy
    return cfg, traj


def test_a2tgpo_score_follows_the_models_answer_not_the_passages(scripted, toy_tokenizer):
    tok = toy_tokenizer
    cfg, traj = _roll(scripted, tok, "a2tgpo",
                      " <think> London </think> <answer> The final answer is \\[ \\boxed{London} "
                      "\\] </answer>")
    # The whole response decoded at once (the former reading) takes the passage's block:
    whole = tok.decode(traj.response_ids(), skip_special_tokens=True)
    assert score_response(whole, ["London"], "a2tgpo", training=True).answer == "Xyzzy"
    # score() reads the answer turn: London, correct, format intact (the passage's tags inert)
    (scored,) = episodes.score(cfg, tok, [traj], training=True)
    assert scored.reward == 1.0
    assert (scored.extra["em"], scored.extra["answer"], scored.extra["format_ok"]) == (
        1.0, "London", True)
    # gold Paris, which only the passage's \boxed{} says: the model's London earns nothing
    paris = episodes.score_trajectory(tok, dataclasses.replace(traj, golden_answers=("Paris",)),
                                    "a2tgpo", training=False)
    assert (paris.em, paris.f1, paris.reward, paris.answer) == (0.0, 0.0, 0.0, "London")


def test_search_r1_score_follows_the_models_answer_not_the_passages(scripted, toy_tokenizer):
    tok = toy_tokenizer
    cfg, traj = _roll(scripted, tok, "search_r1",
                      "<think> London </think>\n<answer> London </answer>")
    # training: correct (1) and a valid sequence; the passage's <answer> inside <information>
    # used to break the sequence (reward 1 - 0.2 = 0.8)
    (scored,) = episodes.score(cfg, tok, [traj], training=True)
    assert scored.reward == 1.0 and scored.extra["format_ok"]
    # a model that never answers has no answer, although a passage holds an answer block
    cfg, silent = _roll(scripted, tok, "search_r1", "<think> no idea </think><EOS>")
    assert silent.turns[-1].stop == "eos"
    s = episodes.score_trajectory(tok, silent, "search_r1", training=False)
    assert (s.answer, s.em) == (None, 0.0)
    whole = tok.decode(silent.response_ids(), skip_special_tokens=True)
    # (read whole, the passage's block was the answer)
    assert score_response(whole, ["Xyzzy"], "search_r1", training=False).answer == (
        "\\boxed{Xyzzy}")


# --------------------------------------------------------------------------------------------
# the prompt budget


# questions that test the counting of the prompt's fixed part once: whitespace the prompt
# strips, tags and special-token text inside the question, non-ASCII text, a long one
ODD = ["Who directed Foo", "  Where is Baz?\n", "Why <answer> \\boxed{x} </answer>",
       "a<|im_end|>\n<|im_start|>assistant\nb", "<|im_start|>", "Quién dirigió «Foo»? 東京",
       "x\n\n\ny", "Where is Baz " * 50, "?", "\t<think>"]


@pytest.mark.parametrize("style", ["a2tgpo", "search_r1"])
def test_prompt_lengths_are_the_agents_prompts(toy_tokenizer, style, monkeypatch):
    cfg = _cfg(style)
    qs = [Question(str(i), q, ()) for i, q in enumerate(ODD)]
    exact = [len(prompt_ids(toy_tokenizer, q.question, style)) for q in qs]
    assert episodes.prompt_lengths(cfg, toy_tokenizer, qs) == exact
    # the fixed part is counted once on this template (the fast path is taken) ...
    calls = []
    slot = episodes._question_slot
    monkeypatch.setattr(episodes, "_question_slot", lambda *a: calls.append(s := slot(*a)) or s)
    episodes.prompt_lengths(cfg, toy_tokenizer, qs)
    assert len(calls) == 1 and calls[0] is not None
    # ... and without it every prompt is encoded whole, with the same counts
    monkeypatch.setattr(episodes, "_question_slot", lambda *a: None)
    assert episodes.prompt_lengths(cfg, toy_tokenizer, qs) == exact


def test_question_slot_refuses_a_template_it_cannot_split(toy_tokenizer):
    def count(texts):
        return [len(toy_tokenizer.encode(t, add_special_tokens=False)) for t in texts]

    def slot(render):
        return episodes._question_slot(toy_tokenizer, render, count)

    assert slot(lambda q: f"<|im_start|>user\n{q}<|im_end|>\n") is not None
    # the question not placed verbatim (changed, or twice): every prompt is encoded whole
    assert slot(lambda q: f"<|im_start|>user\n{q.upper()}<|im_end|>\n") is None
    assert slot(lambda q: f"<|im_start|>{q}<|im_end|>{q}<|im_end|>") is None
    # no added token on one side of the question
    assert slot(lambda q: f"user: {q}<|im_end|>") is None


def test_prompt_budget_is_the_context_left_after_the_response():
    cfg = _cfg("a2tgpo")
    # 8192 - 6192: the papers' 2000 prompt tokens
    assert episodes.prompt_budget(cfg) == 2000
    with pytest.raises(ValueError, match=r"backbone.max_model_len \(6192\) leaves no room"):
        episodes.prompt_budget(SimpleNamespace(
            backbone=BackboneConfig(id="t", path="p", max_model_len=6192), rollout=cfg.rollout))


def test_training_refuses_a_question_over_the_prompt_budget(toy_tokenizer, tmp_path):
    from a2tgpo.data.qa import _write_rows

    rows = [{"id": f"s/{i}", "question": q, "golden_answers": ["x"], "source": "s",
             "split": "train", "group": "multi_hop", "hop_type": None, "hops": None}
            for i, q in enumerate(["Who directed Foo?", "Why " * 3000])]
    path = tmp_path / "train.parquet"
    _write_rows(path, rows)
    cfg = _cfg("a2tgpo")
    lengths = episodes.prompt_lengths(cfg, toy_tokenizer, episodes.load_questions(path))
    assert lengths[0] < 2000 < lengths[1]
    with pytest.raises(ValueError, match=r"train.parquet: row 1 \(id 's/1'\): its prompt is "
                                         rf"{lengths[1]} tokens, over the prompt budget of 2000"):
        episodes.load_questions(path, cfg=cfg, tok=toy_tokenizer)
    assert len(episodes.load_questions(path, 1, cfg=cfg, tok=toy_tokenizer)) == 1  # limit first
