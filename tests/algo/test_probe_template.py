"""The information-gain probe: the papers' template by default, any answer format by option."""

import pytest

from a2tgpo.algo.methods import InfoGainConfig


def test_the_default_probe_template_is_the_papers():
    # IGPO's probe as spec/algorithms.md quotes it: the closing think, the answer, end of turn
    assert InfoGainConfig().probe_template == (
        "\nNow there's enough information to answer\n</think>\n<answer>\n{gt}\n</answer>"
        "<|im_end|>")
    with pytest.raises(ValueError, match="probe_template must contain"):
        InfoGainConfig(probe_template="no placeholder")
