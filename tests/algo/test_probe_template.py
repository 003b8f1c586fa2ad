"""The information-gain probe: the papers' template by default, any answer format by option."""

import pytest

from a2tgpo.algo.methods import InfoGainConfig
from a2tgpo.rollout.info_gain import IGPO_TEMPLATE


def test_the_default_probe_template_is_the_papers():
    # the method option's default is the IGPO template the probe module defines
    assert InfoGainConfig().probe_template == IGPO_TEMPLATE
    with pytest.raises(ValueError, match="probe_template must contain"):
        InfoGainConfig(probe_template="no placeholder")
