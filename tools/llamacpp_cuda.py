#!/usr/bin/env python3
"""llama.cpp's ``llama-bench`` with CUDA, for the GPU machine: a slim source tarball made here, built there.

The source is the vendored llama.cpp of the pinned ``llama-cpp-python`` sdist (tools/llamacpp.py: the same
version the test suite's oracle runs). The GPU machine has no network, so the source travels as a small
tarball (``slim``, about 3-4 MB as tar.xz) that keeps only what a ``llama-bench``/``llama-quantize`` build
reads: the top ``CMakeLists.txt``, ``LICENSE``, ``licenses/``, ``cmake/``, ``include/``, ``src/``, ``common/``,
``vendor/``; ``ggml/`` with only the ``ggml-cpu`` and ``ggml-cuda`` backends; ``tools/llama-bench`` and
``tools/quantize``, with a ``tools/CMakeLists.txt`` rewritten to add just those two.

``build`` unpacks such a tarball and builds ``llama-bench`` (and ``llama-quantize``) with CMake:
:data:`CMAKE_ARGS` plus, with CUDA (the default), ``-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=<arch>`` (90: H100/
H200). Two options cut the build time without changing what the benchmark measures:

* ``-DGGML_CUDA_FA=OFF``: the flash-attention kernels (the ``template-instances/fattn-*`` files, most of the CUDA
  compile time) are compiled empty (``GGML_CUDA_NO_FA`` undefines ``FLASH_ATTN_AVAILABLE`` in
  ggml-cuda/common.cuh). moestream has no flash attention, so the comparison runs ``llama-bench -fa 0``
  anyway; ``--fa`` keeps them.
* ``-DBUILD_SHARED_LIBS=OFF``: libllama and libggml (every backend) are linked into the one ``llama-bench``
  binary, so it runs from anywhere without ``LD_LIBRARY_PATH``; only the system's and the CUDA toolkit's own
  shared libraries (libcudart, libcublas, libcuda) stay dynamic.

``GGML_NATIVE`` stays at llama.cpp's default (ON: ``-march=native``): on the machine that runs it, the
experts-on-CPU rows get the CPU code llama.cpp users get.

    python tools/llamacpp_cuda.py slim build/dev/llama.cpp-cuda-slim.tar.xz      # here (needs the sdist)
    python3 tools/llamacpp_cuda.py build build/dev/llama.cpp-cuda-slim.tar.xz /tmp/llb -j16   # GPU machine
    python3 tools/llamacpp_cuda.py build SRC.tar.xz /tmp/llb-cpu --cpu -j2       # CPU-only check

``build`` prints the path of the ``llama-bench`` binary on stdout (progress on stderr); it needs only the
Python standard library, cmake, a C++ compiler, and with CUDA nvcc (ninja is used when present).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

#: The top folder of the slim tarball.
TOP = "llama.cpp"

#: Paths (relative to the sdist's vendor/llama.cpp) kept whole; anything else under ggml/src/ is kept only
#: when it is a file directly in ggml/src or under one of :data:`BACKENDS`.
KEEP = ("CMakeLists.txt", "LICENSE", "licenses/", "cmake/", "include/", "src/", "common/", "vendor/",
        "ggml/CMakeLists.txt", "ggml/cmake/", "ggml/include/", "tools/llama-bench/", "tools/quantize/")
BACKENDS = ("ggml-cpu", "ggml-cuda")
#: Build targets.
TARGETS = ("llama-bench", "llama-quantize")
#: tools/CMakeLists.txt of the slim tree: only the tools it carries.
TOOLS_CMAKELISTS = """\
# moestream slim tree (tools/llamacpp_cuda.py): only llama-bench and llama-quantize
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(llama-bench)
add_subdirectory(quantize)
"""

#: Flags of every build (CUDA or not): only the tools, no servers, tests, examples, network code.
CMAKE_ARGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)


def log(msg: str) -> None:
    print(f"[llamacpp_cuda] {msg}", file=sys.stderr, flush=True)


def _kept(rel: str) -> bool:
    """Whether vendor/llama.cpp/``rel`` goes into the slim tree."""
    if rel == "tools/CMakeLists.txt":
        return False  # replaced by TOOLS_CMAKELISTS
    if rel.startswith("ggml/src/"):
        sub = rel[len("ggml/src/"):]
        return "/" not in sub or sub.split("/", 1)[0] in BACKENDS
    return any(rel == k or (k.endswith("/") and rel.startswith(k)) for k in KEEP)


def slim(out: str, sdist: str | None = None) -> Path:
    """Write the slim tar.xz of the pinned sdist's vendored llama.cpp to ``out``; returns its path. Members are
    sorted, owned by 0:0 with the sdist's mtimes, so the same sdist gives the same bytes."""
    if sdist is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import llamacpp

        sdist = str(llamacpp.sdist())
    out_p = Path(out)
    out_p.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_p.with_name(out_p.name + ".tmp")
    n = 0
    with tarfile.open(sdist) as src:
        members = []
        for m in src.getmembers():
            parts = m.name.split("/", 3)  # llama_cpp_python-X/vendor/llama.cpp/REL
            if len(parts) == 4 and parts[1:3] == ["vendor", "llama.cpp"] and m.isfile() and _kept(parts[3]):
                members.append((parts[3], m))  # files only: extraction makes the folders
        members.sort(key=lambda x: x[0])
        mtime = max(m.mtime for _, m in members)
        with tarfile.open(tmp, "w:xz", preset=9) as dst:
            for rel, m in members:
                info = tarfile.TarInfo(f"{TOP}/{rel}")
                info.mode, info.mtime, info.size = m.mode, m.mtime, m.size
                dst.addfile(info, src.extractfile(m))
                n += 1
            data = TOOLS_CMAKELISTS.encode()
            info = tarfile.TarInfo(f"{TOP}/tools/CMakeLists.txt")
            info.size, info.mode, info.mtime = len(data), 0o644, mtime
            dst.addfile(info, io.BytesIO(data))
    os.replace(tmp, out_p)
    log(f"wrote {out_p} ({out_p.stat().st_size / 2**20:.1f} MiB, {n + 1} files) from {sdist}")
    return out_p


def cmake_args(cuda: bool, arch: str, fa: bool) -> list[str]:
    """The configure flags of ``build`` (see the module docstring)."""
    args = list(CMAKE_ARGS)
    if cuda:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", f"-DGGML_CUDA_FA={'ON' if fa else 'OFF'}"]
    else:
        args += ["-DGGML_CUDA=OFF"]
    return args


def build(tarball: str, build_dir: str, jobs: int, cuda: bool = True, arch: str = "90", fa: bool = False,
          targets: tuple[str, ...] = TARGETS) -> Path:
    """Unpack ``tarball`` into ``build_dir``/src and build ``targets`` in ``build_dir``/build; returns the path of
    llama-bench. An existing ``build_dir``/src is replaced; an existing build folder is reused (incremental).
    The full log is ``build_dir``/build.log; SystemExit with its tail when a step fails."""
    bd = Path(build_dir).resolve()
    src_root = bd / "src"
    if src_root.exists():
        shutil.rmtree(src_root)
    src_root.mkdir(parents=True)
    t0 = time.monotonic()
    with tarfile.open(tarball) as tf:
        if hasattr(tarfile, "data_filter"):
            tf.extractall(src_root, filter="data")
        else:
            tf.extractall(src_root)  # noqa: S202 - our own tarball
    src = src_root / TOP
    if not (src / "CMakeLists.txt").is_file():
        raise SystemExit(f"{tarball}: no {TOP}/CMakeLists.txt inside (not a slim tarball of tools/llamacpp_cuda.py)")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    if (bd / "build" / "CMakeCache.txt").is_file():
        gen = []  # keep the generator the folder was configured with
    cfg = ["cmake", "-S", str(src), "-B", str(bd / "build"), *gen, *cmake_args(cuda, arch, fa)]
    bld = ["cmake", "--build", str(bd / "build"), "-j", str(jobs), "--target", *targets]
    log_file = bd / "build.log"
    env = {k: v for k, v in os.environ.items() if k not in ("CMAKE_ARGS", "CMAKE_GENERATOR_PLATFORM")}
    with open(log_file, "w") as logf:
        for cmd in (cfg, bld):
            t1 = time.monotonic()
            log("$ " + " ".join(cmd))
            logf.write("$ " + " ".join(cmd) + "\n")
            logf.flush()
            rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env).returncode
            log(f"  exit {rc} after {time.monotonic() - t1:.0f}s")
            if rc != 0:
                tail = log_file.read_text(errors="replace").strip().splitlines()[-25:]
                raise SystemExit(f"llama.cpp build failed (exit {rc}); full log {log_file}:\n  " + "\n  ".join(tail))
    exe = bd / "build" / "bin" / "llama-bench"
    if not os.access(exe, os.X_OK):
        raise SystemExit(f"the build finished but {exe} is not there; see {log_file}")
    log(f"built {', '.join(targets)} in {time.monotonic() - t0:.0f}s ({'CUDA sm_' + arch if cuda else 'CPU only'}"
        f"{', flash attention kernels off' if cuda and not fa else ''})")
    return exe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("slim", help="write the slim source tarball (tar.xz) of the pinned sdist's llama.cpp")
    s.add_argument("out")
    s.add_argument("--sdist", help="the llama-cpp-python sdist (default: tools/llamacpp.py's pinned, cached one)")
    b = sub.add_parser("build", help="unpack a slim tarball and build llama-bench; prints the binary's path")
    b.add_argument("tarball")
    b.add_argument("build_dir")
    b.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    b.add_argument("--cpu", action="store_true", help="CPU only (-DGGML_CUDA=OFF), e.g. to check the tarball")
    b.add_argument("--arch", default="90", help="CMAKE_CUDA_ARCHITECTURES (default 90: H100/H200)")
    b.add_argument("--fa", action="store_true", help="also compile the CUDA flash-attention kernels (slow)")
    b.add_argument("--bench-only", action="store_true", help="build llama-bench only, not llama-quantize")
    a = ap.parse_args(argv)
    if a.cmd == "slim":
        print(slim(a.out, a.sdist))
    else:
        print(build(a.tarball, a.build_dir, a.jobs, cuda=not a.cpu, arch=a.arch, fa=a.fa,
                    targets=("llama-bench",) if a.bench_only else TARGETS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
