"""TensorBoard's own fast loader for ``actviz export`` and ``actviz.show``: its data server, started for one read.

``tensorboard --logdir`` reads event files with the data server of the ``tensorboard-data-server`` package (Rust,
installed with TensorBoard) and serves its tabs through a gRPC data provider. :func:`data_server_provider` starts
that server on a folder once (``--reload=once``), waits until its log says the load is done, and yields the same
provider the actviz tab reads through; the server ends when the block does (it exits when its stdin closes).
TensorBoard's Python loader reads about 10,000 scalars a second; the data server reads millions.

Example:
    >>> with data_server_provider("runs/exp1") as provider:  # doctest: +SKIP
    ...     sorted(provider.list_scalars(None, experiment_id="", plugin_name="scalars"))
    ['.']
    >>> issubclass(DataServerUnavailable, RuntimeError)  # then actviz reads with the Python loader
    True
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["DataServerUnavailable", "data_server_provider"]

#: How long what the server serves must stay the same before the folder counts as read, and how often it is asked.
SETTLED_SECONDS, POLL_SECONDS = 1.5, 0.5
_START_SECONDS = 30.0


class DataServerUnavailable(RuntimeError):
    """The data server is not installed for this platform, or did not start."""


@contextlib.contextmanager
def data_server_provider(folder: str | os.PathLike[str], samples: dict[str, int] | None = None) -> Iterator[Any]:
    """TensorBoard's gRPC data provider over ``folder``, read once by its data server (module docstring).

    Raises:
        DataServerUnavailable: No data server binary, or it did not start; read with the Python loader instead.
    """
    try:
        import grpc
        from tensorboard.data import grpc_provider, server_ingester

        binary = server_ingester.get_server_binary()
        make_stub = grpc_provider.make_stub
    except (ImportError, AttributeError, RuntimeError) as error:  # no server for this platform, or an older API
        raise DataServerUnavailable(f"{type(error).__name__}: {error}") from None
    with tempfile.TemporaryDirectory(prefix="actviz-data-server-") as scratch:
        port_file = Path(scratch) / "port"
        hints = ",".join(f"{kind}={'all' if count == 0 else count}" for kind, count in (samples or {}).items())
        log = (Path(scratch) / "log").open("wb")
        try:
            server = subprocess.Popen(
                [binary.path, f"--logdir={os.fspath(folder)}", "--reload=once", f"--samples-per-plugin={hints}",
                 "--port=0", f"--port-file={port_file}", "--die-after-stdin", "--verbose"],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log)
        except OSError as error:  # not executable here
            log.close()
            raise DataServerUnavailable(f"TensorBoard's data server cannot run: {error}") from None
        try:
            deadline = time.monotonic() + _START_SECONDS
            while not (port_file.exists() and port_file.read_text().endswith("\n")):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise DataServerUnavailable(f"TensorBoard's data server did not start ({binary.path})")
                time.sleep(0.05)
            channel = grpc.insecure_channel(f"localhost:{int(port_file.read_text())}",
                                            options=[("grpc.max_receive_message_length", 1 << 28)])
            provider = grpc_provider.GrpcDataProvider(f"localhost:{int(port_file.read_text())}",
                                                      make_stub(channel))
            _wait_until_read(provider, Path(scratch) / "log", server)
            yield provider
            channel.close()
        finally:
            if server.stdin is not None:
                server.stdin.close()  # --die-after-stdin
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=10)
            log.close()


def _wait_until_read(provider: Any, log: Path, server: subprocess.Popen) -> None:
    """Until the server's log says its one load is done ("Finished load cycle", rustboard 0.7); a server whose log
    never names a load cycle is read once what it serves has stayed the same for :data:`SETTLED_SECONDS`."""
    started = time.monotonic()
    while server.poll() is None:
        said = log.read_text(errors="replace")
        if "Finished load cycle" in said:
            return
        if "load cycle" not in said and time.monotonic() - started > _START_SECONDS:
            break
        time.sleep(0.05)
    if server.poll() is not None:
        raise DataServerUnavailable(f"TensorBoard's data server stopped while reading: {log.read_text()[-500:]}")
    from tensorboard.context import RequestContext

    context = RequestContext()

    def served() -> tuple:
        found = []
        for kind, method in (("scalars", "list_scalars"), ("histograms", "list_tensors"), ("text", "list_tensors"),
                             ("images", "list_blob_sequences")):
            listed = getattr(provider, method)(context, experiment_id="", plugin_name=kind)
            found.append(tuple(sorted((run, tag, series.max_step) for run, tags in listed.items()
                                      for tag, series in tags.items())))
        return tuple(found)

    last, since = served(), time.monotonic()
    while time.monotonic() - since < SETTLED_SECONDS:
        time.sleep(POLL_SECONDS)
        now = served()
        if now != last:
            last, since = now, time.monotonic()
