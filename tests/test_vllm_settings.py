"""A request's MARS fields on vLLM (`vllm_xargs`), checked by the rules of `DecodeConfig`: pure Python,
no vLLM needed."""

import pytest

from mars_ray.core.errors import ConfigError
from mars_ray.vllm.settings import check, settings_of


def test_fields_arrive_as_json_and_are_checked_where_their_rules_live():
    assert check({"block_size": 2.0, "tau": 0.5}, 4).window == 2  # JSON may carry a whole window as 2.0
    assert check(None, 4) == check({"tau": 0.9, "verify": True, "block_size": 4}, 4)
    for fields, name in [
        ({"tau": 1.5}, "tau"),
        ({"tau": "high"}, "tau"),
        ({"block_size": 2.5}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"block_size": 5}, "block_size"),  # wider than the trained B
        ({"block_size": 0}, "block_size"),
        ({"verify": 1}, "verify"),
        ({"calibrated": "no"}, "calibrated"),
    ]:
        with pytest.raises(ConfigError, match=name):
            check(fields, 4)


def test_the_worker_decodes_refused_fields_as_plain_ar():
    settings = settings_of({"tau": 0.5, "block_size": 7}, 4, greedy=True)
    assert (settings.window, settings.mode, settings.relaxed) == (1, "ar", False)
    relaxed = settings_of({"tau": 0.5, "verify": False, "calibrated": False}, 4, greedy=True)
    assert (relaxed.window, relaxed.mode, relaxed.relaxed, relaxed.calibrated) == (4, "mars", True, False)
