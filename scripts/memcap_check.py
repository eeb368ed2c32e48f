#!/usr/bin/env python3
"""Check that ``--mem-cap`` really caps on this machine (run as root): a child Python under a cap of --cap
(default 256MiB) that

1. allocates --size (default 512MiB) of anonymous memory, touching every page: it must be killed (or fail);
2. reads a --size file through the page cache, evicted first: it must succeed, with the cgroup's peak at most
   the cap and at least half of it (the file pages are charged to the cap group, not left uncounted).

Prints one JSON object (``"ok"``: all checks passed) and exits 0 when all passed, 1 when one failed, 2 when no
cap can be applied here. Needs only the Python standard library and moestream's source, e.g. from a checkout
where moestream is not installed: ``sudo PYTHONPATH=src python3 scripts/memcap_check.py``. The test file is
written into --dir (default: the checkout), which must be on a disk, not tmpfs, and is removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from moestream.errors import ConfigError  # noqa: E402
from moestream.memcap import MOUNTINFO, MemCap, parse_cap, parse_size  # noqa: E402

ALLOC = "x = bytearray({n}); x[::4096] = b'1' * len(x[::4096]); print(len(x))"
# Read the file through the page cache (evicted again first, from inside the cap group), then report what the
# group has charged as file pages: memory.stat's "file" (v2) or "total_cache" (v1) of the child's own cgroup.
READ = """
import json, os, sys
path, root, version = sys.argv[1], sys.argv[2], int(sys.argv[3])
fd = os.open(path, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
n = 0
while chunk := os.read(fd, 1 << 20):
    n += len(chunk)
for line in open("/proc/self/cgroup"):
    _, ctrl, rel = line.rstrip("\\n").split(":", 2)
    if (version == 2 and ctrl == "") or (version == 1 and "memory" in ctrl.split(",")):
        break
key = "file" if version == 2 else "total_cache"
stat = dict(l.split() for l in open(os.path.join(root, rel.lstrip("/"), "memory.stat")))
print(json.dumps({"bytes_read": n, "file_charged_bytes": int(stat.get(key, -1)), "cgroup": rel}))
"""


def fs_type(path: str) -> str:
    """The file system type of the mount that holds ``path`` (the longest mount point above it)."""
    path, best, kind = os.path.realpath(path), "", "?"
    for line in open(MOUNTINFO):
        pre, _, post = line.partition(" - ")
        point = pre.split()[4].replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, post.split()[0]
    return kind


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap", default="256MiB", help="the memory cap (default 256MiB)")
    ap.add_argument("--size", default="512MiB", help="bytes allocated, and the file's size (default 512MiB)")
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                    help="where the test file is written (a disk, not tmpfs; default: the checkout)")
    ap.add_argument("--cgroup", choices=("auto", "1", "2"), default="auto", help="cgroup version (default: auto)")
    args = ap.parse_args()
    version = None if args.cgroup == "auto" else int(args.cgroup)
    summary: dict = {"ok": False, "kernel": os.uname().release}
    try:
        cap, size = parse_cap(args.cap), parse_size(args.size)
        h = MemCap.check(version)
    except ConfigError as e:
        summary["error"] = str(e)
        print(json.dumps(summary, indent=2))
        return 2
    summary.update(cgroup_version=h.version, cgroup_root=h.root, cap_bytes=cap, size_bytes=size)
    try:
        return checks(MemCap(cap, h.version), h.root, cap, size, args.dir, summary)
    except ConfigError as e:  # the kernel refused a step (enabling memory, mkdir, memory.max, cgroup.procs)
        summary["error"] = str(e)
        print(json.dumps(summary, indent=2))
        return 2


def checks(mc: MemCap, root: str, cap: int, size: int, directory: str, summary: dict) -> int:
    """The two capped runs; fills ``summary``, prints it, returns the exit status."""
    r = mc.run([sys.executable, "-c", ALLOC.format(n=size)], timeout=300)
    summary["alloc"] = {"returncode": r.returncode, "oom_killed": r.oom_killed, "peak_bytes": r.peak_bytes,
                        "peak_source": r.peak_source, "stderr_tail": r.stderr.strip().splitlines()[-1:],
                        "ok": r.returncode != 0 and r.peak_bytes <= cap + 2**20}

    kind = fs_type(directory)
    path = os.path.join(os.path.realpath(directory), f".memcap_check-{os.getpid()}.bin")
    read: dict = {"file": path, "file_system": kind, "ok": False}
    summary["read"] = read
    if kind in ("tmpfs", "ramfs", "devtmpfs"):
        read["error"] = f"{directory} is on {kind} (memory, not a disk): pass --dir DIR on a disk"
    elif shutil.disk_usage(os.path.dirname(path)).free < size + 2**28:
        read["error"] = f"{directory}: less than {size + 2**28} bytes free for the test file"
    else:
        try:
            block = bytes(range(256)) * 4096  # 1 MiB
            with open(path, "wb") as f:
                for _ in range(-(-size // len(block))):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            r = mc.run([sys.executable, "-c", READ, path, root, str(mc.version)], timeout=300)
            child = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else {}
            read.update(returncode=r.returncode, oom_killed=r.oom_killed, peak_bytes=r.peak_bytes,
                        peak_source=r.peak_source, **child, stderr_tail=r.stderr.strip().splitlines()[-1:])
            read["page_cache_charged"] = r.peak_bytes >= cap // 2
            read["ok"] = (r.returncode == 0 and child.get("bytes_read", 0) >= size and r.peak_bytes <= cap
                          and read["page_cache_charged"])
        finally:
            if os.path.exists(path):
                os.unlink(path)
    summary["ok"] = summary["alloc"]["ok"] and read["ok"]
    print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
