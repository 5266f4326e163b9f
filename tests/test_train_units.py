"""Small pieces of the trainer that the end-to-end tests reach only indirectly."""
from __future__ import annotations

import os

import pytest

from train.errors import UserError
from train.recipe import checkpoint
from train.recipe.args import parse_args
from train.run.loop import epoch_order, step_groups, total_steps


def test_epoch_order_splits_rows_across_ranks_and_is_reproducible():
    orders = [epoch_order(10, seed=3, epoch=1, rank=r, world_size=4) for r in range(4)]
    assert {len(o) for o in orders} == {3}  # padded so every rank runs the same number of steps
    assert set().union(*orders) == set(range(10))
    assert orders[0] == epoch_order(10, seed=3, epoch=1, rank=0, world_size=4)
    assert orders[0] != epoch_order(10, seed=3, epoch=2, rank=0, world_size=4)


def test_step_groups_resume_mid_epoch_continues_the_same_sequence():
    args = parse_args(["--model_name_or_path", "m", "--per_device_train_batch_size", "2",
                       "--gradient_accumulation_steps", "2"])
    rows = [{"i": i} for i in range(10)]  # 5 batches an epoch: steps of 2, 2, 1 batches

    def ids(groups, n):
        return [([row["i"] for batch in group for row in batch], pos) for group, pos in (next(groups) for _ in range(n))]

    collate = lambda batch: batch  # noqa: E731
    whole = ids(step_groups(rows, collate, args, rank=0, world_size=1, epoch=0, batch=0), 5)
    assert [pos for _, pos in whole] == [(0, 2), (0, 4), (1, 0), (1, 2), (1, 4)]
    resumed = ids(step_groups(rows, collate, args, rank=0, world_size=1, epoch=0, batch=4), 3)
    assert resumed == whole[2:]
    assert total_steps(10, args, 1) == 3


def test_write_atomically_leaves_nothing_half_written(tmp_path):
    tmp_path.chmod(0o755)  # an output directory as users make it (pytest's own are 0700)
    def broken(path):
        open(os.path.join(path, "a"), "w").close()
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        checkpoint.write_atomically(str(tmp_path), "checkpoint-1", broken)
    assert os.listdir(tmp_path) == []

    for content in ("old", "new"):
        checkpoint.write_atomically(str(tmp_path), "checkpoint-1",
                                    lambda path, c=content: open(os.path.join(path, c), "w").close())
    assert os.listdir(tmp_path) == ["checkpoint-1"]
    assert os.listdir(tmp_path / "checkpoint-1") == ["new"]
    # readable as the output directory is, not mkdtemp's owner-only 0700
    assert os.stat(tmp_path / "checkpoint-1").st_mode & 0o777 == 0o755


def test_latest_checkpoint_is_the_highest_step(tmp_path):
    for step in (2, 10, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == [
        "checkpoint-2", "checkpoint-4", "checkpoint-10"]
    with pytest.raises(UserError, match="incomplete or corrupt"):  # empty directories are not checkpoints
        checkpoint.resolve("latest", str(tmp_path))


@pytest.mark.parametrize("kind,extra", [("linear", {}), ("dynamic", {}), ("yarn", {"original_max_position_embeddings": 128}),
                                        ("llama3", {"original_max_position_embeddings": 128, "low_freq_factor": 1.0})])
def test_rope_scaling_is_written_the_transformers_5_way(kind, extra):
    from transformers import LlamaConfig

    from train.recipe.rope import apply_rope_scaling

    config = LlamaConfig(max_position_embeddings=128)
    assert apply_rope_scaling(config, 512, kind, None) == 4.0
    assert config.rope_parameters["rope_type"] == kind and config.rope_parameters["factor"] == 4.0
    assert extra.items() <= config.rope_parameters.items()
    # dynamic NTK stretches relative to max_position_embeddings, so it must stay the original length
    assert config.max_position_embeddings == (128 if kind == "dynamic" else 512)
    config.validate_rope()


def test_block_size_flags_reach_the_patch():
    from tiny_models import tiny_model
    from train.recipe.model import patch

    args = parse_args(["--model_name_or_path", "m", "--norm_chunk", "24", "--mlp_chunk", "40"])
    handle = patch(tiny_model("llama"), args)
    assert (handle.options.norm_chunk, handle.options.mlp_chunk, handle.options.q_block) == (24, 40, 1024)
    with pytest.raises(UserError, match="--norm_chunk must be a positive integer"):
        parse_args(["--model_name_or_path", "m", "--norm_chunk", "0"])
