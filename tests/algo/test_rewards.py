"""Hand-derived cases for a2tgpo/algo/rewards.py (algorithms.md §10.2, §13.3).

Expected values are worked out in the comments; responses are written as the policy would emit
them (response only, decoded without special tokens).
"""

import pytest

from a2tgpo.algo.rewards import (
    Response,
    Score,
    a2tgpo_format_ok,
    a2tgpo_reward,
    exact_match,
    extract_answer_tag,
    extract_boxed,
    f1_score,
    inert,
    normalize_answer,
    score_response,
    search_r1_format_ok,
    search_r1_format_reward,
    search_r1_reward,
    substring_match,
)

# A well-formed A2TGPO trajectory: one search, its result, then one boxed answer.
A2T_OK = (
    "<think> Where is the tower? </think> <search> Eiffel Tower location </search>"
    " <result>\nThe Eiffel Tower is in Paris.\n</result> <think> Paris. </think>"
    " <answer> The final answer is \\[ \\boxed{Paris} \\] </answer>"
)
# A well-formed Search-R1 trajectory (think, search, information, think, answer).
SR1_OK = (
    "<think> need the city </think>\n<search> Eiffel Tower city </search>\n\n"
    "<information>Doc 1: The Eiffel Tower is in Paris.</information>\n\n"
    "<think> it is Paris </think>\n<answer> Paris </answer>"
)


# --- normalize_answer -------------------------------------------------------------------------

@pytest.mark.parametrize("raw, expected", [
    ("The Eiffel Tower!", "eiffel tower"),        # lowercase, "!" dropped, article dropped
    ("The theater", "theater"),                   # "the" inside a word is kept (\b anchors)
    ("an apple's core", "apples core"),           # apostrophe removed, then "an" removed
    ("A.B.C.", "abc"),                            # punctuation before articles: "abc", not "bc"
    ("  New \t York\n", "new york"),              # whitespace collapsed
    ("a an the", ""),                             # only articles -> empty
])
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


# --- metrics ----------------------------------------------------------------------------------

def test_exact_match_max_over_golds():
    # "paris." normalises to "paris" = the prediction; one matching gold is enough.
    assert exact_match("Paris", ["London", "paris."]) == 1.0
    assert exact_match("Paris", ["London", "Paris, France"]) == 0.0
    assert exact_match("the Eiffel Tower", "eiffel tower") == 1.0   # a bare string is one gold
    assert exact_match("e", "Eiffel") == 0.0   # not matched letter by letter


def test_f1_score_hand_cases():
    # "the Eiffel tower" -> [eiffel, tower]; "Eiffel Tower in Paris" -> [eiffel, tower, in, paris]
    # common 2; P = 2/2 = 1, R = 2/4 = 1/2; F1 = 2 * 1 * 1/2 / (3/2) = 2/3. Gold "Paris": 0.
    # Max over golds = 2/3.
    assert f1_score("the Eiffel tower", ["Paris", "Eiffel Tower in Paris"]) == pytest.approx(
        2 / 3, abs=1e-12)
    # Multiplicity: [new, new, new] vs [new, york]: common = min(3, 1) = 1;
    # P = 1/3, R = 1/2; F1 = 2 * 1/6 / (5/6) = 0.4 (counting each "new" would give P = 1).
    assert f1_score("new new new", "New York") == pytest.approx(0.4, abs=1e-12)
    assert f1_score("Paris", ["London"]) == 0.0
    # Max, not last: "new york city" vs itself = 1; vs "york": P 1/3, R 1 -> F1 = 2/3 / (4/3) = 0.5.
    assert f1_score("new york city", ["New York City", "York"]) == 1.0
    # HotpotQA/ATPO rule: "no" vs "no way" would be 2/3 by token overlap, but yes/no only
    # scores on equality. "Yes." -> "yes" = prediction -> 1.
    assert f1_score("no", ["no way"]) == 0.0
    assert f1_score("yes", ["Yes."]) == 1.0
    # Both normalise to "" -> no tokens -> 0.
    assert f1_score("the", ["a"]) == 0.0


def test_substring_match():
    # "paris" is inside "capital is paris france".
    assert substring_match("The capital is Paris, France", ["London", "paris"]) == 1.0
    # The gold must be inside the prediction, not the other way round.
    assert substring_match("Paris", ["Paris France"]) == 0.0


# --- answer extraction ------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("<answer>\\boxed{a {b} c}</answer>", "a {b} c"),                  # nested braces
    ("<answer>\\boxed{x} no, \\boxed{y}</answer>", "y"),              # last box wins
    ("\\boxed{x} <answer>\\boxed{y}</answer> \\boxed{z}", "y"),       # only inside <answer>
    ("<answer>\\boxed{a {b}</answer>", None),                         # unbalanced
    ("<answer>Paris</answer>", None),                                 # no box
    ("\\boxed{Paris}", None),                                         # no answer block
    ("<answer>\\fbox{Paris}</answer>", None),                         # \fbox is not read
    ("<answer>\\boxed{a} \\boxedx</answer>", None),                   # last \boxed lacks "{"
    ("<answer>so \\boxed Paris$ done</answer>", "Paris"),             # ATPO's "\boxed " form
    ("<answer>\\boxed{1}</answer> <answer>\\boxed{2}</answer>", "1"),  # first block (ATPO)
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_answer_tag():
    assert extract_answer_tag("<answer> a </answer> x <answer>\n b \n</answer>") == "b"  # last
    assert extract_answer_tag("no answer here") is None
    # Search-R1's own convention needs two blocks (its string includes the prompt).
    assert extract_answer_tag("<answer> b </answer>", min_matches=2) is None
    assert extract_answer_tag("<answer> a </answer><answer> b </answer>", min_matches=2) == "b"


# --- format checks ----------------------------------------------------------------------------

def test_a2tgpo_format_ok_valid():
    assert a2tgpo_format_ok(A2T_OK)
    # No search at all is fine.
    assert a2tgpo_format_ok("<think> known </think> <answer> \\boxed{Paris} </answer>")


@pytest.mark.parametrize("response", [
    "<answer> \\boxed{Paris} </answer>",                                      # no think
    "<think> a <think> b </think> <answer> \\boxed{Paris} </answer>",         # 2 vs 1 think
    "<think> a </think> <answer> \\boxed{1} </answer> <answer> \\boxed{2} </answer>",  # 2 answers
    "<think> a </think> </answer> \\boxed{Paris} <answer>",                   # reversed
    "<think> a </think> <answer> Paris </answer>",                            # no \boxed{
    "<think> a </think> <answer> {Paris} </answer>",                          # "}", no \boxed{
    "<think> a </think> <answer> \\boxed{Paris </answer>",                    # no "}"
    "<think> a </think> <search> q </search> <answer> \\boxed{P} </answer>",  # call, no result
    "<think> a </think> <search> q </search> <result> r <answer> \\boxed{P} </answer>",  # open
    "<think> a </think> <search> q <result> r </result> </search> <answer> \\boxed{P} </answer>",
    "<think> a </think> <python> 1+1 </python> <answer> \\boxed{2} </answer>",  # python, no result
])
def test_a2tgpo_format_ok_failures(response):
    assert not a2tgpo_format_ok(response)


def test_search_r1_format_ok_valid():
    assert search_r1_format_ok(SR1_OK)
    assert search_r1_format_ok("<think> known </think><answer> Paris </answer>\n")  # trailing ws


@pytest.mark.parametrize("response", [
    "<answer> Paris </answer>",                                        # must think first
    "<think> a </think><think> b </think><answer> P </answer>",        # think twice in a row
    "<think> a </think> so <answer> P </answer>",                      # text between blocks
    "<think> a </think><answer> P </answer> done",                     # text after </answer>
    "<think> a </think><information> d </information><answer> P </answer>",  # info w/o search
    # after </information> the model must think again before answering
    "<think> a </think><search> q </search><information> d </information><answer> P </answer>",
    "<think> a </think><search> q </search>",                          # never answers
    "<think> a <answer> P </answer></think>",                          # answer inside think
])
def test_search_r1_format_ok_failures(response):
    assert not search_r1_format_ok(response)


# --- rewards ----------------------------------------------------------------------------------

def test_a2tgpo_reward():
    assert a2tgpo_reward(A2T_OK, ["Paris"]) == 1.0
    assert a2tgpo_reward(A2T_OK, ["London"]) == 0.0
    # Partial overlap: "Paris" vs "Paris France": F1 = 2/3 > 0 but EM = 0 -> 0.
    assert a2tgpo_reward(A2T_OK, ["Paris France"]) == 0.0
    # Both normalise to "": EM 1 but F1 0 -> 0.
    empty = "<think> a </think> <answer> \\boxed{the} </answer>"
    assert a2tgpo_reward(empty, ["a"]) == 0.0


def test_a2tgpo_reward_format_and_missing_answer():
    two = "<think> a </think> <answer> \\boxed{Paris} </answer> <answer> \\boxed{x} </answer>"
    assert a2tgpo_reward(two, ["Paris"]) == -1.0                      # two answers: format fail
    assert a2tgpo_reward(two, ["Paris"], check_format=False) == 1.0   # first block read
    # The format check passes ("\boxed{" and "}" present) but the box is unbalanced -> -1.
    unbalanced = "<think> a </think> <answer> \\boxed{a {b} </answer>"
    assert a2tgpo_format_ok(unbalanced)
    assert a2tgpo_reward(unbalanced, ["a"]) == -1.0
    assert a2tgpo_reward("<think> out of calls </think>", ["a"], check_format=False) == 0.0


def test_search_r1_reward():
    assert search_r1_reward(SR1_OK, ["paris"]) == 1.0
    assert search_r1_reward(SR1_OK, ["London"]) == 0.0
    assert search_r1_reward("<think> a </think>", ["Paris"]) == 0.0
    assert search_r1_reward(SR1_OK, ["Paris"], min_matches=2) == 0.0   # one block < 2


# The v0.3 table (structure 0.2, final_format 0.1, retrieval 0); the "none + valid" row needs
# min_matches=2, since with 1 a valid sequence always contains an answer.
INVALID_ANSWER = "<think> a </think> so <answer> Paris </answer>"   # text between blocks


@pytest.mark.parametrize("response, golds, min_matches, expected", [
    (SR1_OK, ["Paris"], 1, 1.0),                          # correct + valid
    (INVALID_ANSWER, ["Paris"], 1, 0.8),                  # correct + invalid: 1 - 0.2
    (SR1_OK, ["London"], 1, 0.2),                         # wrong + valid: structure
    (INVALID_ANSWER, ["London"], 1, 0.1),                 # wrong + invalid: final_format
    (SR1_OK, ["London"], 2, 0.2),                         # none + valid: structure
    ("<think> a </think> <search> q </search>", ["Paris"], 1, 0.0),   # none + invalid
])
def test_search_r1_format_reward_table(response, golds, min_matches, expected):
    assert search_r1_format_reward(response, golds, min_matches=min_matches) == pytest.approx(
        expected, abs=1e-12)


def test_search_r1_format_reward_retrieval_bonus():
    # Wrong answer "Paris" for gold "Eiffel Tower", but the gold is in the <information> block:
    # 0.2 + 0.1 = 0.3. Gold "Rome" is not retrieved: 0.2. Invalid format: no bonus, 0.1.
    assert search_r1_format_reward(SR1_OK, ["Eiffel Tower"], retrieval=0.1) == pytest.approx(
        0.3, abs=1e-12)
    assert search_r1_format_reward(SR1_OK, ["Rome"], retrieval=0.1) == pytest.approx(
        0.2, abs=1e-12)
    invalid = SR1_OK + " trailing"
    assert search_r1_format_reward(invalid, ["Eiffel Tower"], retrieval=0.1) == pytest.approx(
        0.1, abs=1e-12)


# --- score_response ---------------------------------------------------------------------------

def test_score_response_a2tgpo():
    two = "<think> a </think> <answer> \\boxed{Paris} </answer> <answer> \\boxed{x} </answer>"
    # Training: format fails -> -1; metrics still describe the extracted answer "Paris".
    assert score_response(two, ["Paris"], "a2tgpo", training=True) == Score(
        -1.0, 1.0, 1.0, 1.0, "Paris", False)
    # Evaluation: no format check; the first block's box "Paris, France" is read. Gold "France":
    # EM 0; F1: [paris, france] vs [france], P 1/2, R 1 -> 2/3; subEM 1 ("france" is inside
    # "paris france"); reward 0 (EM 0 although F1 > 0).
    two = two.replace("\\boxed{Paris}", "\\boxed{Paris, France}")
    s = score_response(two, ["France"], "a2tgpo", training=False)
    assert (s.reward, s.em, s.subem, s.answer) == (0.0, 0.0, 1.0, "Paris, France")
    assert s.f1 == pytest.approx(2 / 3, abs=1e-12)


def test_score_response_search_r1():
    # Wrong answer, valid format: training gets the 0.2 structure reward, evaluation 0.
    # "paris" vs "Paris Texas": F1 2/3 (P 1, R 1/2), subEM 0 (the gold is longer).
    assert score_response(SR1_OK, ["London"], "search_r1", training=True).reward == 0.2
    assert score_response(SR1_OK, ["London"], "search_r1", training=False).reward == 0.0
    s = score_response(SR1_OK, ["Paris Texas"], "search_r1", training=False)
    assert (s.em, s.subem, s.answer, s.format_ok) == (0.0, 0.0, "Paris", True)
    assert s.f1 == pytest.approx(2 / 3, abs=1e-12)
    # No answer at all: every metric 0, answer None.
    assert score_response("<think> a </think>", ["Paris"], "search_r1", training=True) == Score(
        0.0, 0.0, 0.0, 0.0, None, False)


def test_score_response_unknown_style():
    with pytest.raises(ValueError, match="search_r1"):
        score_response(SR1_OK, ["Paris"], "react", training=True)


# --- what is read: the answer turn, inert observations ----------------------------------------

# A search whose passages hold answer markup (a corpus may), then the model's own answer.
TRAP = (" <result>\nPage 1: <answer> \\boxed{Xyzzy} </answer>\n"
        "Page 2: the capital is \\boxed{Paris}.\n</result>")
A2T_TRAPPED = Response((
    ("<think> Which capital? </think> <search> capital </search>", TRAP),
    (" <think> London. </think> <answer> The final answer is \\[ \\boxed{London} \\] </answer>",
     ""),
))


def test_answer_comes_from_the_answer_turn_not_a_passage():
    # The model answered London. Reading the decoded whole (the sources' way) takes the first
    # <answer> block, the passage's: "Xyzzy", and counts 2 <answer> tags: format -1.
    whole = "".join(a + o for a, o in A2T_TRAPPED.turns)
    assert extract_boxed(whole) == "Xyzzy" and not a2tgpo_format_ok(whole)
    # Read as turns: the answer is the last turn's box, the passage's tags are inert text, so
    # the format holds (one <answer>, the search answered by <result> ... </result>).
    assert score_response(A2T_TRAPPED, ["London"], "a2tgpo", training=True) == Score(
        1.0, 1.0, 1.0, 1.0, "London", True)
    # Gold Paris (in the passage's \boxed{}): the model's London scores 0 everywhere.
    assert score_response(A2T_TRAPPED, ["Paris"], "a2tgpo", training=True) == Score(
        0.0, 0.0, 0.0, 0.0, "London", True)
    assert score_response(A2T_TRAPPED, ["Xyzzy"], "a2tgpo", training=False).em == 0.0


def test_search_r1_answer_and_format_ignore_passage_tags():
    sr1 = [("<think> need it </think>\n<search> capital </search>",
            "\n\n<information>Doc 1: <answer> Xyzzy </answer></information>\n\n")]
    answered = Response((*sr1, ("<think> it is London </think>\n<answer> London </answer>", "")))
    # Correct answer, valid sequence: 1.0. Whole text: the passage's tags break the state
    # machine (an <answer> inside <information>), so the sources' reading gives 1 - 0.2 = 0.8.
    assert search_r1_format_reward(answered, ["London"]) == 1.0
    whole = "".join(a + o for a, o in answered.turns)
    assert search_r1_format_reward(whole, ["London"]) == pytest.approx(0.8, abs=1e-12)
    # A model that never answers (its last turn ends without a tag) has no answer, although the
    # passage holds an <answer> block that the whole text's last-block rule would read.
    silent = Response((*sr1, ("<think> no idea </think>", "")))
    assert extract_answer_tag("".join(a + o for a, o in silent.turns)) == "Xyzzy"
    assert score_response(silent, ["Xyzzy"], "search_r1", training=False) == Score(
        0.0, 0.0, 0.0, 0.0, None, False)


def test_inert_keeps_the_envelope_only():
    assert inert(TRAP) == (" <result>\nPage 1: [answer] \\boxed{Xyzzy} [/answer]\n"
                           "Page 2: the capital is \\boxed{Paris}.\n</result>")
    # a passage cannot close the envelope early or open a block after it
    assert inert(" <result>\na </result> <think> b\n</result>") == (
        " <result>\na [/result] [think] b\n</result>")
    # a tool message has no envelope: all its tags are text
    assert inert("\nput it between <answer> and </answer>.\n") == (
        "\nput it between [answer] and [/answer].\n")
    # a result cut by the length limit keeps its opening tag
    assert inert(" <result>\ncut <answer>") == " <result>\ncut [answer]"


def test_an_answer_only_in_an_earlier_turn_is_no_answer():
    # The answer turn is the last: a box the model wrote before searching is not its answer.
    r = Response((("<think> a </think> <answer> \\boxed{Paris} <search> q </search>",
                   " <result>\nr\n</result>"),
                  (" </answer>", "")))
    assert score_response(r, ["Paris"], "a2tgpo", training=False).answer is None


def test_empty_normalised_golds_match_nothing():
    # "the" and "a" both normalise to "": the sources give EM 1 (and Search-R1's reward 1)
    # while F1 is 0 (no tokens); here every metric and reward says 0.
    assert exact_match("a", ["the"]) == 0.0
    assert substring_match("London", ["the"]) == 0.0   # "" is in every string
    assert f1_score("a", ["the"]) == 0.0
    r = Response((("<think> x </think> <answer> \\boxed{a} </answer>", ""),))
    assert score_response(r, ["the"], "a2tgpo", training=False) == Score(
        0.0, 0.0, 0.0, 0.0, "a", True)
    assert score_response("<think> x </think>\n<answer> a </answer>", ["the"], "search_r1",
                          training=False) == Score(0.0, 0.0, 0.0, 0.0, "a", True)
    # another gold of the row still matches
    assert exact_match("Paris", ["the", "paris"]) == 1.0
