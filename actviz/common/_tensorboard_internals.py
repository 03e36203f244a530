"""Every private TensorBoard API actviz uses, each behind one small function (those of PyTorch and torchvision are
in :mod:`actviz.common._internals`).

Each function says why the public API is not enough, and ``tests/test_internals.py`` checks each assumption, so
that a TensorBoard release that changes one fails the suite loudly instead of changing what actviz writes.

=====================================  ===========================================
function                               private API
=====================================  ===========================================
:func:`event_file_writer`              ``SummaryWriter._get_file_writer``
:func:`replace_record_checksum`        ``tensorboard...record_writer.masked_crc32c``
:func:`replace_event_records`          ``EventFileWriter._async_writer``, ``._file_name``
:func:`scalar_arrays`                  ``GrpcDataProvider._stub``, ``data_provider_pb2``
=====================================  ===========================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["event_file_writer", "replace_event_records", "replace_record_checksum", "scalar_arrays"]


def event_file_writer(writer: Any) -> Any:
    """The ``FileWriter`` behind a ``torch.utils.tensorboard.SummaryWriter``.

    Why private: ``SummaryWriter``'s public ``add_*`` methods write one event per value
    and re-encode images; only its file writer's ``add_summary`` takes one ``Summary``
    proto with all of a step's values (what TensorFlow's merged summaries write).
    """
    return writer._get_file_writer()


def replace_record_checksum(fast: Callable[[bytes], int]) -> bool:
    """Make TensorBoard's event writer checksum every record with ``fast``, for the whole process.

    Why private: without TensorFlow, TensorBoard computes each record's masked CRC-32C in
    pure Python, through its ``record_writer`` module's global ``masked_crc32c``; there
    is no public way to give it a faster one. ``fast`` is tried on a probe first and must
    give TensorBoard's value; the module is changed only by the last statement, so an
    error anywhere leaves it as it was. Idempotent. Callers catch the errors
    (:func:`actviz.output.tensorboard.use_fast_crc`).

    Raises:
        ValueError: ``fast`` gives another checksum than TensorBoard's.
        ImportError, AttributeError: TensorBoard moved or renamed it.
    """
    from tensorboard.summary.writer import record_writer

    current = record_writer.masked_crc32c
    if getattr(current, "actviz_fast_crc", False):
        return True
    probe = b"actviz compares the checksums before it swaps them"
    if fast(probe) != current(probe):
        raise ValueError(f"the fast checksum gives {fast(probe)}, TensorBoard's {current(probe)}")
    fast.actviz_fast_crc = True  # type: ignore[attr-defined]
    record_writer.masked_crc32c = fast
    return True


def replace_event_records(file_writer: Any, wrap: Callable[[Any, str], Any]) -> Any:
    """Make the thread of ``file_writer`` (a ``SummaryWriter``'s ``FileWriter``) write its event file through
    ``wrap(records, path)`` instead of its record writer ``records``; return what ``wrap`` returned.

    Why private: TensorBoard's ``EventFileWriter`` writes on its own thread (``_async_writer``), which a failed
    write (a full disk) ends for good, with a traceback; no public API gives its record writer or its file's name.
    The thread reads its record writer at each record, so the swap takes effect at the next one.

    Raises:
        AttributeError: TensorBoard moved what is replaced.
        ValueError: The thread has ended already (a write failed before).
    """
    event_writer = file_writer.event_writer
    async_writer = event_writer._async_writer
    thread = async_writer._worker
    records = thread._record_writer
    if async_writer._writer is not records:
        raise AttributeError("the EventFileWriter's thread writes through another record writer than its own")
    if thread.exception is not None or not thread.is_alive():
        raise ValueError(f"the thread writing {event_writer._file_name} has ended: {thread.exception!r}")
    wrapped = wrap(records, event_writer._file_name)
    async_writer._writer = thread._record_writer = wrapped
    return wrapped


def scalar_arrays(provider: Any, experiment_id: str, run: str, tags: Sequence[str],
                  points: int) -> dict[str, tuple[Any, Any]] | None:
    """``{tag: (steps, values)}`` (int64 and float64 numpy arrays) of one run's scalar ``tags``, as TensorBoard's gRPC
    data provider's ``read_scalars(..., downsample=points)`` would give them; ``None`` for any other provider.

    Why private: ``GrpcDataProvider.read_scalars`` (what ``tensorboard --logdir`` serves through its data server)
    builds one Python ``ScalarDatum`` per point, about 15 times as long as the data server's answer takes (0.6 s
    for 400,000 points on a 2-core CPU); its stub's ``ReadScalars`` answer holds each tag's steps and values as
    packed arrays, which numpy takes at once. Anything unexpected gives ``None``, and the caller reads with the
    public ``read_scalars``.
    """
    try:
        import grpc
        from tensorboard.data import grpc_provider
        from tensorboard.data.proto import data_provider_pb2
    except ImportError:
        return None
    if not isinstance(provider, grpc_provider.GrpcDataProvider):
        return None
    try:
        request = data_provider_pb2.ReadScalarsRequest(experiment_id=experiment_id)
        request.plugin_filter.plugin_name = "scalars"
        request.run_tag_filter.runs.names.append(run)
        request.run_tag_filter.tags.names.extend(tags)
        request.downsample.num_points = points
        response = provider._stub.ReadScalars(request)
    except (AttributeError, TypeError, ValueError, grpc.RpcError):  # the public read then raises TensorBoard's error
        return None
    import numpy as np

    found: dict[str, tuple[Any, Any]] = {}
    for run_entry in response.runs:
        if run_entry.run_name == run:
            for tag_entry in run_entry.tags:
                found[tag_entry.tag_name] = (np.array(tag_entry.data.step, dtype=np.int64),
                                             np.array(tag_entry.data.value, dtype=np.float64))
    return found
