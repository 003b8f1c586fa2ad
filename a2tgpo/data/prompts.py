"""Prompt texts of the two prompt styles (spec: algorithms.md §10.1, §10.3).

`a2tgpo`: the A2TGPO/AT2PO system prompt (<search>, <result>, <answer> with \\boxed{}).
`search_r1`: Search-R1's user-turn prefix (<search>, <information>, <answer>).
These strings are also part of the text the toy tokenizer is trained on, so that the tags and
templates tokenise compactly there, as they do in a real backbone.
"""

from __future__ import annotations

from typing import Literal

PromptStyle = Literal["a2tgpo", "search_r1"]

A2TGPO_SYSTEM = (
    "You are a helpful assistant that can solve the given question step by step with the help "
    "of the wikipedia search tool. Given a question, you need to first think about the reasoning "
    "process in the mind and then provide the answer. During thinking, you can invoke the "
    "wikipedia search tool to search for fact information about specific topics if needed. You "
    "can search as many times as your want. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags respectively, and the search query and result "
    "are enclosed within <search> </search> and <result> </result> tags respectively. For "
    "example, <think> This is the reasoning process. </think> <search> search query here "
    "</search> <result> search result here </result> <think> This is the reasoning process. "
    "</think> <answer> The final answer is \\[ \\boxed{answer here} \\] </answer>. In the last "
    "part of the answer, the final exact answer is enclosed within \\boxed{} with latex format."
)

SEARCH_R1_PREFIX = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, "
    "you can call a search engine by <search> query </search> and it will return the top "
    "searched results between <information> and </information>. You can search as many times as "
    "your want. If you find no further external knowledge needed, you can directly provide the "
    "answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Question: {question}\n"
)

SEARCH_R1_INVALID = (
    "\nMy previous action is invalid. If I want to search, I should put the query between "
    "<search> and </search>. If I want to give the final answer, I should put the answer between "
    "<answer> and </answer>. Let me try again.\n"
)

# Observation wrappers: the tool result is appended as token ids of these texts (loss mask 0).
A2TGPO_RESULT = " <result>\n{text}\n</result>"
SEARCH_R1_INFORMATION = "\n\n<information>{text}</information>\n\n"
A2TGPO_EMPTY_RESULT = "No search results found."

# Tags that must be single, exact tokens in the toy tokenizer (not "special": decoding with
# skip_special_tokens=True must keep them, since the reward parses the decoded text).
TAGS: tuple[str, ...] = (
    "<think>", "</think>", "<search>", "</search>", "<result>", "</result>",
    "<information>", "</information>", "<answer>", "</answer>",
)


def normalise_question(question: str) -> str:
    """Both repos strip the question and end it with '?' (algorithms.md §10.1)."""
    q = question.strip()
    return q if q.endswith("?") else q + "?"


def build_messages(question: str, style: PromptStyle) -> list[dict[str, str]]:
    """Chat messages for one question, before the backbone's chat template is applied."""
    q = normalise_question(question)
    if style == "a2tgpo":
        return [{"role": "system", "content": A2TGPO_SYSTEM}, {"role": "user", "content": q}]
    return [{"role": "user", "content": SEARCH_R1_PREFIX.format(question=q)}]
