"""What the fsyncs of an atomic write cost: specforge.utils.io.atomic_path as it writes (durable) against
the same write with os.fsync made a no-op (a rename alone, as before), for small files (a JSON, an
embedded image) and a shard-sized one, alternated, in a scratch folder on the file system under test.

    .venv/bin/python benchmarks/durable_write_bench.py [--dir outputs] [--out benchmarks/results/durable_write.json]
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import specforge.utils.io as io  # noqa: E402


def timed_writes(folder: Path, data: bytes, count: int, durable: bool) -> float:
    """Seconds per atomic write of `data`, `count` files."""
    real = io.os.fsync
    io.os.fsync = real if durable else (lambda fd: None)
    try:
        t0 = time.perf_counter()
        for i in range(count):
            with io.atomic_path(folder / f"{'d' if durable else 'r'}{i}.bin") as tmp:
                tmp.write_bytes(data)
        return (time.perf_counter() - t0) / count
    finally:
        io.os.fsync = real
        os.sync()  # the next measurement starts with nothing left to write back


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=str(ROOT / "outputs"), help="where the scratch folder goes (its file system)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds; the median is reported")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "durable_write.json"))
    args = p.parse_args(argv)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    cases = [("30 KB file", 30_000, 300), ("300 MiB file", 300 << 20, 1)]
    rows = []
    print("| file | rename only ms | durable ms | durable - rename ms |\n|---|---|---|---|")
    for name, size, count in cases:
        data = os.urandom(min(size, 1 << 20)) * max(1, size >> 20) if size >= 1 << 20 else os.urandom(size)
        times = {True: [], False: []}
        for _ in range(args.rounds):
            for durable in (False, True):
                folder = Path(tempfile.mkdtemp(prefix=".durable_write.", dir=args.dir))
                try:
                    times[durable].append(timed_writes(folder, data, count, durable))
                finally:
                    shutil.rmtree(folder)
        rename, durable = (statistics.median(times[k]) * 1e3 for k in (False, True))
        rows.append({"file": name, "bytes": len(data), "files": count, "rename_only_ms": round(rename, 3),
                     "durable_ms": round(durable, 3)})
        print(f"| {name} | {rename:.3f} | {durable:.3f} | {durable - rename:+.3f} |", flush=True)
    command = "python " + shlex.join(["benchmarks/durable_write_bench.py", *(argv if argv is not None else sys.argv[1:])])
    io.write_json(Path(args.out), {"rows": rows, "rounds": args.rounds, "command": command})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
