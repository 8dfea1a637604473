"""The rules with one home in the core: the tau and window ranges and the mode label (`DecodeConfig`), and the
batch-admission rule (`Admission`) that serving and offline decoding share."""

from __future__ import annotations

import math

import pytest
from conftest import MASK_ID, PAD_ID, random_prompts

from mars_ray.core.admission import Admission
from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decoder import SlidingDecoder, decode_continuous
from mars_ray.core.errors import ConfigError
from mars_ray.core.reference import decode_reference


@pytest.mark.parametrize("tau", [0.0, -0.5, 1.5, math.inf, math.nan, True, "0.5", None])
def test_tau_outside_zero_one_is_refused_naming_the_field(tau):
    with pytest.raises(ConfigError) as error:
        DecodeConfig.check_tau(tau, "verify_tau")
    assert error.value.field == "verify_tau"
    with pytest.raises(ConfigError, match="tau"):
        DecodeConfig(tau=tau)


@pytest.mark.parametrize("tau", [1e-4, 0.5, 1.0, 1])
def test_tau_in_zero_one_passes(tau):
    assert DecodeConfig.check_tau(tau) == tau


def test_window_range():
    assert DecodeConfig.check_block_size(4, most=4) == 4
    for bad, most in [(0, None), (5, 4), (2.5, None), (True, None)]:
        with pytest.raises(ConfigError) as error:
            DecodeConfig.check_block_size(bad, "max_block_size", most)
        assert error.value.field == "max_block_size"


@pytest.mark.parametrize(
    ("fields", "mode"),
    [
        (dict(tau=1.0), "ar"),
        (dict(tau=1.0, verify=True), "ar"),  # one token per forward: nothing is drafted or verified
        (dict(tau=0.5, block_size=1), "ar"),
        (dict(tau=0.5, max_accept=1), "ar"),
        (dict(tau=0.5), "mars"),
        (dict(tau=0.5, verify=True), "verify"),
    ],
)
def test_the_mode_label(fields, mode):
    config = DecodeConfig(**fields)
    assert config.mode == mode == DecodeConfig.mode_of(config.window, config.verify)


def test_admission_fills_every_free_row_at_once():
    rule = Admission(max_rows=4)
    assert [rule.joining(held, 10) for held in range(6)] == [4, 3, 2, 1, 0, 0]
    assert rule.joining(1, 2) == 2
    assert Admission().joining(100, 7) == 7


def test_admission_prefills_oldest_first_within_the_budget_never_a_last_token():
    assert Admission(prefill_budget=5).prefill_chunks([4, 6, 1]) == [3, 2, 0]
    assert Admission().prefill_chunks([4, 6, 1]) == [3, 5, 0]


@pytest.mark.parametrize(
    ("fields", "field"), [(dict(max_rows=0), "max_batch_size"), (dict(prefill_budget=0), "prefill_budget")]
)
def test_admission_refuses_nonsense(fields, field):
    with pytest.raises(ConfigError) as error:
        Admission(**fields)
    assert error.value.field == field


def test_offline_decoding_admits_as_serving_does(tiny_llama, monkeypatch):
    """`decode_continuous` (eval, calibrate, distill) gives a freed row to the next prompt at the next step,
    as the serving engine does (`SlidingDecoder.admits`): the batch holds `max_batch` rows for as long as
    prompts wait, then drains; and every prompt decodes what it decodes alone."""
    prompts = random_prompts(20, seed=81)
    config = DecodeConfig(tau=0.5, block_size=4, max_new_tokens=8)
    held, step = [], SlidingDecoder.step

    def counted(decoder):
        held.append(len(decoder.seqs) + len(decoder.joining))
        return step(decoder)

    monkeypatch.setattr(SlidingDecoder, "step", counted)
    found = dict(decode_continuous(tiny_llama, prompts, MASK_ID, config, PAD_ID, max_batch=8))
    assert sorted(found) == list(range(20))
    drained = next(i for i, rows in enumerate(held) if rows < 8)
    assert drained > 3  # rows finished and were replaced while prompts waited
    assert all(a >= b for a, b in zip(held[drained:], held[drained + 1 :], strict=False))
    for i, prompt in enumerate(prompts):
        assert found[i].tokens == decode_reference(tiny_llama, prompt, MASK_ID, config).tokens
