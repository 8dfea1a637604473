"""A request's forwards on vLLM, read from its acceptance histogram (`mars_ray.vllm.passes`, no vLLM)."""

from __future__ import annotations

from mars_ray.vllm.passes import accepted_per_forward, histogram_of


def test_each_verify_step_emits_its_accepted_drafts_and_one_more():
    # 3 steps with no draft accepted, 2 with one, 1 with three; 4 tokens from forwards without drafts
    steps = accepted_per_forward(3 + 2 * 2 + 4 + 4, [3, 2, 0, 1])
    assert sorted(steps) == [1] * 7 + [2, 2, 4]


def test_a_reply_cut_inside_a_step_adds_up_to_its_tokens():
    """max_tokens or a stop string ends a reply inside its last step's accepted run: the forwards stay, the
    tokens are the reply's."""
    steps = accepted_per_forward(9, [0, 1, 0, 2])  # the steps accepted 2 + 4 + 4 = 10 tokens
    assert (len(steps), sum(steps)) == (3, 9)
    assert accepted_per_forward(0, []) == []


def test_the_histogram_from_either_form():
    assert histogram_of({"acceptance_histogram": [2, 1]}) == [2, 1]
    assert histogram_of(None) == []
