"""Output paths checked before any work starts: a folder a run writes into, or a file it writes.

A run that can write its outputs only finds out at the first save, the first TensorBoard scalar
or after the whole benchmark; these checks find it while the flags are validated. They leave no
trace: whether the user may create files in a folder is probed with an anonymous temporary file
(the permission bits alone do not tell, e.g. for root or a read-only mount).
"""
from __future__ import annotations

import os
import tempfile
from typing import Optional


def _nearest_existing(path: str) -> str:
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return folder


def _can_create_in(folder: str) -> bool:
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def _check_given(path: str, flag: str) -> None:
    """An empty path is a mistake (an unset shell variable), not "the current folder": every
    path function resolves "" to the working directory, so the outputs would land there."""
    if not path:
        raise ValueError(f"{flag}: empty path; name the output (an empty value is not taken as "
                         f"the current folder)")


def check_output_dir(path: str, flag: str) -> None:
    """`path` is a folder this user can write into, or one it can create (with its parents).

    Raises ValueError, one line naming `flag`.
    """
    _check_given(path, flag)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag}: {path} exists and is not a directory")
    folder = _nearest_existing(path)
    if not os.path.isdir(folder):
        raise ValueError(f"{flag}: {path} cannot be created: {folder} is not a directory")
    if not _can_create_in(folder):
        what = "is not writable" if folder == os.path.abspath(path) else \
            f"cannot be created: {folder} is not writable"
        raise ValueError(f"{flag}: {path} {what}")


def check_output_file(path: str, flag: str, suffix: Optional[str] = None,
                      makes_folders: bool = False) -> None:
    """`path` names a file this user can write: not a folder, ending in `suffix` when given, in
    an existing writable folder (or a creatable one with `makes_folders`).

    Raises ValueError, one line naming `flag`.
    """
    _check_given(path, flag)
    if suffix is not None and not path.endswith(suffix):
        raise ValueError(f"{flag} {path}: name a {suffix} file")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory; name a file")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ValueError(f"{flag}: {path} is not writable")
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not makes_folders and not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
    check_output_dir(folder, flag)


def check_output_prefix(prefix: str, flag: str) -> None:
    """`prefix` begins the names of files a run writes (`<prefix>_<key>.bin`) in an existing
    writable folder.

    A prefix that is empty or ends in a separator names no file, only a folder: the files would
    come out as `_<key>.bin` in it (hidden, or in the current folder), so it is refused rather
    than reinterpreted. Raises ValueError, one line naming `flag`.
    """
    _check_given(prefix, flag)
    separators = os.sep + (os.altsep or "")
    if prefix.endswith(tuple(separators)) or os.path.basename(prefix) in (".", ".."):
        raise ValueError(f"{flag} {prefix}: names a folder, not the beginning of file names "
                         f"(e.g. {os.path.join(prefix, 'corpus')})")
    folder = os.path.dirname(os.path.abspath(prefix))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag}: directory {folder} does not exist")
    check_output_dir(folder, flag)
