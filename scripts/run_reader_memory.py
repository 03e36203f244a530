"""The memory ``actviz doctor`` and ``actviz diff`` take to read a long run: peak RSS over the RSS after imports.

Writes a synthetic run of ``--steps`` logged steps × ``--layers`` layers with the tags actviz writes per layer
(``~activation_stats/mean@{layer}``, ``std``, ``zero_fraction``, ``nonfinite``, ``~gradient_stats/norm@{layer}``,
``nonfinite``, and the ``~activations/{layer}`` and ``~gradients/{layer}`` histograms with 30 buckets), once per
step in one event, and a copy of it; then runs ``doctor`` on one and ``diff`` on the pair, each in a fresh
process, and prints each one's peak resident memory above the process's resident memory after its imports
(``resource.getrusage``'s ``ru_maxrss``, Linux: KiB).

Usage: ``python scripts/run_reader_memory.py [--steps 2000] [--layers 200]``; docs/diagnosis.md gives the figures.
"""

from __future__ import annotations

import argparse
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE = """
import resource, sys
from actviz.diagnosis.doctor import doctor
from actviz.run_diff import diff
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
status, _ = doctor(sys.argv[2]) if sys.argv[1] == "doctor" else diff(sys.argv[2], sys.argv[3])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(status, after - before)
"""


def write_run(folder: Path, steps: int, layers: int) -> None:
    """A run of ``steps`` events, each with every layer's statistics and histograms."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

    from actviz.output.run_folders import _masked_crc

    crc = _masked_crc()
    folder.mkdir(parents=True)
    with open(folder / "events.out.tfevents.1.synthetic", "wb") as file:
        for step in range(steps):
            values = []
            for layer in range(layers):
                for name, value in (("mean", 0.1), ("std", 1.0 + step * 1e-3), ("zero_fraction", 0.5),
                                    ("nonfinite", 0.0)):
                    values.append(Summary.Value(tag=f"~activation_stats/{name}@l{layer}", simple_value=value))
                for name, value in (("norm", 0.5 / (1 + step)), ("nonfinite", 0.0)):
                    values.append(Summary.Value(tag=f"~gradient_stats/{name}@l{layer}", simple_value=value))
                for kind in ("activations", "gradients"):
                    histogram = HistogramProto(min=-1, max=1, num=1000, sum=float(layer), sum_squares=2.0 + step,
                                               bucket_limit=[i / 15 - 1 for i in range(30)], bucket=[33.0] * 30)
                    values.append(Summary.Value(tag=f"~{kind}/l{layer}", histo=histogram))
            data = Event(step=step, wall_time=1.0, summary=Summary(value=values)).SerializeToString()
            header = struct.pack("<Q", len(data))
            file.write(header + struct.pack("<I", crc(header)) + data + struct.pack("<I", crc(data)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--layers", type=int, default=200)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    try:
        write_run(root / "a", args.steps, args.layers)
        shutil.copytree(root / "a", root / "b")
        size = (root / "a" / "events.out.tfevents.1.synthetic").stat().st_size
        print(f"{args.steps} steps x {args.layers} layers: {size / 2**20:.0f} MiB of events per run")
        for command, folders in (("doctor", [root / "a"]), ("diff", [root / "a", root / "b"])):
            done = subprocess.run([sys.executable, "-c", MEASURE, command, *map(str, folders)], capture_output=True,
                                  text=True, check=True)
            status, kib = done.stdout.split()
            print(f"actviz {command}: exit {status}, peak resident memory {int(kib) / 1024:.0f} MiB above its imports")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
