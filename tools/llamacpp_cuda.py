#!/usr/bin/env python3
"""llama.cpp's ``llama-bench`` (and ``llama-server``) with CUDA, for the GPU machine: a slim source tarball made here,
built there.

The source is the vendored llama.cpp of the pinned ``llama-cpp-python`` sdist (tools/llamacpp.py: the same
version the test suite's oracle runs). The GPU machine has no network, so the source travels as a small
tarball (``slim``, about 2.5 MiB as tar.xz) that keeps only what a ``llama-bench``/``llama-quantize``/
``llama-server`` build reads: the top ``CMakeLists.txt``, ``LICENSE``, ``licenses/``, ``cmake/``, ``include/``,
``src/``, ``common/``, ``vendor/``; ``ggml/`` with only the ``ggml-cpu`` and ``ggml-cuda`` backends;
``tools/llama-bench`` and ``tools/quantize``; for the server ``tools/server`` and ``tools/mtmd`` (the multimodal
library it links) without their tests, benchmarks, docs and sample media, and of ``tools/ui`` (the web UI) only its
CMake glue and ``scripts/ui-assets.cmake``: no UI sources or assets. A ``tools/CMakeLists.txt`` rewritten to add
just those tools (the server's folders only with ``-DLLAMA_BUILD_SERVER=ON``).

``build`` unpacks such a tarball and builds the ``--targets`` (default ``llama-bench,llama-quantize``; any of
:data:`ALL_TARGETS`) with CMake: :data:`CMAKE_ARGS` plus, with CUDA (the default), ``-DGGML_CUDA=ON
-DCMAKE_CUDA_ARCHITECTURES=<arch>`` (90: H100/H200), and with ``llama-server`` among the targets
:data:`SERVER_CMAKE_ARGS` (no web UI: the server embeds an empty asset table, its HTTP API is whole). Two options
cut the build time without changing what the benchmark measures:

* ``-DGGML_CUDA_FA=OFF``: the flash-attention kernels (the ``template-instances/fattn-*`` files, most of the CUDA
  compile time) are compiled empty (``GGML_CUDA_NO_FA`` undefines ``FLASH_ATTN_AVAILABLE`` in
  ggml-cuda/common.cuh). moestream has no flash attention, so the comparison runs ``llama-bench -fa 0``
  (``llama-server -fa off``) anyway; ``--fa`` keeps them.
* ``-DBUILD_SHARED_LIBS=OFF``: libllama and libggml (every backend) are linked into each binary, so it runs
  from anywhere without ``LD_LIBRARY_PATH``; only the system's and the CUDA toolkit's own shared libraries
  (libcudart, libcublas, libcuda) stay dynamic.

``GGML_NATIVE`` stays at llama.cpp's default (ON: ``-march=native``): on the machine that runs it, the
experts-on-CPU rows get the CPU code llama.cpp users get.

    python tools/llamacpp_cuda.py slim build/dev/llama.cpp-cuda-slim.tar.xz      # here (needs the sdist)
    python3 tools/llamacpp_cuda.py build build/dev/llama.cpp-cuda-slim.tar.xz /tmp/llb -j16   # GPU machine
    python3 tools/llamacpp_cuda.py build SRC.tar.xz /tmp/llb-cpu --cpu -j2       # CPU-only check
    python3 tools/llamacpp_cuda.py build SRC.tar.xz /tmp/llb -j16 --targets llama-bench,llama-server

``build`` prints the paths of the built binaries on stdout, one a line (progress on stderr); it needs only the
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

#: Paths (relative to the sdist's vendor/llama.cpp) kept whole, less :data:`DROP`; anything else under ggml/src/
#: is kept only when it is a file directly in ggml/src or under one of :data:`BACKENDS`.
KEEP = ("CMakeLists.txt", "LICENSE", "licenses/", "cmake/", "include/", "src/", "common/", "vendor/",
        "ggml/CMakeLists.txt", "ggml/cmake/", "ggml/include/", "tools/llama-bench/", "tools/quantize/",
        # llama-server: its sources, the multimodal library it links (mtmd), and the web UI's CMake glue only
        # (no assets: the build embeds an empty table, see SERVER_CMAKE_ARGS)
        "tools/server/", "tools/mtmd/", "tools/ui/CMakeLists.txt", "tools/ui/ui.cpp.in", "tools/ui/ui.h.in",
        "scripts/ui-assets.cmake")
#: Prefixes under KEEP that no build reads: tests, benchmarks, docs, conversion scripts, sample media (the
#: mtmd test image/audio/video alone are ~0.9 MB).
DROP = ("tools/server/tests/", "tools/server/bench/", "tools/server/README", "tools/mtmd/tests/",
        "tools/mtmd/legacy-models/", "tools/mtmd/test-", "tools/mtmd/README", "tools/mtmd/requirements",
        "tools/mtmd/tests.sh", "tools/mtmd/debug/mtmd-debug.md")
BACKENDS = ("ggml-cpu", "ggml-cuda")
#: Build targets ``build`` knows, and its default ones.
ALL_TARGETS = ("llama-bench", "llama-quantize", "llama-server")
TARGETS = ("llama-bench", "llama-quantize")
#: tools/CMakeLists.txt of the slim tree: only the tools it carries; the server's three folders only with
#: ``-DLLAMA_BUILD_SERVER=ON`` (the folders of llama.cpp's own tools/CMakeLists.txt under that option, less cli).
TOOLS_CMAKELISTS = """\
# moestream slim tree (tools/llamacpp_cuda.py): only llama-bench, llama-quantize and (LLAMA_BUILD_SERVER) llama-server
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(llama-bench)
add_subdirectory(quantize)
if (LLAMA_BUILD_SERVER)
    add_subdirectory(ui)
    add_subdirectory(mtmd)
    add_subdirectory(server)
endif()
"""

#: Flags of every build (CUDA or not): only the tools, no server (unless SERVER_CMAKE_ARGS), tests, examples,
#: network code.
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
#: Flags of a build that includes llama-server (instead of ``-DLLAMA_BUILD_SERVER=OFF``): no web UI assets (no
#: npm build, no download from the Hugging Face bucket: the GPU machine has no network), so the server embeds an
#: empty asset table and answers the HTTP API only.
SERVER_CMAKE_ARGS: tuple[str, ...] = (
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
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
    if any(rel.startswith(d) for d in DROP):
        return False
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


def cmake_args(cuda: bool, arch: str, fa: bool, server: bool = False) -> list[str]:
    """The configure flags of ``build`` (see the module docstring); ``server``: with llama-server's folders."""
    args = list(CMAKE_ARGS)
    if server:
        args = [a for a in args if not a.startswith("-DLLAMA_BUILD_SERVER=")] + list(SERVER_CMAKE_ARGS)
    if cuda:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", f"-DGGML_CUDA_FA={'ON' if fa else 'OFF'}"]
    else:
        args += ["-DGGML_CUDA=OFF"]
    return args


def build(tarball: str, build_dir: str, jobs: int, cuda: bool = True, arch: str = "90", fa: bool = False,
          targets: tuple[str, ...] = TARGETS) -> list[Path]:
    """Unpack ``tarball`` into ``build_dir``/src and build ``targets`` (names of :data:`ALL_TARGETS`) in
    ``build_dir``/build; returns the paths of their binaries, in the order of ``targets``. An existing
    ``build_dir``/src is replaced; an existing build folder is reused (incremental). The full log is
    ``build_dir``/build.log; SystemExit with its tail when a step fails (or when a target is unknown)."""
    unknown = [t for t in targets if t not in ALL_TARGETS]
    if unknown or not targets:
        raise SystemExit(f"unknown build target(s) {unknown or targets}; known: {', '.join(ALL_TARGETS)}")
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
    flags = cmake_args(cuda, arch, fa, server="llama-server" in targets)
    cfg = ["cmake", "-S", str(src), "-B", str(bd / "build"), *gen, *flags]
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
    exes = [bd / "build" / "bin" / t for t in targets]
    for exe in exes:
        if not os.access(exe, os.X_OK):
            raise SystemExit(f"the build finished but {exe} is not there; see {log_file}")
    log(f"built {', '.join(targets)} in {time.monotonic() - t0:.0f}s ({'CUDA sm_' + arch if cuda else 'CPU only'}"
        f"{', flash attention kernels off' if cuda and not fa else ''})")
    return exes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("slim", help="write the slim source tarball (tar.xz) of the pinned sdist's llama.cpp")
    s.add_argument("out")
    s.add_argument("--sdist", help="the llama-cpp-python sdist (default: tools/llamacpp.py's pinned, cached one)")
    b = sub.add_parser("build", help="unpack a slim tarball and build llama-bench (and more, --targets); prints "
                                     "the binaries' paths, one a line")
    b.add_argument("tarball")
    b.add_argument("build_dir")
    b.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    b.add_argument("--cpu", action="store_true", help="CPU only (-DGGML_CUDA=OFF), e.g. to check the tarball")
    b.add_argument("--arch", default="90", help="CMAKE_CUDA_ARCHITECTURES (default 90: H100/H200)")
    b.add_argument("--fa", action="store_true", help="also compile the CUDA flash-attention kernels (slow)")
    b.add_argument("--bench-only", action="store_true", help="build llama-bench only (same as --targets llama-bench)")
    b.add_argument("--targets", default=",".join(TARGETS),
                   help=f"comma-separated build targets of {', '.join(ALL_TARGETS)} (default: %(default)s)")
    a = ap.parse_args(argv)
    if a.cmd == "slim":
        print(slim(a.out, a.sdist))
    else:
        targets = ("llama-bench",) if a.bench_only else tuple(t.strip() for t in a.targets.split(",") if t.strip())
        for exe in build(a.tarball, a.build_dir, a.jobs, cuda=not a.cpu, arch=a.arch, fa=a.fa, targets=targets):
            print(exe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
