"""Checkpoints are whole or refused: a crash while saving, or while Ray Train copies the folder to storage
in any order, never leaves a folder that loads as a checkpoint but holds the wrong state."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import ray.train
import torch
from safetensors.torch import load_file

from mars_ray import models
from mars_ray.train.loop import checkpoint_name, newest_whole_checkpoint
from mars_ray.train.steps import (
    MANIFEST,
    TRAINER_STATE,
    IncompleteCheckpoint,
    save_checkpoint,
    verify_checkpoint,
    write_manifest,
)


def _save(folder: Path, step: int) -> None:
    model, tokenizer = models.load("tiny")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    folder.mkdir()
    save_checkpoint(folder, model, tokenizer, optimizer, scheduler, step)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt") / "checkpoint_000007"
    _save(folder, 7)
    return folder


def test_a_whole_checkpoint_verifies_and_loads(whole):
    assert verify_checkpoint(whole) == 7
    assert torch.load(whole / TRAINER_STATE, map_location="cpu")["step"] == 7
    model, tokenizer = models.load(str(whole))  # still a plain `save_pretrained` folder
    assert tokenizer.mask_token is not None and model.num_parameters() > 0


def test_every_partial_copy_is_refused(whole, tmp_path):
    """Ray Train copies the worker's folder file by file, in an order of its own: every proper subset of
    the files, in whatever order they arrived, must be refused, and only the full set accepted."""
    names = sorted(path.name for path in whole.iterdir())
    assert MANIFEST in names and "model.safetensors" in names
    for count in range(len(names)):
        for subset in itertools.combinations(names, count):
            partial = tmp_path / f"partial-{count}-{'-'.join(subset)}"
            partial.mkdir()
            for name in subset:
                shutil.copy(whole / name, partial / name)
            with pytest.raises(IncompleteCheckpoint) as refused:
                verify_checkpoint(partial)
            missing = sorted(set(names) - set(subset))
            assert refused.value.path in missing  # it names a file that did not arrive
            shutil.rmtree(partial)


@pytest.mark.parametrize("name", ["model.safetensors", TRAINER_STATE, "config.json"])
def test_a_file_cut_short_or_altered_is_refused(whole, tmp_path, name):
    for damage in ("truncate", "flip"):
        copy = tmp_path / damage
        shutil.copytree(whole, copy)
        data = (copy / name).read_bytes()
        if damage == "truncate":
            (copy / name).write_bytes(data[: len(data) // 2])
        else:
            middle = len(data) // 2
            (copy / name).write_bytes(data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1 :])
        with pytest.raises(IncompleteCheckpoint, match=name) as refused:
            verify_checkpoint(copy)
        assert refused.value.path == name
        shutil.rmtree(copy)


def test_a_process_killed_while_saving_leaves_no_wrong_checkpoint(tmp_path):
    """A real SIGKILL at arbitrary moments of a process that saves checkpoint after checkpoint, each with
    different weights: every folder either is refused or holds exactly the weights of its own step."""
    script = textwrap.dedent(
        """
        import sys, torch
        from pathlib import Path
        from mars_ray import models
        from mars_ray.train.steps import save_checkpoint
        model, tokenizer = models.load("tiny")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        root = Path(sys.argv[1])
        print("ready", flush=True)
        for step in range(1, 10_000):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.fill_(step)
            folder = root / f"checkpoint_{step:06d}"
            folder.mkdir()
            save_checkpoint(folder, model, tokenizer, optimizer, scheduler, step)
        """
    )
    refused = accepted = 0
    for round_, delay in enumerate((0.4, 0.9)):
        root = tmp_path / f"run-{round_}"
        root.mkdir()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        process = subprocess.Popen([sys.executable, "-c", script, str(root)], stdout=subprocess.PIPE, env=env)
        assert process.stdout.readline().strip() == b"ready"
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        for folder in sorted(root.iterdir()):
            try:
                step = verify_checkpoint(folder)
            except IncompleteCheckpoint:
                refused += 1
                continue
            accepted += 1
            assert step == int(folder.name.split("_")[1])
            weights = load_file(folder / "model.safetensors")
            assert weights and all(bool((tensor == step).all()) for tensor in weights.values())
            assert torch.load(folder / TRAINER_STATE, map_location="cpu")["step"] == step
    assert accepted > 0  # the kills came after some saves finished


def test_a_sharded_checkpoint_needs_every_ranks_manifest(tmp_path):
    """Each rank lists its own files; rank 0's manifest says how many ranks there were. A rank whose upload
    never arrived, or arrived from another step, makes the merged folder incomplete."""
    merged = tmp_path / "merged"
    for rank in range(3):
        own = tmp_path / f"rank{rank}"
        (own / "shards").mkdir(parents=True)
        (own / "shards" / f"__{rank}_0.distcp").write_bytes(os.urandom(64))
        write_manifest(own, 5, rank, world_size=3)
        shutil.copytree(own, merged, dirs_exist_ok=True)  # what Ray Train does with every rank's folder
    assert verify_checkpoint(merged) == 5
    stale = tmp_path / "stale"
    shutil.copytree(merged, stale)
    write_manifest(tmp_path / "rank2", 4, 2, world_size=3)
    shutil.copy(tmp_path / "rank2" / "checkpoint.rank2.json", stale)
    with pytest.raises(IncompleteCheckpoint, match="checkpoint.rank2.json is of step 4"):
        verify_checkpoint(stale)
    (merged / "checkpoint.rank1.json").unlink()
    with pytest.raises(IncompleteCheckpoint) as error:
        verify_checkpoint(merged)
    assert error.value.path == "checkpoint.rank1.json"
    (merged / "shards" / "__2_0.distcp").write_bytes(b"cut")
    write_manifest(tmp_path / "rank1", 5, 1, world_size=3)
    shutil.copy(tmp_path / "rank1" / "checkpoint.rank1.json", merged)
    with pytest.raises(IncompleteCheckpoint, match="shards/__2_0.distcp differs"):
        verify_checkpoint(merged)


def test_a_refused_newest_checkpoint_falls_back_to_the_previous_kept_one(whole, tmp_path):
    """What a worker group resumes from: Ray Train's latest checkpoint if it verifies, else the newest older
    one kept beside it; the steps it redoes are saved beside the refused folders, never into them (Ray Train
    deletes a refused one's folder when it prunes it). With none whole, the latest's refusal is raised."""
    kept = []
    for step in (3, 6, 9):
        kept.append(tmp_path / f"checkpoint_{step:06d}")
        shutil.copytree(whole, kept[-1])
        write_manifest(kept[-1], step)
    (tmp_path / "final").mkdir()  # not a checkpoint
    latest = ray.train.Checkpoint(str(kept[-1]))
    with newest_whole_checkpoint(latest) as (folder, refused):
        assert folder == kept[-1] and refused == {}
    for damaged in (kept[2], kept[1]):
        (damaged / TRAINER_STATE).write_bytes(b"cut")
    with newest_whole_checkpoint(latest) as (folder, refused):
        assert folder == kept[0]
        assert list(refused) == ["checkpoint_000009", "checkpoint_000006"]
        assert refused["checkpoint_000009"].path == TRAINER_STATE
    assert checkpoint_name(6, refused) == "checkpoint_000006.1"
    assert checkpoint_name(12, refused) == "checkpoint_000012"
    assert checkpoint_name(6, [*refused, "checkpoint_000006.1"]) == "checkpoint_000006.2"
    (kept[0] / MANIFEST).unlink()
    with pytest.raises(IncompleteCheckpoint) as error, newest_whole_checkpoint(latest):
        pass
    assert error.value.folder == kept[2]
    with newest_whole_checkpoint(None) as nothing:
        assert nothing == (None, {})
