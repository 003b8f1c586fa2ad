"""Copy pretraining: the task's batches, which positions are scored, the schedule, determinism."""

import math
from types import SimpleNamespace

import pytest
import torch

from a2tgpo.model.copy_pretrain import (
    CopyPretrainConfig,
    CopyPretrainFailed,
    copy_batch,
    copy_loss,
    copy_pretrain,
    heldout_accuracy,
    lr_factor,
    token_pool,
)
from a2tgpo.model.toy import ToyBackboneConfig, build_model, build_tokenizer


@pytest.fixture(scope="module")
def toy_tokenizer():
    return build_tokenizer(ToyBackboneConfig(vocab_size=512),
                           iter(["The Wild Mirror was directed by Jeashi Basou."] * 20))


class Induction(torch.nn.Module):
    """A perfect induction "model": at a position whose token occurred before, it predicts
    the token that followed that earlier occurrence (logit 30); elsewhere uniform logits."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids, use_cache=False):
        B, L = input_ids.shape
        logits = torch.zeros(B, L, self.vocab)
        for b in range(B):
            ids = input_ids[b].tolist()
            for t in range(L):
                earlier = [j for j in range(t) if ids[j] == ids[t]]
                if earlier:
                    logits[b, t, ids[earlier[-1] + 1]] = 30.0
        return SimpleNamespace(logits=logits)


def test_batches_repeat_random_pool_ids_and_follow_the_seed():
    pool = torch.tensor([5, 6, 7, 9])
    a = copy_batch(pool, 3, 8, torch.Generator().manual_seed(1))
    assert a.shape == (3, 16)
    assert torch.equal(a[:, :8], a[:, 8:])
    assert set(a.unique().tolist()) <= {5, 6, 7, 9}
    assert torch.equal(a, copy_batch(pool, 3, 8, torch.Generator().manual_seed(1)))
    assert not torch.equal(a, copy_batch(pool, 3, 8, torch.Generator().manual_seed(2)))


def test_the_pool_leaves_out_special_tokens(toy_tokenizer):
    pool = set(token_pool(toy_tokenizer).tolist())
    assert not pool & set(toy_tokenizer.all_special_ids)
    assert len(pool) == len(toy_tokenizer) - len(set(toy_tokenizer.all_special_ids))


def test_only_predictable_positions_are_scored():
    # distinct tokens 0..5 then the repeat: an induction model predicts every repeat token
    # after the first; scoring the repeat's first token too (position n - 1, where nothing has
    # repeated yet) would cost it accuracy 5/6 and loss log(V)/6 > 0
    ids = torch.tensor([[0, 1, 2, 3, 4, 5] * 2])
    loss, acc = copy_loss(Induction(vocab=16), ids)
    assert acc == 1.0
    assert loss.item() == pytest.approx(0.0, abs=1e-9)


def test_lr_factor_warms_up_then_decays_to_a_tenth():
    assert lr_factor(0, 100, 10) == pytest.approx(0.1)  # (0 + 1) / 10
    assert lr_factor(9, 100, 10) == pytest.approx(1.0)
    assert lr_factor(10, 100, 10) == pytest.approx(1.0)  # cos(0): 0.1 + 0.45 * 2
    assert lr_factor(55, 100, 10) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 2)))
    assert lr_factor(100, 100, 10) == pytest.approx(0.1)


def small_model(tok):
    cfg = ToyBackboneConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return build_model(cfg, tok)


def test_pretraining_is_deterministic_and_off_at_zero_steps(toy_tokenizer):
    cfg = CopyPretrainConfig(steps=6, batch_size=4, min_length=4, max_length=8, warmup_steps=2,
                             min_accuracy=0.0)
    a, b = small_model(toy_tokenizer), small_model(toy_tokenizer)
    start = {k: v.clone() for k, v in a.state_dict().items()}
    ha, hb = copy_pretrain(a, toy_tokenizer, cfg), copy_pretrain(b, toy_tokenizer, cfg)
    assert ha["history"] == hb["history"] and ha["history"][-1]["step"] == 6
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert any(not torch.equal(v, start[k]) for k, v in a.state_dict().items())
    c = small_model(toy_tokenizer)
    assert copy_pretrain(c, toy_tokenizer, CopyPretrainConfig(steps=0)) == \
        {"steps": 0, "history": []}
    assert all(torch.equal(v, start[k]) for k, v in c.state_dict().items())


def test_lengths_are_checked():
    with pytest.raises(ValueError, match="min_length"):
        CopyPretrainConfig(min_length=9, max_length=8)


def test_heldout_accuracy_is_one_for_an_induction_model_and_its_draws_are_fresh(
        monkeypatch):
    cfg = CopyPretrainConfig(batch_size=2, min_length=4, max_length=6, eval_batches=3)
    # a pool of 4,997 ids: no id repeats inside a drawn sequence (with 37 ids one does, and
    # the induction rule then follows the wrong earlier occurrence: 0.84)
    pool = torch.arange(3, 5000)
    assert heldout_accuracy(Induction(vocab=5000), pool, cfg) == 1.0
    # the held-out sequences are not the training's: training draws from Generator(seed)
    seen = []
    real = copy_batch

    def spy(pool_V, batch_size, length, generator):
        out = real(pool_V, batch_size, length, generator)
        seen.append(out)
        return out

    monkeypatch.setattr("a2tgpo.model.copy_pretrain.copy_batch", spy)
    heldout_accuracy(Induction(vocab=5000), pool, cfg)
    assert [b.shape[1] for b in seen] == [8, 10, 12]  # lengths 4, 5, 6, each repeated
    train_first = copy_batch(pool, 2, 4, torch.Generator().manual_seed(cfg.seed))
    assert not torch.equal(seen[0], train_first)


def test_a_model_that_did_not_learn_to_copy_fails_the_stage(toy_tokenizer):
    # 2 updates cannot teach induction: held-out accuracy stays near chance (1/|pool|)
    cfg = CopyPretrainConfig(steps=2, batch_size=2, min_length=4, max_length=6, warmup_steps=1,
                             min_accuracy=0.5)
    with pytest.raises(CopyPretrainFailed, match="toy_backbone.copy.min_accuracy 0.5"):
        copy_pretrain(small_model(toy_tokenizer), toy_tokenizer, cfg)
    ok = copy_pretrain(small_model(toy_tokenizer), toy_tokenizer,
                       CopyPretrainConfig(steps=2, batch_size=2, min_length=4, max_length=6,
                                          warmup_steps=1, min_accuracy=0.0))
    assert 0.0 <= ok["heldout_accuracy"] < 0.5
