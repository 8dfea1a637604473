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
        ({"follow": "yes"}, "follow"),
    ]:
        with pytest.raises(ConfigError, match=name):
            check(fields, 4)


def test_a_request_that_follows_takes_what_it_leaves_unset_from_the_engines_point():
    """A replica's request (`follow`) decodes at the engine's operating point as on the native engine: the
    verified mode for greedy requests, tau 1 for sampled ones (verification is greedy only), its own
    fields where it set them; without a point set it is a plain vLLM request."""
    verified, lossy = (0.5, True, 4), (0.7, False, 3)
    follow = {"follow": True}
    assert (check(follow, 4, True, verified).tau, check(follow, 4, True, verified).verify) == (0.5, True)
    assert check(follow, 4, False, verified).window == 1  # sampled: exact at tau 1
    assert (check(follow, 4, False, lossy).tau, check(follow, 4, False, lossy).window) == (0.7, 3)
    pinned = check(follow | {"tau": 0.3, "block_size": 2}, 4, True, lossy)
    assert (pinned.tau, pinned.verify, pinned.window) == (0.3, False, 2)
    assert check(follow, 4, True, None) == check(None, 4)
    assert check({}, 4, True, lossy) == check(None, 4)  # not following: the point does not apply


def test_the_worker_decodes_refused_fields_as_plain_ar():
    settings = settings_of({"tau": 0.5, "block_size": 7}, 4, greedy=True)
    assert (settings.window, settings.mode, settings.relaxed) == (1, "ar", False)
    relaxed = settings_of({"tau": 0.5, "verify": False, "calibrated": False}, 4, greedy=True)
    assert (relaxed.window, relaxed.mode, relaxed.relaxed, relaxed.calibrated) == (4, "mars", True, False)


def test_a_vllm_replica_decodes_on_as_many_cores_as_it_has_threads():
    """vLLM-CPU's own binding would keep one of 2 cores for its scheduler; a replica binds its threads."""
    import os

    from mars_ray.serve.config import ModelConfig
    from mars_ray.vllm.config import cpu_bind

    assert [ModelConfig(model="tiny", num_cpus=n).threads for n in (0.5, 1, 2)] == [1, 1, 2]
    assert ModelConfig(model="tiny", num_cpus=1, torch_threads=2).threads == 2
    cores = sorted(os.sched_getaffinity(0))
    assert cpu_bind(2) == ",".join(str(core) for core in cores[:2])
    assert cpu_bind(1) == str(cores[0])
