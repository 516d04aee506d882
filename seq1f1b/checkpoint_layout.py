"""Where checkpoints live on disk, and how a finished one is published atomically.

Megatron's layout: `<save>/iter_0000100/` per checkpoint and `<save>/latest_checkpointed_iteration.txt`
holding the iteration of the newest complete one. A save writes into a hidden staging folder
(`.iter_0000100.incomplete`); only when every rank has finished writing does rank 0 rename it to its
final name and then rewrite the tracker (through a temporary file and `os.replace`). A save that is
interrupted at any point therefore leaves the tracker pointing at the last good checkpoint, and a
leftover staging folder is never read (the next save of that iteration removes it).

A converted model (tools/checkpoint/convert.py) is Megatron's *release* checkpoint: the tracker
holds `release` and the weights live in `<save>/release/`; it is resumed as iteration 0 with a fresh
optimizer (checkpointing.load_checkpoint).

Pure Python (no torch, no megatron-core): argument validation reads the tracker too.
"""
from __future__ import annotations

import os
import shutil
from typing import Optional

TRACKER_NAME = "latest_checkpointed_iteration.txt"
RELEASE = "release"


def iteration_dir(root: str, iteration: int) -> str:
    """The folder of the checkpoint taken after `iteration` iterations."""
    return os.path.join(root, f"iter_{iteration:07d}")


def staging_dir(root: str, iteration: int) -> str:
    """Where a save of `iteration` is written before it is published."""
    return os.path.join(root, f".iter_{iteration:07d}.incomplete")


def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER_NAME)


def release_dir(root: str) -> str:
    """The folder of a release checkpoint (a converted model)."""
    return os.path.join(root, RELEASE)


def _tracker_text(root: str) -> Optional[str]:
    path = tracker_path(root)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as stream:
        return stream.read().strip()


def is_release(root: str) -> bool:
    """Whether the tracker under `root` names a release checkpoint."""
    return _tracker_text(root) == RELEASE


def read_tracker(root: str, flag: str = "--load") -> Optional[int]:
    """The iteration of the newest complete checkpoint under `root` (0 for a release checkpoint),
    or None when there is none.

    Raises ValueError (one line naming `flag`) for a tracker that holds neither an iteration
    number nor `release`, or that points at a missing checkpoint folder.
    """
    text = _tracker_text(root)
    if text is None:
        return None
    path = tracker_path(root)
    if text == RELEASE:
        if not os.path.isdir(release_dir(root)):
            raise ValueError(f"{flag}: {path} names the release checkpoint, but "
                             f"{release_dir(root)} does not exist")
        return 0
    if not text.isdigit():
        raise ValueError(f"{flag}: {path} should hold an iteration number or {RELEASE!r}, "
                         f"not {text[:40]!r}")
    iteration = int(text)
    if not os.path.isdir(iteration_dir(root, iteration)):
        raise ValueError(f"{flag}: {path} names iteration {iteration}, but "
                         f"{iteration_dir(root, iteration)} does not exist")
    return iteration


def latest_dir(root: str, flag: str = "--load") -> Optional[str]:
    """The folder of the checkpoint the tracker under `root` names (release or iteration), or
    None when there is none; errors as `read_tracker`."""
    iteration = read_tracker(root, flag)
    if iteration is None:
        return None
    return release_dir(root) if is_release(root) else iteration_dir(root, iteration)


def prepare_staging(root: str, iteration: int) -> str:
    """An empty staging folder for `iteration` (a leftover from an interrupted save is removed)."""
    path = staging_dir(root, iteration)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def _write_atomically(path: str, text: str) -> None:
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, path)


def publish_release(root: str, staged: str) -> str:
    """Rename the finished folder `staged` (under `root`) to `<root>/release` and point the
    tracker at it; returns the folder. `root` must hold no checkpoint yet (the caller checks)."""
    final = release_dir(root)
    os.replace(staged, final)
    _write_atomically(tracker_path(root), f"{RELEASE}\n")
    return final


def publish(root: str, iteration: int) -> str:
    """Give the staged checkpoint its final name, then point the tracker at it; returns the folder.

    An older checkpoint of the same iteration (a run restarted from an earlier one) is moved aside
    first and deleted only after the new one is in place; between those two renames the tracker
    names a folder that is briefly absent, the one window in which an interruption needs a hand
    (rename `iter_N.replaced-PID` back).
    """
    final = iteration_dir(root, iteration)
    replaced = None
    if os.path.exists(final):
        replaced = f"{final}.replaced-{os.getpid()}"
        os.replace(final, replaced)
    os.replace(staging_dir(root, iteration), final)
    _write_atomically(tracker_path(root), f"{iteration}\n")
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return final
