"""The encoder on a GPU: fp16 by default, same vectors as fp32 on CPU up to fp16 rounding."""

import numpy as np
import pytest

from a2tgpo.retrieval.encoders import Encoder, EncoderConfig

pytestmark = pytest.mark.gpu

TEXTS = [f"passage number {i} about the silent harbor and its director" * (1 + i % 4)
         for i in range(64)]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A small random BERT with a WordPiece tokenizer: e5-base-v2's architecture, offline."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("bert")
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(TEXTS, trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]")
    fast.save_pretrained(d)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(fast), hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=128)).save_pretrained(d)
    return str(d)


def test_fp16_gpu_matches_fp32_cpu(bert_dir):
    gpu = Encoder(EncoderConfig(model=bert_dir, device="auto", query_prefix="query: "))
    assert gpu.device == "cuda" and next(gpu.model.parameters()).dtype.itemsize == 2
    cpu = Encoder(EncoderConfig(model=bert_dir, device="cpu", query_prefix="query: "))
    a, b = gpu.encode(TEXTS, "query"), cpu.encode(TEXTS, "query")
    # unit vectors; fp16 keeps ~3 decimal digits per activation, so after two layers and mean
    # pooling the cosine to the fp32 vector stays above 0.999
    cos = (a * b).sum(1)
    assert cos.min() > 0.999, cos.min()
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
