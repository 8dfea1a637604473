"""`group_by_length`: one rule for the in-memory sampler and each worker's stream."""

from __future__ import annotations

from mars_ray.train import batching


def test_each_megabatch_is_sorted_then_cut_then_reordered():
    lengths = [(i * 37) % 101 for i in range(2 * batching.MEGABATCH * 3 + 5)]  # two windows and a tail
    items = list(range(len(lengths)))
    batches = batching.group_by_length(items, 3, lengths.__getitem__, lambda count: list(range(count)))
    assert [i for b in batches for i in b] == sorted(items[:150], key=lengths.__getitem__) + sorted(
        items[150:300], key=lengths.__getitem__
    ) + sorted(items[300:], key=lengths.__getitem__)
    assert [len(b) for b in batches] == [3] * 101 + [2]
    reversed_ = batching.group_by_length(
        items, 3, lengths.__getitem__, lambda count: list(range(count))[::-1]
    )
    assert reversed_ == batches[::-1]


def test_each_epoch_has_its_own_seed():
    seeds = {batching.epoch_seed(seed, epoch) for seed in range(3) for epoch in range(100)}
    assert len(seeds) == 300
