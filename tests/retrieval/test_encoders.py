"""The encoder against sentence-transformers (an independent implementation of MiniLM)."""

import json

import numpy as np
import pytest

from a2tgpo.retrieval.encoders import Encoder, EncoderConfig, model_path


@pytest.fixture(scope="module")
def passages(world_dir):
    return [json.loads(line)["contents"] for line in (world_dir / "corpus.jsonl").open()][:40]


def test_matches_sentence_transformers(encoder, passages):
    from sentence_transformers import SentenceTransformer

    # all-MiniLM-L6-v2 in sentence-transformers = Transformer -> mean pooling -> Normalize,
    # max_seq_length 256: the same pipeline, computed by another library
    ref = SentenceTransformer(model_path(EncoderConfig()), device="cpu").encode(
        passages, normalize_embeddings=True, batch_size=7)
    ours = encoder.encode(passages, "passage")
    assert ours.shape == (40, 384) and ours.dtype == np.float32
    # float32 sums over different padding lengths: agreement to ~1e-7 is expected
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)


def test_length_sorting_keeps_input_order(encoder, passages):
    unsorted = Encoder(EncoderConfig(batch_size=16, sort_by_length=False))
    np.testing.assert_allclose(encoder.encode(passages, "passage"),
                               unsorted.encode(passages, "passage"), atol=1e-5, rtol=0)


def test_e5_prefixes_are_applied(encoder):
    e5_style = Encoder(EncoderConfig(query_prefix="query: ", passage_prefix="passage: "))
    q = e5_style.encode(["who directed it"], "query")
    p = e5_style.encode(["who directed it"], "passage")
    np.testing.assert_allclose(q, encoder.encode(["query: who directed it"], "query"), atol=1e-6)
    np.testing.assert_allclose(p, encoder.encode(["passage: who directed it"], "query"), atol=1e-6)
    assert np.abs(q - p).max() > 1e-3


def test_cls_pooling_and_truncation_change_the_vector(encoder, passages):
    cls = Encoder(EncoderConfig(pooling="cls")).encode(passages[:2], "passage")
    short = Encoder(EncoderConfig(max_length=4)).encode(passages[:2], "passage")
    mean = encoder.encode(passages[:2], "passage")
    assert np.abs(cls - mean).max() > 1e-2 and np.abs(short - mean).max() > 1e-2
