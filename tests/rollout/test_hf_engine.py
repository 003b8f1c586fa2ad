"""The hf engine on the toy backbone: determinism, stop strings, limits, logprobs, the prefix
cache, the in-place decode cache and the attention that never copies grouped heads.

Every test of the engine runs on both paths of a2tgpo/model/fast_decode.py: the fast one
(its attention and decode cache) and transformers' stock one (sdpa, DynamicCache), which a
transformers version the fast path was not verified against falls back to."""

import functools

import pytest
import torch

from a2tgpo.model.fast_decode import ATTENTION, STOCK_ATTENTION
from a2tgpo.rollout.engine import SamplingParams
from a2tgpo.rollout.hf_engine import HfEngine


def _load(toy_dir, fast_path):
    from a2tgpo.model.backbone import BackboneConfig, load_model, load_tokenizer

    cfg = BackboneConfig(id="toy", path=str(toy_dir / "backbone"), dtype="float32",
                         fast_path=fast_path)
    model = load_model(cfg)
    assert model.config._attn_implementation == (ATTENTION if fast_path else STOCK_ATTENTION)
    return model, load_tokenizer(cfg)


@pytest.fixture(scope="module", params=[True, False], ids=["fast", "stock"])
def fast_path(request):
    return request.param


@pytest.fixture(scope="module")
def model_tok(toy_dir, fast_path):
    return _load(toy_dir, fast_path)


@pytest.fixture(scope="module")
def new_engine(model_tok, fast_path):
    """HfEngine over the module's model, on the module's path."""
    return functools.partial(HfEngine, *model_tok, fast_path=fast_path)


@pytest.fixture(scope="module")
def engine(new_engine):
    return new_engine()


PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]


def test_same_seed_same_ids_other_seed_differs(engine):
    p = SamplingParams(max_tokens=30)
    a = engine.generate(PROMPTS, p, seeds=[1, 2, 3])
    b = engine.generate(PROMPTS, p, seeds=[1, 2, 3])
    c = engine.generate(PROMPTS, p, seeds=[4, 5, 6])
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]
    for g in a:
        assert len(g.token_ids) == len(g.logprobs) >= 1


def test_max_tokens_and_eos(engine):
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=7), seeds=[1, 2, 3])
    for g in out:
        assert len(g.token_ids) <= 7
        assert g.stop_reason == "length" if len(g.token_ids) == 7 and \
            g.token_ids[-1] not in engine.eos else g.stop_reason == "eos"


def test_max_model_len_ends_each_row_where_its_context_is_full(new_engine):
    # no end-of-sequence token (-1 is never sampled): only a limit ends a row
    free = new_engine(eos_token_ids=[-1])
    capped = new_engine(eos_token_ids=[-1], max_model_len=9)
    params = SamplingParams(max_tokens=6)
    full = free.generate(PROMPTS, params, seeds=[1, 2, 3])
    cut = capped.generate(PROMPTS, params, seeds=[1, 2, 3])
    # context 9: the 4-token prompt has room for 5 ids, the 2-token one for 7 (max_tokens 6
    # ends it first), the 6-token one for 3; each is the free sample's prefix, stop "length"
    assert [len(g.token_ids) for g in full] == [6, 6, 6]
    assert [len(g.token_ids) for g in cut] == [5, 6, 3]
    for f, c in zip(full, cut, strict=True):
        assert c.token_ids == f.token_ids[: len(c.token_ids)] and c.stop_reason == "length"
    # a prompt that fills the context has no room for a token: refused, as vLLM refuses it
    with pytest.raises(ValueError, match="6 tokens leaves no room .* max_model_len 6"):
        new_engine(max_model_len=6).generate(PROMPTS, params, seeds=[1, 2, 3])


def test_greedy_and_logprobs_match_a_plain_forward(engine, model_tok):
    model, _ = model_tok
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=12, greedy=True))
    for p, g in zip(PROMPTS, out, strict=True):
        ids = torch.tensor([p + list(g.token_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        n = len(p)
        for j, tok in enumerate(g.token_ids):
            row = logp[n - 1 + j]
            assert tok == int(row.argmax())  # greedy = argmax of the uncached forward
            assert abs(g.logprobs[j] - float(row[tok])) < 1e-4  # raw logprob of that token


def test_stop_string_is_honoured_and_kept(engine, model_tok):
    _, tok = model_tok
    first = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=40), seeds=[3])[0]
    # stop on the text of a token the model emits at position 5 of an unconstrained sample
    word = tok.decode([first.token_ids[5]])
    assert word.strip(), "pick a visible token"
    g = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=40, stop=(word,)), seeds=[3])[0]
    text = tok.decode(list(g.token_ids))
    assert g.stop_reason == "stop" and g.stop_string == word
    assert word in text and word not in tok.decode(list(g.token_ids[:-1]))
    assert g.token_ids == first.token_ids[: len(g.token_ids)]  # the same sample, cut there


def test_finished_rows_leave_the_batch_without_disturbing_others(new_engine, model_tok):
    _, tok = model_tok
    # make a frequent token an extra end-of-sequence so rows finish at different steps
    probe = new_engine().generate(PROMPTS, SamplingParams(max_tokens=20), seeds=[7, 8, 9])
    stopper = probe[1].token_ids[2]
    eng = new_engine(eos_token_ids=[stopper, tok.eos_token_id])
    together = eng.generate(PROMPTS, SamplingParams(max_tokens=20), seeds=[7, 8, 9])
    assert together[1].stop_reason == "eos" and len(together[1].token_ids) <= 3
    for i, p in enumerate(PROMPTS):
        alone = eng.generate([p], SamplingParams(max_tokens=20), seeds=[7 + i])[0]
        assert alone.token_ids == together[i].token_ids


def test_update_weights(new_engine, model_tok, fast_path):
    import copy

    model, tok = model_tok
    clone = copy.deepcopy(model)
    eng = HfEngine(clone, tok, fast_path=fast_path)
    before = eng.generate(PROMPTS[:1], SamplingParams(max_tokens=10, greedy=True))[0]
    sd = {k: v * 1.5 for k, v in model.state_dict().items()}
    eng.update_weights(sd)
    after = eng.generate(PROMPTS[:1], SamplingParams(max_tokens=10, greedy=True))[0]
    ref = new_engine()
    model.load_state_dict(sd)
    try:
        assert after.token_ids == ref.generate(
            PROMPTS[:1], SamplingParams(max_tokens=10, greedy=True))[0].token_ids
        assert after.token_ids != before.token_ids
    finally:
        model.load_state_dict({k: v / 1.5 for k, v in sd.items()})
    with pytest.raises(ValueError, match="unexpected"):
        eng.update_weights({"nope": torch.zeros(1)})


def test_gumbel_sampling_matches_the_distribution(engine):
    from a2tgpo.rollout.engine import SamplingParams

    # p = (0.5, 0.3, 0.2); 6000 rows, each with its own generator
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(6000, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(6000)]
    counts = torch.bincount(engine._sample(logits, SamplingParams(max_tokens=1), gens),
                            minlength=3).double() / 6000
    # binomial std at n = 6000 is <= 0.0065; 0.025 is ~4 std
    assert (counts - torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)).abs().max() < 0.025
    # top-p 0.6 keeps the two most likely (0.5 < 0.6), renormalised to 0.625 / 0.375
    top = torch.bincount(engine._sample(logits, SamplingParams(max_tokens=1, top_p=0.6), gens),
                         minlength=3).double() / 6000
    assert top[2] == 0 and abs(top[0] - 0.625) < 0.025


def _next_wave(prompts, gens, extra):
    # an agent's next input: its previous input, what it sampled, then an observation
    return [p + list(g.token_ids) + extra for p, g in zip(prompts, gens, strict=True)]


def test_prefix_cache_reuses_earlier_turns_and_gives_the_uncached_result(new_engine):
    params = SamplingParams(max_tokens=8, greedy=True)
    cached, plain = new_engine(), new_engine(prefix_cache_bytes=0)
    # two copies of the first prompt: a question's rollouts share their prompt
    first = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    a1, b1 = cached.generate(first, params), plain.generate(first, params)
    # identical prompts are run once: 4 + 2 + 6 prompt tokens, not 4 + 4 + 2 + 6
    assert cached.tokens_prefilled == 12 and plain.tokens_prefilled == 16
    assert [g.token_ids for g in a1] == [g.token_ids for g in b1]
    second = _next_wave(first[1:], a1[1:], [20, 21, 22])
    second.append([30, 31])  # a prompt no kept entry is a prefix of
    a2, b2 = cached.generate(second, params), plain.generate(second, params)
    # rows 0-2 reuse prompt + every sampled token but the last (never run through the model)
    reused = sum(len(p) + len(g.token_ids) - 1 for p, g in zip(first[1:], a1[1:], strict=True))
    assert cached.tokens_reused == reused and plain.tokens_reused == 0
    assert cached.tokens_prefilled == 12 + sum(map(len, second)) - reused
    for x, y in zip(a2, b2, strict=True):
        assert x.token_ids == y.token_ids
        assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs, strict=True)) < 1e-4


def test_prefix_cache_is_dropped_when_the_weights_change(new_engine, model_tok):
    model, _ = model_tok
    params = SamplingParams(max_tokens=6, greedy=True)
    eng = new_engine()
    gens = eng.generate(PROMPTS, params)
    second = _next_wave(PROMPTS, gens, [20, 21])
    with torch.no_grad():  # an optimizer step: the shared model changes in place
        for p in model.parameters():
            p.mul_(1.5)
    try:
        after = eng.generate(second, params)
        assert eng.tokens_reused == 0  # the kept keys/values were those of other weights
        fresh = new_engine(prefix_cache_bytes=0).generate(second, params)
        assert [g.token_ids for g in after] == [g.token_ids for g in fresh]
    finally:
        with torch.no_grad():
            for p in model.parameters():
                p.div_(1.5)


def test_common_prefix_of_different_prompts_is_prefilled_once(new_engine):
    params = SamplingParams(max_tokens=8, greedy=True)
    shared = list(range(40, 60))  # 20 tokens of instructions, then each question's own
    prompts = [shared + [5], shared + [6, 7], shared + [8]]
    ours = new_engine()
    off = new_engine(common_prefix=False)
    a, b = ours.generate(prompts, params), off.generate(prompts, params)
    # the 20 shared tokens once, then 1 + 2 + 1 own tokens; without it 21 + 22 + 21
    assert ours.tokens_prefilled == 20 + 4 and ours.tokens_reused == 3 * 20
    assert off.tokens_prefilled == 64 and off.tokens_reused == 0
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs, strict=True)) < 1e-4
    # under 16 shared tokens a separate forward costs more than it saves: none is run
    short = new_engine()
    short.generate([shared[:10] + [5], shared[:10] + [6, 7]], params)
    assert short.tokens_prefilled == 11 + 12 and short.tokens_reused == 0


def test_append_cache_writes_in_place_and_holds_what_concatenation_would():
    from a2tgpo.model.fast_decode import new_cache

    g = torch.Generator().manual_seed(0)
    cache = new_cache(fast_path=True)
    ref_k = torch.randn(3, 2, 5, 4, generator=g)  # (B, H_kv, n, d): a prefill of 5 tokens
    ref_v = torch.randn(3, 2, 5, 4, generator=g)
    cache.update(ref_k, ref_v, 0)
    buffers = set()
    for t in range(40):
        if t == 20:  # a row finishes: the batch shrinks, as in HfEngine._generate_batch
            idx = torch.tensor([0, 2])
            cache.batch_select_indices(idx)
            ref_k, ref_v = ref_k[idx], ref_v[idx]
        k1 = torch.randn(ref_k.shape[0], 2, 1, 4, generator=g)
        v1 = torch.randn(ref_k.shape[0], 2, 1, 4, generator=g)
        keys, values = cache.update(k1, v1, 0)
        ref_k, ref_v = torch.cat([ref_k, k1], -2), torch.cat([ref_v, v1], -2)
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
        assert cache.get_seq_length() == ref_k.shape[-2]
        buffers.add(cache.layers[0]._k.data_ptr())
    # 45 tokens fit the first buffer (2 x 6 + 64 columns); the shrink copies it once
    assert len(buffers) == 2


def _same_generations(ours, stock, tok):
    """Engines made by `ours` and `stock` (functools.partial of HfEngine) give the same ids
    and log-probs within 1e-5, sampled and greedy, over two waves (the second reuses the kept
    prefixes), with rows finishing at different steps."""
    probe = ours().generate(PROMPTS, SamplingParams(max_tokens=20), seeds=[7, 8, 9])
    eos = [probe[1].token_ids[2], tok.eos_token_id]  # rows finish at different steps
    for params in (SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, greedy=True)):
        a_eng, b_eng = ours(eos_token_ids=eos), stock(eos_token_ids=eos)
        prompts = PROMPTS
        for _ in range(2):  # a second wave reuses the kept prefixes
            a = a_eng.generate(prompts, params, seeds=[7, 8, 9])
            b = b_eng.generate(prompts, params, seeds=[7, 8, 9])
            for x, y in zip(a, b, strict=True):
                assert x.token_ids == y.token_ids
                assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs,
                                                      strict=True)) < 1e-5
            prompts = _next_wave(prompts, a, [20, 21])
        assert a_eng.tokens_reused == b_eng.tokens_reused > 0


def test_append_cache_gives_the_dynamic_cache_result(model_tok):
    # the cache alone: one model (either attention), the two caches
    _same_generations(functools.partial(HfEngine, *model_tok, fast_path=True),
                      functools.partial(HfEngine, *model_tok, fast_path=False), model_tok[1])


def test_the_stock_path_gives_the_fast_paths_ids_and_logprobs(toy_dir):
    # the whole path: the fast attention and cache against transformers' sdpa and DynamicCache
    fast, stock = _load(toy_dir, True), _load(toy_dir, False)
    _same_generations(functools.partial(HfEngine, *fast, fast_path=True),
                      functools.partial(HfEngine, *stock, fast_path=False), fast[1])


def test_cpu_attention_never_copies_grouped_heads_and_matches_sdpa(toy_dir, monkeypatch):
    """a2tgpo.model.fast_decode.ATTENTION: transformers' sdpa, minus the copy of each key/value
    head per query head (4 heads over 2 here), on a left-padded batch (a mask)."""
    import transformers.integrations.sdpa_attention as sdpa_mod

    model, _ = _load(toy_dir, True)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    copies = []
    real_repeat = sdpa_mod.repeat_kv
    monkeypatch.setattr(sdpa_mod, "repeat_kv", lambda x, n: copies.append(n) or real_repeat(x, n))
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).logits
        assert copies == []
        model.set_attn_implementation("sdpa")
        try:
            stock = model(input_ids=ids, attention_mask=mask).logits
        finally:
            model.set_attn_implementation(ATTENTION)
    assert copies  # the stock path copies: the check above can fail
    real = mask.bool()
    assert torch.allclose(ours[real], stock[real], atol=1e-5, rtol=0)


def test_the_backbone_key_and_an_unverified_transformers_select_the_stock_path(
        toy_dir, tmp_path, monkeypatch, caplog):
    """backbone.fast_path false, or a transformers the fast path was not verified against: the
    model loads with transformers' sdpa and the engine decodes with its DynamicCache."""
    import logging
    from types import SimpleNamespace

    import transformers
    from transformers import DynamicCache

    from a2tgpo.model import fast_decode
    from a2tgpo.model.backbone import load_backbone_config, load_model, load_tokenizer
    from a2tgpo.train.episodes import make_engine

    def loaded(text):
        path = tmp_path / "backbone.yaml"
        path.write_text(f"id: toy\npath: {toy_dir / 'backbone'}\ndtype: float32\n{text}")
        cfg = load_backbone_config(path)
        tok = load_tokenizer(cfg)
        engine = make_engine(SimpleNamespace(engine="hf", backbone=cfg), load_model(cfg), tok)
        return engine.model.config._attn_implementation, type(engine._new_cache())

    fast_cache = type(fast_decode.new_cache(True))
    assert fast_cache is not DynamicCache
    assert loaded("") == (ATTENTION, fast_cache)  # the default: the fast path
    assert loaded("fast_path: false\n") == ("sdpa", DynamicCache)
    monkeypatch.setattr(transformers, "__version__", "5.20.0")
    fast_decode._verified.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=fast_decode.__name__):
            assert loaded("") == ("sdpa", DynamicCache)
            assert loaded("fast_path: true\n") == ("sdpa", DynamicCache)
    finally:
        fast_decode._verified.cache_clear()
    # one line for two model loads and their engines' caches
    assert [r.getMessage()[:31] for r in caplog.records if r.name == fast_decode.__name__
            ] == ["transformers 5.20.0 is not a ve"]
