"""Gold-answer log-prob scorer: KV reuse equals the naive re-forward, token counts, padding."""

import json

import pytest
import torch

from a2tgpo.algo.info_gain import information_gain
from a2tgpo.data.prompts import A2TGPO_RESULT, build_messages
from a2tgpo.data.world import QASetSpec, WorldConfig, write_world
from a2tgpo.model.toy import ToyBackboneConfig, build_model, build_tokenizer, training_texts
from a2tgpo.rollout.info_gain import (
    IGPO_TEMPLATE,
    build_probe,
    gold_logprob_matrix,
    score_gold_logprobs,
)

SMALL_WORLD = WorldConfig(
    countries=4, cities=8, people=30, films=12, bands=6, companies=8, distractors=10,
    qa_sets=(QASetSpec("s", "single_hop", {"train": 20}, {"single": 1.0}),),
)
SMALL_MODEL = ToyBackboneConfig(vocab_size=1024, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16)
ATOL = 1e-5


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    world = tmp_path_factory.mktemp("ig") / "world"
    write_world(SMALL_WORLD, world)
    tok = build_tokenizer(SMALL_MODEL, training_texts(world))
    model = build_model(SMALL_MODEL, tok).eval()
    passages = [json.loads(line)["contents"] for line in open(world / "corpus.jsonl")]
    qa = [json.loads(line) for line in open(world / "qa" / "s" / "train.jsonl")]
    return tok, model, passages, qa


def make_trajectory(tok, question, passages, n_calls, final_answer=True):
    """Prompt + n_calls search turns (+ an answer turn); probe points after prompt and each
    observation. Built as ids turn by turn, as the rollout does."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    ids = tok.apply_chat_template(build_messages(question, "a2tgpo"), add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    ids = list(ids)
    points = [len(ids)]
    for k in range(n_calls):
        ids += enc(f"<think> step {k} </think> <search> {question} {k} </search>")
        # observations of different lengths (1 to 3 passages)
        ids += enc(A2TGPO_RESULT.format(text="\n".join(passages[k: k + 1 + k % 3])))
        points.append(len(ids))
    if final_answer:
        ids += enc("<think> done </think> <answer> The final answer is \\[ \\boxed{x} \\] "
                   "</answer><|im_end|>")
    return ids, points


@pytest.fixture(scope="module")
def batch(toy):
    """Six trajectories with 0–4 tool calls (one ends right at its last observation), each
    with the probe of its first golden answer."""
    tok, _, passages, qa = toy
    shapes = [(2, True), (0, True), (4, True), (1, False), (3, True), (0, False)]
    trajs, probes = [], []
    for i, (n, final) in enumerate(shapes):
        trajs.append(make_trajectory(tok, qa[i]["question"], passages[3 * i:], n, final))
        probes.append(build_probe(tok, qa[i]["golden_answers"][0]))
    return trajs, probes


def reference_value(model, ids, probe):
    """Mean answer log-prob from one unpadded forward over ids + probe (the definition)."""
    seq = torch.tensor([list(ids) + list(probe.ids)])
    with torch.no_grad():
        logp = model(input_ids=seq).logits[0].log_softmax(-1)
    start, end = probe.answer_span
    cols = torch.arange(len(ids) + start - 1, len(ids) + end - 1)
    return logp[cols, seq[0, cols + 1]].mean().item()


def assert_values_close(a, b):
    assert [len(r) for r in a] == [len(r) for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert ra == pytest.approx(rb, abs=ATOL, rel=0)


def test_probe_span_is_the_gold_answer(toy):
    tok, _, _, qa = toy
    for row in qa[:10]:
        gt = row["golden_answers"][0]
        probe = build_probe(tok, gt)
        start, end = probe.answer_span
        assert tok.decode(probe.ids[start:end]) == gt
        text = IGPO_TEMPLATE.replace("{gt}", gt)
        assert tok.decode(probe.ids) == text
        # the template's <|im_end|> stays one special token
        assert probe.ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")


def test_probe_span_includes_boundary_tokens(toy):
    tok = toy[0]
    # a single-token word split across the template/answer boundary: the token overlaps the
    # answer's characters, so it counts (IGPO's offsets rule) although it also holds template text
    single = lambda w: len(tok.encode(w, add_special_tokens=False)) == 1  # noqa: E731
    word = next(w for w in (tok.decode([i]) for i in range(len(tok)))
                if w.isalpha() and len(w) >= 5 and single(w))
    probe = build_probe(tok, word[2:], "x " + word[:2] + "{gt}\n")
    start, end = probe.answer_span
    assert tok.decode(probe.ids[start:end]) == word
    assert tok.decode(probe.ids[:start]) == "x "


def test_probe_rejects_bad_templates(toy):
    tok = toy[0]
    with pytest.raises(ValueError):
        build_probe(tok, "Paris", "no placeholder")
    with pytest.raises(ValueError):
        build_probe(tok, "Paris", "{gt} first")  # answer at 0: nothing predicts its first token
    with pytest.raises(ValueError):
        build_probe(tok, "", IGPO_TEMPLATE)


def test_kv_equals_naive_and_reference(toy, batch):
    _, model, _, _ = toy
    trajs, probes = batch
    kv, _, _ = score_gold_logprobs(model, trajs, probes, batch_size=4)
    naive, lps, _ = score_gold_logprobs(model, trajs, probes, method="naive", batch_size=4)
    assert lps is None
    assert [len(v) for v in kv] == [len(points) for _, points in trajs]
    assert_values_close(kv, naive)
    ref = [[reference_value(model, ids[:p], probe) for p in points]
           for (ids, points), probe in zip(trajs, probes, strict=True)]
    assert_values_close(kv, ref)
    assert all(v < 0 for row in kv for v in row)


def test_eager_attention_gives_the_same_values(toy, batch):
    # eager adds a float mask to the scores, sdpa takes a boolean one
    _, model, _, _ = toy
    trajs, probes = batch
    sdpa, _, _ = score_gold_logprobs(model, trajs, probes, batch_size=4)
    model.set_attn_implementation("eager")
    try:
        eager, _, _ = score_gold_logprobs(model, trajs, probes, batch_size=4)
    finally:
        model.set_attn_implementation("sdpa")
    assert_values_close(eager, sdpa)


def test_fused_token_logprobs_are_a_plain_forward(toy, batch):
    _, model, _, _ = toy
    trajs, probes = batch
    _, lps, _ = score_gold_logprobs(model, trajs, probes, batch_size=3)
    for (ids, _), lp in zip(trajs, lps, strict=True):
        seq = torch.tensor([ids])
        with torch.no_grad():
            logp = model(input_ids=seq).logits[0, :-1].log_softmax(-1)
        expected = logp.gather(-1, seq[0, 1:, None])[:, 0]
        assert len(lp) == len(ids) - 1
        torch.testing.assert_close(torch.tensor(lp), expected, atol=ATOL, rtol=0)


def test_token_counts(toy, batch):
    _, model, _, _ = toy
    trajs, probes = batch
    L = sum(len(ids) for ids, _ in trajs)
    Ta = sum(len(points) * len(p.ids) for (_, points), p in zip(trajs, probes, strict=True))
    naive_tokens = sum(P + len(p.ids) for (_, points), p in zip(trajs, probes, strict=True)
                       for P in points)
    _, _, kv = score_gold_logprobs(model, trajs, probes, batch_size=6)
    assert kv["trajectory_tokens"] == L and kv["ig_tokens"] == Ta
    assert kv["tokens_processed"] == L + Ta
    assert kv["probe_points"] == 16
    # one trajectory forward, one probe forward; both right-padded to their longest row
    assert kv["forwards"] == 2
    longest_probes = max(len(points) * len(p.ids)
                         for (_, points), p in zip(trajs, probes, strict=True))
    assert kv["padded_tokens"] == 6 * max(len(ids) for ids, _ in trajs) + 6 * longest_probes
    _, _, kv4 = score_gold_logprobs(model, trajs, probes, batch_size=4)
    assert kv4["tokens_processed"] == L + Ta and kv4["forwards"] == 4
    _, _, nv = score_gold_logprobs(model, trajs, probes, method="naive", batch_size=4)
    assert nv["ig_tokens"] == nv["tokens_processed"] == naive_tokens
    assert nv["trajectory_tokens"] == L


def test_padding_does_not_change_values(toy, batch):
    _, model, _, _ = toy
    trajs, probes = batch
    short = min(range(len(trajs)), key=lambda b: len(trajs[b][0]))
    for method in ("kv", "naive"):
        alone, alone_lp, _ = score_gold_logprobs(model, [trajs[short]], [probes[short]],
                                                 method=method)
        together, together_lp, _ = score_gold_logprobs(model, trajs, probes, method=method,
                                                       batch_size=len(trajs))
        assert_values_close(alone, [together[short]])
        if method == "kv":
            assert alone_lp[0] == pytest.approx(together_lp[short], abs=ATOL, rel=0)


def test_trajectory_without_probe_points(toy, batch):
    # a row with nothing to probe rides along as padding in the probe forward
    _, model, _, _ = toy
    trajs, probes = batch
    ids, _ = trajs[2]
    values, lps, stats = score_gold_logprobs(model, [(ids, []), trajs[0]], probes[2:3] + probes[:1])
    alone, _, _ = score_gold_logprobs(model, trajs[:1], probes[:1])
    assert values[0] == [] and len(lps[0]) == len(ids) - 1
    assert_values_close(values[1:], alone)
    assert stats["ig_tokens"] == len(trajs[0][1]) * len(probes[0].ids)


def test_values_feed_information_gain(toy, batch):
    _, model, _, _ = toy
    trajs, probes = batch
    values, _, _ = score_gold_logprobs(model, trajs, probes, token_logprobs=False)
    gold = gold_logprob_matrix(values)
    calls = torch.tensor([len(points) - 1 for _, points in trajs])
    assert gold.shape == (len(trajs), 5)
    ig, mask = information_gain(gold_logprob_BK1=gold, num_tool_calls_B=calls, value="log_prob")
    assert mask.sum(1).tolist() == calls.tolist()
    b = 0  # two tool calls
    assert ig[b, 1].item() == pytest.approx(values[b][2] - values[b][1], abs=1e-6)


def test_input_checks(toy, batch):
    _, model, _, _ = toy
    trajs, probes = batch
    ids, points = trajs[0]
    with pytest.raises(ValueError):
        score_gold_logprobs(model, [(ids, [len(ids) + 1])], [probes[0]])
    with pytest.raises(ValueError):
        score_gold_logprobs(model, [(ids, points)], [(probes[0].ids, (0, 2))])
    with pytest.raises(ValueError):
        score_gold_logprobs(model, [(ids, points)], [probes[0]], method="packed")
    with pytest.raises(ValueError):
        score_gold_logprobs(model, trajs, probes[:1])
