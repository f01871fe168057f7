"""What is wrong with a checkpoint's files, in plain words.

A TensorFlow checkpoint ``PREFIX`` is an index file ``PREFIX.index`` (a table
of every variable: which data file, where, how long) and data files
``PREFIX.data-<i>-of-<n>``. When one is missing or damaged, TensorFlow's
restore says ``Read less bytes than requested``, ``not an sstable (bad magic
number)`` or, for a deleted data file, "Restoring from checkpoint failed ...
a Variable name or other graph key that is missing", without the file.
`diagnose(prefix)` reads the files and says which one is wrong and how:
missing, not a checkpoint index, or shorter than the index says (a save that
did not finish, or a copy that was cut). `last_good(directory)` finds the
newest checkpoint of a directory that has nothing wrong, for the messages of
a failed restore or save (epl.runtime.run_errors).
"""
from __future__ import annotations

import glob
import os

import tensorflow as tf


def _reader(prefix: str):
    from tensorflow.python.training import py_checkpoint_reader
    return py_checkpoint_reader.NewCheckpointReader(prefix)


def _first_line(err: Exception) -> str:
    text = getattr(err, "message", None) or str(err)
    return text.strip().splitlines()[0] if text.strip() else type(err).__name__


def _data_files(prefix: str) -> list[str]:
    return sorted(glob.glob(glob.escape(prefix) + ".data-?????-of-?????"))


def diagnose(prefix: str) -> str | None:
    """What is wrong with checkpoint `prefix`, in words ("its data file X is missing"),
    or None when every file is there and every variable reads."""
    index = prefix + ".index"
    if not os.path.exists(index):
        return "its index file %s is missing (deleted, or the save did not finish)" % index
    try:
        reader = _reader(prefix)
    except Exception as err:  # noqa: BLE001 - TensorFlow's reader raises several kinds
        text = _first_line(err)
        if "too short" in text or "truncated" in text.lower():
            return ("its index file %s is cut short (%d bytes; TensorFlow: %s)"
                    % (index, os.path.getsize(index), text))
        return ("its index file %s is not a checkpoint index: it is damaged, or another "
                "file (TensorFlow: %s)" % (index, text))
    names = sorted(reader.get_variable_to_shape_map())
    data = _data_files(prefix)
    if names and not data:
        return "its data file %s.data-00000-of-... is missing (deleted?)" % prefix
    expected = {}
    for path in data:
        total = path.rsplit("-of-", 1)[1]
        expected.update({"%s.data-%05d-of-%s" % (prefix, i, total): True
                         for i in range(int(total))})
    missing = sorted(path for path in expected if not os.path.exists(path))
    if missing:
        return "its data file%s %s %s missing (deleted?)" % (
            "s" if len(missing) > 1 else "", ", ".join(missing), "are" if len(missing) > 1
            else "is")
    for name in names:
        try:
            reader.get_tensor(name)
        except Exception as err:  # noqa: BLE001 - OpError, IndexError, ValueError
            text = _first_line(err)
            sizes = ", ".join("%s (%d bytes)" % (path, os.path.getsize(path)) for path in data)
            if "less bytes" in text or isinstance(err, (IndexError, tf.errors.OutOfRangeError)):
                return ("its data file %s is shorter than its index says: variable %s lies "
                        "past its end (cut short: the save did not finish, or the file was "
                        "truncated; TensorFlow: %s)" % (sizes, name, text))
            return ("variable %s cannot be read from its data file %s (damaged; TensorFlow: "
                    "%s)" % (name, sizes, text))
    return None


def last_good(directory: str, skip: str | None = None) -> str | None:
    """The newest checkpoint of `directory` (as its ``checkpoint`` state file lists them)
    that `diagnose` finds nothing wrong with, other than `skip`; None if none."""
    try:
        state = tf.train.get_checkpoint_state(directory)
    except (tf.errors.OpError, ValueError):
        return None
    if state is None:
        return None
    paths = list(state.all_model_checkpoint_paths) or [state.model_checkpoint_path]
    if state.model_checkpoint_path and state.model_checkpoint_path not in paths:
        paths.append(state.model_checkpoint_path)
    for path in reversed(paths):  # get_checkpoint_state joined them with `directory`
        if os.path.normpath(path) != os.path.normpath(skip or "") and diagnose(path) is None:
            return path
    return None
