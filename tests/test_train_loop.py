"""The worker loop's arithmetic, without Ray: the global batch of a step, each worker's equal share, and
loss scaling such that micro-steps (and, with DDP averaging, workers) add up to the joined batch exactly."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS_ID, MASK_ID, PAD_ID, build_tiny, random_prompts

from mars_ray.core.objective import IGNORE, Example, ScoredLM, ar_loss, collate_ar, collate_mars, mars_loss
from mars_ray.train.steps import BatchSampler, Objective, accumulate_gradients, worker_micro_batches


def test_steps_walk_through_epochs_of_shuffles():
    sampler = BatchSampler(range(10), global_batch=4, seed=1, group_by_length=False)
    steps = [sampler(step) for step in range(5)]  # 20 positions = 2 epochs
    stream = [i for s in steps for i in s]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert stream[:10] != stream[10:]  # reshuffled
    resumed = BatchSampler(range(10), global_batch=4, seed=1, group_by_length=False)
    assert resumed(3) == steps[3]  # a worker that resumes at step 3 finds the same batch
    assert BatchSampler(range(10), global_batch=4, seed=2, group_by_length=False)(0) != steps[0]


def test_grouping_by_length_gives_batches_of_similar_length():
    lengths = [(i * 37) % 101 for i in range(1000)]
    grouped = BatchSampler(lengths, global_batch=10, seed=0, group_by_length=True)
    plain = BatchSampler(lengths, global_batch=10, seed=0, group_by_length=False)

    def padding(sampler: BatchSampler) -> int:
        return sum(
            max(lengths[i] for i in sampler(s)) * 10 - sum(lengths[i] for i in sampler(s)) for s in range(100)
        )

    assert padding(grouped) < padding(plain) / 10
    epoch = [i for step in range(100) for i in grouped(step)]
    assert sorted(epoch) == list(range(1000))  # still every example once per epoch
    first_batches = [max(lengths[i] for i in grouped(step)) for step in range(10)]
    assert first_batches != sorted(first_batches, reverse=True)  # batch order shuffled, not long to short


def test_workers_share_each_micro_step_equally():
    indices = list(range(100, 112))  # 2 micro-steps x 3 workers x 2 examples
    shares = [worker_micro_batches(indices, rank, 3, grad_accum=2) for rank in range(3)]
    for micro in range(2):
        joined = sorted(i for rank in range(3) for i in shares[rank][micro])
        assert joined == indices[micro * 6 : (micro + 1) * 6]
        assert {len(shares[rank][micro]) for rank in range(3)} == {2}


def examples(count: int) -> list[Example]:
    """Prompts of random length with responses of random length: unequal token counts per example."""
    prompts = random_prompts(count, seed=3)
    responses = random_prompts(count, low=2, high=9, seed=4)
    return [
        Example(p + r + [EOS_ID], [IGNORE] * len(p) + r + [EOS_ID])
        for p, r in zip(prompts, responses, strict=True)
    ]


@pytest.mark.parametrize("stage", ["ar-sft", "mars"])
def test_micro_steps_add_up_to_the_joined_batch(stage):
    objective = Objective(stage, 4, 0.5, MASK_ID, PAD_ID, EOS_ID)
    batch = examples(6)
    model = ScoredLM(build_tiny("llama", sharpness=1.0))
    if stage == "ar-sft":
        joined = collate_ar(batch, PAD_ID)
        expected = ar_loss(model(**joined.model_inputs()), joined)
    else:
        joined = collate_mars(batch, 4, MASK_ID, PAD_ID, EOS_ID)
        expected = mars_loss(model(**joined.model_inputs()), joined, 0.5).total
    expected.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    micro_batches = [batch[:2], batch[2:3], batch[3:]]  # unequal on purpose
    losses = accumulate_gradients(
        model, objective, micro_batches, objective.normaliser(batch), 1, torch.device("cpu")
    )

    assert losses["total"] == pytest.approx(expected.item(), rel=1e-12)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected_grads[name], rtol=1e-10, atol=1e-12)
    if stage == "mars":
        assert losses["noisy"] + 0.5 * losses["clean"] == pytest.approx(losses["total"], rel=1e-12)
