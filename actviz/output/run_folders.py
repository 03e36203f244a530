"""Run folders shared by mistake: a log_dir that already holds a run, and two watchers writing the same tags.

TensorBoard reads every event file of a folder as one run. A second run into the same
``log_dir`` therefore shows its steps interleaved with the first's (0, 5, 0, 5), and two
watched models on one ``SummaryWriter`` (or one folder) that share layer or parameter
names write the same tags, so their points mix on one curve. Neither is an error, and
neither is visible until TensorBoard shows nonsense, so :func:`actviz.watch` warns once
for each, with the fix: a folder per run and per model.
"""

from __future__ import annotations

import os
import struct
import weakref
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event

from ..common.safe_warnings import warn_safely

__all__ = ["earlier_runs", "warn_if_reused", "warn_if_shared"]

#: Records read per event file: a file with steps has its first summary right after its version header.
_RECORDS_READ = 4

# Open watchers by the real path of the folder they write to: (watcher, model name).
_writing: dict[str, list[tuple[weakref.ref[Any], str]]] = {}


def earlier_runs(folder: str | os.PathLike[str]) -> list[Path]:
    """The event files in ``folder`` that hold logged values (not only the header a new writer puts first).

    Example:
        >>> import tempfile
        >>> from torch.utils.tensorboard import SummaryWriter
        >>> folder = tempfile.mkdtemp()
        >>> SummaryWriter(folder).close()  # a header, no step
        >>> earlier_runs(folder)
        []
        >>> with SummaryWriter(folder) as writer:
        ...     writer.add_scalar("loss", 1.0, 0)
        >>> len(earlier_runs(folder))
        1
    """
    path = Path(folder)
    if not path.is_dir():
        return []
    return sorted(file for file in path.glob("events.out.tfevents.*") if _has_values(file))


def _has_values(file: Path) -> bool:
    try:
        with file.open("rb") as stream:
            for _ in range(_RECORDS_READ):
                header = stream.read(12)  # length (uint64), its masked CRC (uint32)
                if len(header) < 12:
                    return False
                (length,) = struct.unpack("<Q", header[:8])
                data = stream.read(length)
                stream.read(4)  # the data's CRC
                if len(data) < length:
                    return False
                event = Event.FromString(data)
                if event.HasField("summary") and event.summary.value:
                    return True
    except Exception:  # noqa: BLE001 - an unreadable file is not ours to judge
        return False
    return False


def warn_if_reused(log_dir: str | os.PathLike[str]) -> None:
    """Warn if ``log_dir`` already holds a run's values and no open watcher writes there now."""
    if _live(os.path.realpath(log_dir)):
        return  # a watcher writing there now: warn_if_shared says what matters
    files = earlier_runs(log_dir)
    if files:
        warn_safely(
            f"actviz: log_dir '{log_dir}' already holds the events of an earlier run ({len(files)} file(s) with "
            f"logged steps, e.g. {files[0].name}). TensorBoard reads a folder as one run, so this run's steps will "
            "interleave with the earlier ones (0, 5, 0, 5). Give each run its own folder (runs/exp-2, or a date "
            "in the name), or delete the old event files first.",
            RuntimeWarning,
            stacklevel=3,
        )


def warn_if_shared(log_dir: str | os.PathLike[str], watcher: Any, model_name: str) -> None:
    """Note ``watcher`` as writing to ``log_dir``, and warn if an open watcher there writes tags it writes too."""
    key = os.path.realpath(log_dir)
    for other_key in list(_writing):  # forget closed watchers everywhere: a sweep opens many folders
        _live(other_key)
    tags = _tags(watcher)
    for other, other_name in _live(key):
        shared = sorted(tags & _tags(other))
        if shared:
            examples = ", ".join(shared[:3]) + (", ..." if len(shared) > 3 else "")
            others = f"another {other_name}" if other_name == model_name else f"a {other_name}"
            warn_safely(
                f"actviz: this {model_name} and {others} are both watched into '{log_dir}' and write the same "
                f"tags ({examples}; {len(shared)} in all), so TensorBoard mixes their values on one curve (two "
                f"points per step). Give each model its own log_dir ('{Path(log_dir) / 'a'}' and "
                f"'{Path(log_dir) / 'b'}': TensorBoard shows them as two runs side by side) or its own SummaryWriter.",
                RuntimeWarning,
                stacklevel=3,
            )
            break
    _writing[key] = [(weakref.ref(other), name) for other, name in _live(key)] + [(weakref.ref(watcher), model_name)]


def _live(key: str) -> list[tuple[Any, str]]:
    """The watchers still open on folder ``key``, as (watcher, model name) pairs; the closed ones are forgotten."""
    entries = [(ref(), name) for ref, name in _writing.pop(key, [])]
    entries = [(watcher, name) for watcher, name in entries if watcher is not None and not watcher.closed]
    if entries:
        _writing[key] = [(weakref.ref(watcher), name) for watcher, name in entries]
    return entries


def _tags(watcher: Any) -> set[str]:
    layers = {f"activations/{name}" for name in watcher.layer_names}
    return layers | {f"weights/{name}" for name in watcher.parameter_names}
