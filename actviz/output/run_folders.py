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
import stat
import struct
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event

from ..common.safe_warnings import warn_safely

__all__ = ["DamagedEventFile", "check_name_lengths", "earlier_runs", "is_event_file", "read_records", "warn_if_reused", "warn_if_shared"]

EVENT_FILE_PREFIX = "events.out.tfevents."

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
    return sorted(file for file in path.glob(EVENT_FILE_PREFIX + "*") if is_event_file(file) and _has_values(file))


def is_event_file(path: str | os.PathLike[str]) -> bool:
    """True for a regular file named like an event file: a FIFO, a folder or a device so named is not one
    (opening a FIFO waits for a writer that may never come)."""
    try:
        return Path(path).name.startswith(EVENT_FILE_PREFIX) and stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


class DamagedEventFile(Exception):
    """An event file that stops being a well-formed TFRecord stream at byte ``offset``: ``reason`` says how."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"{reason} at byte {offset}")
        self.offset, self.reason = offset, reason


def read_records(file: str | os.PathLike[str]) -> Iterator[bytes]:
    """The records of an event file, each checked; raises :class:`DamagedEventFile` where one is not whole.

    A TFRecord is an 8-byte little-endian length, the masked CRC-32C of those 8 bytes, the data and
    the masked CRC-32C of the data. Both checksums are verified (TensorBoard's reader may stop at a
    bad record without a word), and a length is believed only up to the bytes the file has left.
    Only a regular file is opened (:func:`is_event_file`).

    Example:
        >>> import tempfile
        >>> from torch.utils.tensorboard import SummaryWriter
        >>> with SummaryWriter(folder := tempfile.mkdtemp()) as writer:
        ...     writer.add_scalar("loss", 1.0, 0)
        >>> len(list(read_records(next(Path(folder).iterdir()))))  # the version header, the scalar
        2
    """
    if not is_event_file(file):
        raise DamagedEventFile(0, "not a regular file")
    crc = _masked_crc()
    with open(file, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        offset = 0
        while offset < size:
            header = stream.read(12)
            if len(header) < 12:
                raise DamagedEventFile(offset, f"a record header cut short ({len(header)} of 12 bytes)")
            length, length_crc = struct.unpack("<QI", header)
            if crc(header[:8]) != length_crc:
                raise DamagedEventFile(offset, "a record length whose checksum does not match")
            if length > size - offset - 16:
                raise DamagedEventFile(offset, f"a record claiming {length} bytes, more than the "
                                               f"{max(size - offset - 16, 0)} the file has left")
            data = stream.read(length)
            (data_crc,) = struct.unpack("<I", stream.read(4))
            if crc(data) != data_crc:
                raise DamagedEventFile(offset, "a record whose data checksum does not match")
            yield data
            offset += length + 16


def _masked_crc() -> Callable[[bytes], int]:
    """TFRecord's masked CRC-32C, from C when the ``crc32c`` package is there (as actviz writes), else TensorBoard's."""
    try:
        import crc32c

        from .tensorboard import _masked_crc32c

        return _masked_crc32c(crc32c.crc32c)
    except ImportError:
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

        return masked_crc32c


def _has_values(file: Path) -> bool:
    try:
        for count, data in enumerate(read_records(file)):
            event = Event.FromString(data)
            if event.HasField("summary") and event.summary.value:
                return True
            if count + 1 >= _RECORDS_READ:
                return False
    except Exception:  # noqa: BLE001 - an unreadable or damaged file is not ours to judge here: actviz doctor does
        return False
    return False


#: The longest file or folder name most file systems take, in bytes (ext4, XFS, APFS, NTFS: 255).
NAME_MAX = 255


def check_name_lengths(log_dir: str) -> None:
    """Raise a ``ValueError`` naming the limit where a folder name of ``log_dir`` is longer than the file system
    takes (``NAME_MAX``, from the nearest existing folder, else :data:`NAME_MAX`), instead of the ``OSError``
    ``File name too long`` that creating it, or checking it, would raise.

    Example:
        >>> check_name_lengths("runs/" + "a" * 300)
        Traceback (most recent call last):
        ...
        ValueError: log_dir has a folder name of 300 bytes ('aaa...'...), over the 255 bytes a file name may have here (NAME_MAX); ...
    """
    parts = Path(log_dir).parts
    for part in parts:
        size = len(part.encode("utf-8", "surrogateescape"))
        if size <= NAME_MAX:
            continue
        limit = _name_max(log_dir)
        if size > limit:
            raise ValueError(f"log_dir has a folder name of {size} bytes ({part[:24]!r}{'...' if len(part) > 24 else ''}"
                             f"), over the {limit} bytes a file name may have here (NAME_MAX); give a shorter name, "
                             "for example log_dir='runs/exp1'")


def _name_max(log_dir: str) -> int:
    """``NAME_MAX`` of the file system of ``log_dir``'s nearest existing folder, else :data:`NAME_MAX`."""
    folder = Path(log_dir).absolute()
    while True:
        try:
            if folder.is_dir():
                return int(os.pathconf(folder, "PC_NAME_MAX"))
        except (OSError, ValueError, AttributeError):  # no pathconf (Windows), a name too long to look at
            pass
        if folder.parent == folder:
            return NAME_MAX
        folder = folder.parent


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
