"""An event file that a failed write (a full disk) leaves whole, and that is written again once writing works.

TensorBoard's ``EventFileWriter`` writes records on a thread of its own, through a record writer
(``tensorboard.summary.writer.record_writer.RecordWriter``). Alone, the first write that fails there (``ENOSPC``,
``EFBIG``, ``EIO``) ends that thread with a traceback on stderr, may leave half a record at the end of the file,
and nothing is written to the file again, even once there is room. :class:`WholeRecords` takes the record
writer's place (:func:`guard_records`) and, on an ``OSError``:

* cuts the file back to its size before the record, so that it ends with a whole record (what TensorBoard and
  ``actviz doctor`` read stays valid);
* counts the record in :attr:`WholeRecords.failures`, keeps the error, and returns: the thread goes on;
* writes the next record as usual: once there is room again, it is in the file, after the last whole one.

A file that cannot be cut back (the cut fails too) is not written to again: a record after half a record
would make what follows unreadable. Every later record then counts as failed. The sink that writes a
watcher's steps (:class:`~actviz.output.tensorboard.TensorBoardSink`) reads :attr:`~WholeRecords.failures`
after each step and tells its writer which steps are not on disk.

Example:
    >>> import errno, os, tempfile
    >>> class FullAfter:  # a file that takes 20 bytes, then fails as a full disk does
    ...     def __init__(self, path): self.path = path
    ...     def write(self, data):
    ...         with open(self.path, "ab") as file:
    ...             file.write(data[:max(0, 20 - os.path.getsize(self.path))])
    ...         if os.path.getsize(self.path) >= 20:
    ...             raise OSError(errno.ENOSPC, "No space left on device")
    ...     def flush(self): pass
    ...     def close(self): pass
    >>> path = os.path.join(tempfile.mkdtemp(), "events")
    >>> records = WholeRecords(FullAfter(path), path)
    >>> open(path, "wb").close(); records.write(b"0123456789")
    >>> records.write(b"abcdefghijklmnop")  # 10 of its 16 bytes fit: cut back to the 10 before
    >>> os.path.getsize(path), records.failures, records.error.errno == errno.ENOSPC
    (10, 1, True)
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ..common._tensorboard_internals import replace_event_records

__all__ = ["WholeRecords", "guard_records"]

logger = logging.getLogger(__name__)


class WholeRecords:
    """A record writer in front of TensorBoard's: a failed write leaves the file whole and the thread running.

    Args:
        records: The record writer it stands in for: ``write(data)``, ``flush()``, ``close()``.
        path: The event file ``records`` appends to, cut back after a failed write.
    """

    actviz_whole_records = True  # what guard_records() looks for: it wraps a record writer once

    def __init__(self, records: Any, path: str) -> None:
        self.records = records
        self.path = path
        self.failures = 0  # records not written, from the start
        self.error: OSError | None = None  # the latest failure
        self.damaged = False  # a failed write left bytes that could not be cut off: nothing more is appended
        self._lock = threading.Lock()  # failures and error are read from another thread

    def write(self, data: bytes) -> None:
        """Append one record, or count it as failed and leave the file as it was."""
        if self.damaged:
            self._failed(self.error or OSError("the event file could not be cut back to whole records"))
            return
        size: int | None = None
        try:
            size = os.path.getsize(self.path)
            self.records.write(data)
        except OSError as error:
            if size is not None:
                self._cut_back(size)
            self._failed(error)

    def flush(self) -> None:
        self._guarded("flush", self.records.flush)

    def close(self) -> None:
        self._guarded("close", self.records.close)

    @property
    def closed(self) -> bool:
        return bool(getattr(self.records, "closed", False))

    def _guarded(self, what: str, call: Any) -> None:
        try:
            call()
        except OSError as error:  # local files: the writes are done already; the error is the disk's
            with self._lock:
                self.error = error
            logger.debug("the event file %s failed to %s", self.path, what, exc_info=True)

    def _cut_back(self, size: int) -> None:
        try:
            if os.path.getsize(self.path) > size:
                os.truncate(self.path, size)
        except OSError:
            self.damaged = os.path.exists(self.path)  # a file that is gone holds no half record
            logger.debug("the event file %s could not be cut back to %d bytes", self.path, size, exc_info=True)

    def _failed(self, error: OSError) -> None:
        with self._lock:
            self.failures += 1
            self.error = error
        logger.debug("a record of %s was not written", self.path, exc_info=error)

    def state(self) -> tuple[int, OSError | None]:
        """``(failures, error)`` read together."""
        with self._lock:
            return self.failures, self.error


def guard_records(file_writer: Any) -> WholeRecords | None:
    """Put a :class:`WholeRecords` in front of the record writer of ``file_writer`` (a ``SummaryWriter``'s
    ``FileWriter``), once; return it, or ``None`` where it cannot (a remote folder, a writer whose thread has
    ended already, a TensorBoard that moved what it replaces: logged at DEBUG level). Never raises."""
    try:
        guard = replace_event_records(file_writer, _wrap)
    except Exception:  # fail safe: the writer is left as it was
        logger.debug("TensorBoard's event file is written without actviz's guard", exc_info=True)
        return None
    return guard if isinstance(guard, WholeRecords) else None


def _wrap(records: Any, path: str) -> Any:
    if getattr(records, "actviz_whole_records", False):
        return records
    if not os.path.isfile(path):  # a remote folder (s3://, gs://): no size to cut back to
        raise ValueError(f"{path} is not a local file")
    return WholeRecords(records, path)
