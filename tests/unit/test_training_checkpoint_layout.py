"""Checkpoint folders and the tracker: a save becomes visible only when published, an interrupted
save never replaces the last good checkpoint, and a bad tracker is reported naming --load."""
import os

import pytest

from seq1f1b import checkpoint_layout as layout


def _stage(root, iteration, payload="weights"):
    folder = layout.prepare_staging(str(root), iteration)
    with open(os.path.join(folder, "shard"), "w") as stream:
        stream.write(payload)
    return folder


def _shard(root, iteration):
    with open(os.path.join(layout.iteration_dir(str(root), iteration), "shard")) as stream:
        return stream.read()


def test_megatron_names():
    assert layout.iteration_dir("run", 42) == os.path.join("run", "iter_0000042")
    assert layout.TRACKER_NAME == "latest_checkpointed_iteration.txt"


def test_no_tracker_means_no_checkpoint(tmp_path):
    assert layout.read_tracker(str(tmp_path)) is None


def test_publish_renames_then_points_the_tracker(tmp_path):
    _stage(tmp_path, 10)
    assert layout.read_tracker(str(tmp_path)) is None          # staged is not visible
    final = layout.publish(str(tmp_path), 10)
    assert final == layout.iteration_dir(str(tmp_path), 10)
    assert layout.read_tracker(str(tmp_path)) == 10
    assert not os.path.exists(layout.staging_dir(str(tmp_path), 10))
    assert (tmp_path / layout.TRACKER_NAME).read_text() == "10\n"


def test_interrupted_save_leaves_the_last_good_checkpoint(tmp_path):
    _stage(tmp_path, 10)
    layout.publish(str(tmp_path), 10)
    _stage(tmp_path, 20, payload="half written")                # the save dies here
    assert layout.read_tracker(str(tmp_path)) == 10
    assert _shard(tmp_path, 10) == "weights"
    _stage(tmp_path, 20, payload="complete")                    # the next save of 20 starts over
    layout.publish(str(tmp_path), 20)
    assert layout.read_tracker(str(tmp_path)) == 20 and _shard(tmp_path, 20) == "complete"
    assert _shard(tmp_path, 10) == "weights"                    # older checkpoints are kept


def test_saving_an_existing_iteration_again_replaces_it(tmp_path):
    _stage(tmp_path, 10, payload="first")
    layout.publish(str(tmp_path), 10)
    _stage(tmp_path, 10, payload="second")
    layout.publish(str(tmp_path), 10)
    assert _shard(tmp_path, 10) == "second"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000010", layout.TRACKER_NAME]


@pytest.mark.parametrize("text", ["", "-3", "1e3", "releases"])
def test_tracker_without_an_iteration_number_is_rejected(tmp_path, text):
    (tmp_path / layout.TRACKER_NAME).write_text(text)
    with pytest.raises(ValueError, match="^--load: .* should hold an iteration number"):
        layout.read_tracker(str(tmp_path))


def test_tracker_naming_a_missing_folder_is_rejected(tmp_path):
    (tmp_path / layout.TRACKER_NAME).write_text("7\n")
    with pytest.raises(ValueError, match="^--load: .*iteration 7.*does not exist"):
        layout.read_tracker(str(tmp_path))


def test_release_checkpoint_is_iteration_0_in_its_own_folder(tmp_path):
    """A converted model: tracker `release`, folder `release/` (Megatron's convention)."""
    (tmp_path / layout.TRACKER_NAME).write_text("release\n")
    with pytest.raises(ValueError, match="^--load: .*release checkpoint.*does not exist"):
        layout.read_tracker(str(tmp_path))
    (tmp_path / layout.TRACKER_NAME).unlink()
    staged = tmp_path / ".release.incomplete-1"
    staged.mkdir()
    (staged / "shard").write_text("weights")
    assert layout.publish_release(str(tmp_path), str(staged)) == layout.release_dir(str(tmp_path))
    assert layout.read_tracker(str(tmp_path)) == 0 and layout.is_release(str(tmp_path))
    assert layout.latest_dir(str(tmp_path)) == str(tmp_path / "release")
    assert (tmp_path / "release" / "shard").read_text() == "weights"
    _stage(tmp_path, 3)
    layout.publish(str(tmp_path), 3)     # training saves next to it: the iteration wins
    assert not layout.is_release(str(tmp_path))
    assert layout.latest_dir(str(tmp_path)) == layout.iteration_dir(str(tmp_path), 3)
