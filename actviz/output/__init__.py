"""The output side: a finished step from its devices to the host, the writer thread and the sinks.

* :mod:`~actviz.output.pending_step`: one step's reductions and picture sources, copied to the host in one
  copy per device;
* :mod:`~actviz.common.results`: what a step logs, on the host (:class:`Summary`, :class:`StepResults`);
* :mod:`~actviz.output.writer_thread`: :class:`Writer`, the writer half of a step's path (finish, diagnose,
  write, ``on_alert`` and ``on_step``) on one thread that is never waited on when it cannot answer, or at once
  with ``strict=True``;
* :mod:`~actviz.output.step_callbacks`: the user's ``on_alert`` and ``on_step``, called once their step is written;
* :mod:`~actviz.output.once_warnings`: the writer's warnings, each kind once;
* :mod:`~actviz.output.sink`: the ``Sink`` interface (``write``, ``flush``, ``close``) that
  ``watch(sink=...)`` accepts;
* :mod:`~actviz.output.tensorboard`: :class:`TensorBoardSink`, one sink, and the TensorBoard protobufs of one step;
* :mod:`~actviz.output.png`: the PNG bytes of the pictures, for the event files and the report.

Example:
    >>> from actviz.common.results import StepResults
    >>> StepResults(3, scalars={"loss": 0.5}).scalars
    {'loss': 0.5}
"""

from __future__ import annotations

__all__: list[str] = []
