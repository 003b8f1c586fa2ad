"""The backbone loader on a GPU: the same code path as CPU, in bf16 by default."""

import pytest
import torch

from a2tgpo.data.world import QASetSpec, WorldConfig, write_world
from a2tgpo.model.backbone import BackboneConfig, load_model, load_tokenizer
from a2tgpo.model.toy import ToyBackboneConfig, write_toy_backbone

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def toy_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    world = WorldConfig(countries=4, cities=8, people=30, films=12, bands=6, companies=8,
                        distractors=10,
                        qa_sets=(QASetSpec("s", "single_hop", {"train": 20}, {"single": 1.0}),))
    write_world(world, root / "world")
    write_toy_backbone(ToyBackboneConfig(), root / "world", root / "backbone")
    return str(root / "backbone")


def _probs(model, ids):
    with torch.no_grad():
        return torch.softmax(model(input_ids=ids.to(model.device)).logits.float(), -1).cpu()


def test_gpu_matches_cpu(toy_path):
    tok = load_tokenizer(BackboneConfig(id="toy", path=toy_path))
    ids = torch.tensor([tok.encode("Who directed The Silent Harbor? <search> The Silent "
                                   "Harbor </search>", add_special_tokens=False)])
    ref = _probs(load_model(BackboneConfig(id="toy", path=toy_path, dtype="float32")), ids)

    gpu32 = load_model(BackboneConfig(id="toy", path=toy_path, dtype="float32"), "cuda")
    assert gpu32.device.type == "cuda"
    # fp32 on both sides (TF32 matmuls are off by default in torch): only summation order
    # differs, so probabilities agree to ~1e-6; 1e-5 leaves room for reduction order alone
    torch.testing.assert_close(_probs(gpu32, ids), ref, atol=1e-5, rtol=0)

    auto = load_model(BackboneConfig(id="toy", path=toy_path, dtype="auto"), "cuda")
    assert next(auto.parameters()).dtype == torch.bfloat16  # "auto" = bf16 on GPU
    # bf16 keeps 8 mantissa bits (relative step 2^-8 = 0.004); through 4 layers the
    # next-token probabilities (all < 0.01 for a random model over ~2300 tokens) move by far
    # less than 0.005 absolute
    diff = (_probs(auto, ids) - ref).abs().max().item()
    assert diff < 5e-3, diff
