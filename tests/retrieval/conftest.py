"""A small toy world and its corpus, shared by the retrieval tests (built once per session)."""

import pytest

from a2tgpo.data.world import QASetSpec, WorldConfig, write_world


@pytest.fixture(scope="session")
def world_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("world")
    cfg = WorldConfig(
        countries=4, cities=8, people=30, films=12, bands=6, companies=8, distractors=10,
        qa_sets=(QASetSpec("s", "single_hop", {"test": 40}, {"single": 1.0}),
                 QASetSpec("m", "multi_hop", {"dev": 20}, {"bridge": 0.5, "composition": 0.5})),
    )
    write_world(cfg, d)
    return d


@pytest.fixture(scope="session")
def encoder():
    from a2tgpo.retrieval.encoders import Encoder, EncoderConfig

    return Encoder(EncoderConfig(batch_size=16))
