#!/usr/bin/env python3
"""A reproducible llama.cpp for the test suite: ``llama-cpp-python`` built once from its pinned sdist.

``llama-cpp-python==0.3.36`` is published on PyPI as a source distribution only (it vendors the llama.cpp
of October 2026, which knows ``qwen3moe``). The tests use it as an oracle (logits, tokenizer, quantizer),
so this module builds it the same way on every machine and keeps the wheel:

* the sdist is fetched by pip and checked against :data:`SDIST_SHA256`;
* the build backend and the tools it may fetch are pinned (:data:`BUILD_CONSTRAINTS`, passed with
  ``pip wheel --build-constraint``);
* the build is CPU-only and not tuned to the build machine (:data:`CMAKE_ARGS`: every GPU backend off,
  ``GGML_NATIVE=OFF`` so ggml targets x86-64 with AVX2/FMA/F16C instead of ``-march=native``, which keeps
  a cached wheel usable on another CPU of the same kind); the multimodal library (``mtmd``) and the
  network code are left out;
* the wheel lands in ``$MOESTREAM_CACHE/wheels/llama-cpp-python-<version>-<key>/`` (default cache
  ``~/.cache/moestream``), ``key`` being a hash of all of the above. It is built in a temporary directory
  beside that one and renamed into place when complete, under a file lock, so an interrupted or
  concurrent build never leaves a half-written wheel.

The build takes several minutes on two cores (it compiles llama.cpp); afterwards :func:`ensure_wheel` is a
directory listing. ``pip`` never builds it again on its own: :func:`install` installs the cached wheel with
``--no-deps`` plus the pinned runtime requirements (:data:`RUNTIME_REQUIREMENTS`).

Command line::

    python tools/llamacpp.py wheel        # build if needed, print the wheel's path
    python tools/llamacpp.py install      # ... and install it into this interpreter's environment
    python tools/llamacpp.py quantize SRC.gguf DST.gguf Q4_K_M   # llama.cpp's quantizer (needs install)
    python tools/llamacpp.py tools        # build llama-imatrix + llama-quantize once (CMake, -j2), print bin/
    python tools/llamacpp.py server       # build llama-server once (same source and flags), print bin/
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# ---------------------------------------------------------------------------------------------------------
# Pins
# ---------------------------------------------------------------------------------------------------------

VERSION = "0.3.36"
PROJECT = "llama-cpp-python"
#: sha256 of ``llama_cpp_python-0.3.36.tar.gz`` as served by PyPI.
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

#: Build requirements, pinned. ``scikit-build-core`` is what the sdist asks for; it asks for ``cmake`` and
#: ``ninja`` from PyPI only where the machine has none (or too old ones), and then gets these versions.
BUILD_CONSTRAINTS: tuple[str, ...] = (
    "scikit-build-core==1.1.2",
    "packaging==26.4",
    "pathspec==1.1.1",
    "cmake==4.4.5",
    "ninja==1.13.2",
)

#: Runtime requirements of the wheel that the project does not already pin (numpy, jinja2 and
#: typing-extensions come with the project's own dependencies).
RUNTIME_REQUIREMENTS: tuple[str, ...] = ("diskcache==5.6.3",)

#: CPU only, no ``-march=native``, no GPU/BLAS/RPC backends, no multimodal library, no HTTPS code.
CMAKE_ARGS: tuple[str, ...] = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_HIP=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_SYCL=OFF",
    "-DGGML_OPENCL=OFF",
    "-DGGML_MUSA=OFF",
    "-DGGML_BLAS=OFF",
    "-DGGML_RPC=OFF",
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
)

#: Bump when the recipe changes in a way the pins above do not show.
RECIPE = 1

#: Wheels of different recipes kept side by side (two checkouts at different pins sharing the cache).
KEEP_BUILDS = 2

LOG_PREFIX = "[llamacpp]"


class LlamaCppError(RuntimeError):
    """Building, installing or running llama.cpp failed; the message says what and why."""


def log(msg: str) -> None:
    print(f"{LOG_PREFIX} {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """``$MOESTREAM_CACHE`` or ``~/.cache/moestream``."""
    return Path(os.environ.get("MOESTREAM_CACHE") or "~/.cache/moestream").expanduser()


def build_key() -> str:
    """Hash of everything that determines the wheel's bytes (not of this file's source)."""
    spec = {
        "project": PROJECT, "version": VERSION, "sdist": SDIST_SHA256, "build": BUILD_CONSTRAINTS,
        "cmake": CMAKE_ARGS, "recipe": RECIPE, "machine": platform.machine(), "system": platform.system(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def wheel_dir() -> Path:
    """Where the wheel of the current recipe lives (whether built yet or not)."""
    return cache_root() / "wheels" / f"{PROJECT}-{VERSION}-{build_key()}"


def _find_wheel(d: Path) -> Path | None:
    if not (d / "build-info.json").is_file():
        return None
    found = sorted(d.glob(f"llama_cpp_python-{VERSION}-*.whl"))
    return found[0] if len(found) == 1 else None


@contextlib.contextmanager
def _lock(name: str) -> Iterator[None]:
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / name, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------------------
# Building the wheel
# ---------------------------------------------------------------------------------------------------------

_NINJA_STEP = re.compile(rb"^\[(\d+)/(\d+)\]")
_PHASES = (b"Collecting ", b"Downloading ", b"Installing build dependencies", b"Building wheel",
           b"-- Configuring done", b"-- Generating done", b"*** Building project", b"*** Installing project",
           b"*** Created ", b"Successfully built", b"ERROR", b"error:")


def _build(dest: Path, log_file: Path) -> None:
    """``pip wheel`` the pinned sdist into ``dest``, output in ``log_file``, progress lines on stderr."""
    req = dest / "requirements.txt"
    req.write_text(f"{PROJECT}=={VERSION} --hash=sha256:{SDIST_SHA256}\n")
    constraints = dest / "build-constraints.txt"
    constraints.write_text("\n".join(BUILD_CONSTRAINTS) + "\n")
    out = dest / "out"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "--no-input",
           "--disable-pip-version-check", "--no-binary", PROJECT, "--require-hashes", "-r", str(req),
           "--build-constraint", str(constraints), "-w", str(out), "-v"]
    env = dict(os.environ)
    env["CMAKE_ARGS"] = " ".join(CMAKE_ARGS)
    env["FORCE_CMAKE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"  # progress lines as they come
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
    for var in ("PIP_CONSTRAINT", "PIP_REQUIRE_VIRTUALENV", "CMAKE_GENERATOR_PLATFORM", "CUDACXX", "CC_LD"):
        env.pop(var, None)
    t0 = last = time.monotonic()
    last_pct = -1
    with open(log_file, "wb") as logf:
        log("$ CMAKE_ARGS='" + env["CMAKE_ARGS"] + "' " + " ".join(cmd[2:]))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL)
        assert proc.stdout is not None
        for line in proc.stdout:
            logf.write(line)
            stripped = line.strip()
            m = _NINJA_STEP.match(stripped)
            now = time.monotonic()
            if m:
                done, total = int(m.group(1)), int(m.group(2))
                pct = 100 * done // max(total, 1)
                if pct // 10 > last_pct // 10 or now - last > 60 or done == total:
                    log(f"compiling {done}/{total} ({pct}%), {now - t0:.0f}s")
                    last_pct, last = pct, now
            elif stripped.startswith(_PHASES):
                log(f"{stripped.decode(errors='replace')[:150]} ({now - t0:.0f}s)")
                last = now
        rc = proc.wait()
    if rc != 0:
        tail = log_file.read_text(errors="replace").strip().splitlines()[-20:]
        raise LlamaCppError(f"building {PROJECT}=={VERSION} failed (exit {rc}); full log: {log_file}\n  "
                            + "\n  ".join(tail))


def _move_into_place(tmp: Path, final: Path, old_prefix: str) -> None:
    """Rename the finished build ``tmp`` to ``final``, replacing (then deleting) an older ``final``."""
    if final.exists():
        old = final.with_name(f"{old_prefix}{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


def ensure_wheel(*, force: bool = False) -> Path:
    """Return the path of the cached ``llama_cpp_python`` wheel, building it first if needed."""
    final = wheel_dir()
    wheel = _find_wheel(final)
    if wheel is not None and not force:
        return wheel
    with _lock(".llamacpp-build.lock"):
        wheel = _find_wheel(final)
        if wheel is not None and not force:
            return wheel
        parent = final.parent
        parent.mkdir(parents=True, exist_ok=True)
        for p in parent.glob(f".tmp-{PROJECT}-*"):  # leftovers of killed builds (we hold the lock)
            shutil.rmtree(p, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{PROJECT}-", dir=parent))
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        try:
            log(f"building {PROJECT}=={VERSION} from source into {final} (once; several minutes)")
            t0 = time.monotonic()
            _build(tmp, tmp / "build.log")
            built = sorted((tmp / "out").glob(f"llama_cpp_python-{VERSION}-*.whl"))
            if len(built) != 1:
                raise LlamaCppError(f"pip wheel finished but left {[p.name for p in built]} in {tmp / 'out'}")
            seconds = round(time.monotonic() - t0, 1)
            built[0].rename(tmp / built[0].name)
            shutil.rmtree(tmp / "out")
            info = {"project": PROJECT, "version": VERSION, "sdist_sha256": SDIST_SHA256,
                    "build_constraints": BUILD_CONSTRAINTS, "cmake_args": CMAKE_ARGS, "recipe": RECIPE,
                    "key": build_key(), "wheel": built[0].name, "build_seconds": seconds,
                    "python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count()}
            (tmp / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")  # written last
            _move_into_place(tmp, final, f".tmp-{PROJECT}-old-")
            log(f"built {built[0].name} in {seconds:.0f}s")
            others = sorted((d for d in parent.glob(f"{PROJECT}-*-*") if d.is_dir() and d != final),
                            key=lambda d: d.stat().st_mtime, reverse=True)
            for d in others[KEEP_BUILDS - 1:]:  # builds of other recipes: keep the newest few
                shutil.rmtree(d, ignore_errors=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        wheel = _find_wheel(final)
        assert wheel is not None
        return wheel


# ---------------------------------------------------------------------------------------------------------
# Installing it
# ---------------------------------------------------------------------------------------------------------


def installed_wheel() -> str | None:
    """The file URL the installed ``llama_cpp_python`` came from (pip's ``direct_url.json``), else None."""
    try:
        dist = importlib.metadata.distribution("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return None
    text = dist.read_text("direct_url.json")
    if not text or dist.version != VERSION:
        return None
    return json.loads(text).get("url")


def install(*, force: bool = False) -> Path:
    """Install the cached wheel (built if needed) and :data:`RUNTIME_REQUIREMENTS` into this environment.

    Does nothing when that very wheel is already installed. Never lets pip build anything.
    """
    wheel = ensure_wheel()
    pip = [sys.executable, "-m", "pip", "install", "--no-input", "--disable-pip-version-check", "-q"]
    missing = []
    for req in RUNTIME_REQUIREMENTS:
        name, version = req.split("==")
        try:
            if importlib.metadata.version(name) == version:
                continue
        except importlib.metadata.PackageNotFoundError:
            pass
        missing.append(req)
    if missing:
        _check([*pip, "--only-binary=:all:", "--no-deps", *missing], "pip install " + " ".join(missing))
    if force or installed_wheel() != wheel.resolve().as_uri():
        log(f"installing {wheel}")
        _check([*pip, "--no-deps", "--force-reinstall", str(wheel)], f"pip install {wheel.name}")
    return wheel


def _check(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise LlamaCppError(f"{what} failed (exit {proc.returncode})\n  " + "\n  ".join(tail))


# ---------------------------------------------------------------------------------------------------------
# llama.cpp's own command-line tools (llama-imatrix, llama-quantize), from the same vendored source
# ---------------------------------------------------------------------------------------------------------

#: The tool targets built (CMake target names); nothing else of llama.cpp is compiled.
TOOL_TARGETS: tuple[str, ...] = ("llama-imatrix", "llama-quantize")

#: The wheel's CPU-only flags with the tools switched on, static libraries (self-contained binaries), no
#: server/app/HTTP code.
TOOLS_CMAKE_ARGS: tuple[str, ...] = (
    *(a for a in CMAKE_ARGS if not a.startswith("-DLLAMA_BUILD_TOOLS=")),
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_CURL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
)

#: Parallel compile jobs (the build machine has 2 cores and is shared).
TOOLS_JOBS = 2

#: Bump when the tools recipe changes in a way the values above do not show.
TOOLS_RECIPE = 1

#: llama-server (the serving comparison, tools/serve_load.py): the tools' flags with the server switched on. Its
#: web UI is neither built (npm) nor fetched (a download at build time): the server answers the API only.
SERVER_TARGETS: tuple[str, ...] = ("llama-server",)
SERVER_CMAKE_ARGS: tuple[str, ...] = (
    *(a for a in TOOLS_CMAKE_ARGS if not a.startswith("-DLLAMA_BUILD_SERVER=")),
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
SERVER_RECIPE = 1


def _cmake_version() -> str:
    proc = subprocess.run(["cmake", "--version"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0 or not proc.stdout:
        raise LlamaCppError("building llama.cpp's tools needs cmake on PATH (cmake --version failed)")
    return proc.stdout.splitlines()[0].strip()


def _cmake_key(cmake_args: tuple[str, ...], targets: tuple[str, ...], recipe: int) -> str:
    spec = {"project": PROJECT, "version": VERSION, "sdist": SDIST_SHA256, "cmake": cmake_args,
            "targets": targets, "recipe": recipe, "machine": platform.machine(),
            "system": platform.system(), "cmake_version": _cmake_version()}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def tools_key() -> str:
    """Hash of everything that determines the tool binaries: the pinned sdist, the CMake flags and targets,
    the recipe, the machine and the cmake version."""
    return _cmake_key(TOOLS_CMAKE_ARGS, TOOL_TARGETS, TOOLS_RECIPE)


def tools_dir() -> Path:
    """``$MOESTREAM_CACHE/llama-tools/llama.cpp-<version>-<key>``: ``bin/<target>`` and ``build-info.json``."""
    return cache_root() / "llama-tools" / f"llama.cpp-{VERSION}-{tools_key()}"


def server_key() -> str:
    """As :func:`tools_key`, for the llama-server build."""
    return _cmake_key(SERVER_CMAKE_ARGS, SERVER_TARGETS, SERVER_RECIPE)


def server_dir() -> Path:
    """``$MOESTREAM_CACHE/llama-tools/llama-server-<version>-<key>``: ``bin/llama-server``, ``build-info.json``."""
    return cache_root() / "llama-tools" / f"llama-server-{VERSION}-{server_key()}"


def _tools_ready(d: Path, targets: tuple[str, ...] = TOOL_TARGETS) -> bool:
    return (d / "build-info.json").is_file() and all(os.access(d / "bin" / t, os.X_OK) for t in targets)


def sdist() -> Path:
    """The pinned sdist, ``$MOESTREAM_CACHE/wheels/llama_cpp_python-<VERSION>.tar.gz``: downloaded once with
    ``pip download --require-hashes`` (hash-checked by pip, and again here), kept for its vendored llama.cpp
    (the tools build, llama.cpp's own tokenizer vocabularies and chat templates used by fixtures and tests)."""
    dest = cache_root() / "wheels" / f"{PROJECT.replace('-', '_')}-{VERSION}.tar.gz"
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".dl-sdist-") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{PROJECT}=={VERSION} --hash=sha256:{SDIST_SHA256}\n")
        _check([sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--disable-pip-version-check",
                "--no-binary", ":all:", "--require-hashes", "-r", str(req), "-d", tmp],
               f"pip download {PROJECT}=={VERSION} (sdist)")
        got = Path(tmp) / dest.name
        if not got.is_file() or hashlib.sha256(got.read_bytes()).hexdigest() != SDIST_SHA256:
            raise LlamaCppError(f"pip download left {sorted(p.name for p in Path(tmp).iterdir())}, not the sdist "
                                f"with sha256 {SDIST_SHA256}")
        os.replace(got, dest)
    return dest


def sdist_member(rel: str) -> bytes:
    """The bytes of ``vendor/llama.cpp/<rel>`` in the pinned sdist (e.g. ``models/templates/X.jinja``).
    LlamaCppError when it is not there."""
    import tarfile

    name = f"{PROJECT.replace('-', '_')}-{VERSION}/vendor/llama.cpp/{rel}"
    with tarfile.open(sdist()) as tf:
        try:
            f = tf.extractfile(name)
        except KeyError:
            f = None
        if f is None:
            raise LlamaCppError(f"{sdist().name}: no {name}")
        return f.read()


def _ensure_cmake(final: Path, targets: tuple[str, ...], cmake_args: tuple[str, ...], recipe: int, key: str,
                  tmp_prefix: str, *, force: bool = False) -> Path:
    """Build ``targets`` of the pinned sdist's vendored llama.cpp with ``cmake_args`` into ``final`` (``bin/``
    inside) unless already there; see :func:`ensure_tools`."""
    import tarfile

    if _tools_ready(final, targets) and not force:
        return final
    with _lock(".llamacpp-tools.lock"):
        if _tools_ready(final, targets) and not force:
            return final
        parent = final.parent
        parent.mkdir(parents=True, exist_ok=True)
        for p in parent.glob(tmp_prefix + "*"):  # leftovers of killed builds (we hold the lock)
            shutil.rmtree(p, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=parent))
        tmp.chmod(0o755)
        try:
            log(f"building {', '.join(targets)} of {PROJECT}=={VERSION}'s vendored llama.cpp into {final} "
                f"(once; -j{TOOLS_JOBS})")
            t0 = time.monotonic()
            with tarfile.open(sdist()) as tf:
                members = [m for m in tf.getmembers() if "/vendor/llama.cpp/" in m.name]
                if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: refuse links/paths out of the folder
                    tf.extractall(tmp / "src", members=members, filter="data")
                else:
                    tf.extractall(tmp / "src", members=members)  # noqa: S202 - the sdist's sha256 was checked
            src = next((tmp / "src").glob("*/vendor/llama.cpp"))
            t_src = time.monotonic() - t0
            build = tmp / "build"
            log_file = tmp / "build.log"
            env = dict(os.environ)
            for var in ("CMAKE_ARGS", "CMAKE_GENERATOR_PLATFORM", "CUDACXX", "CC_LD"):
                env.pop(var, None)
            with open(log_file, "w") as logf:
                for cmd in (["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", *cmake_args],
                            ["cmake", "--build", str(build), "-j", str(TOOLS_JOBS), "--target", *targets]):
                    t1 = time.monotonic()
                    log("$ " + " ".join(cmd))
                    logf.write("$ " + " ".join(cmd) + "\n")
                    logf.flush()
                    rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                        stdin=subprocess.DEVNULL).returncode
                    log(f"  exit {rc} after {time.monotonic() - t1:.0f}s")
                    if rc != 0:
                        tail = log_file.read_text(errors="replace").strip().splitlines()[-20:]
                        raise LlamaCppError(f"building llama.cpp's tools failed (exit {rc}); full log: "
                                            f"{log_file}\n  " + "\n  ".join(tail))
            (tmp / "bin").mkdir()
            for t in targets:
                shutil.copy2(build / "bin" / t, tmp / "bin" / t)
            seconds = round(time.monotonic() - t0, 1)
            info = {"project": PROJECT, "version": VERSION, "sdist_sha256": SDIST_SHA256,
                    "cmake_args": cmake_args, "targets": targets, "jobs": TOOLS_JOBS,
                    "recipe": recipe, "key": key, "cmake": _cmake_version(),
                    "download_extract_seconds": round(t_src, 1), "build_seconds": seconds,
                    "machine": platform.machine(), "cpus": os.cpu_count()}
            shutil.rmtree(build)
            shutil.rmtree(tmp / "src")
            (tmp / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")  # written last
            _move_into_place(tmp, final, tmp_prefix + "old-")
            log(f"built {', '.join(targets)} in {seconds:.0f}s (download and unpack {t_src:.0f}s)")
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return final


def ensure_tools(*, force: bool = False) -> Path:
    """Return the directory of the cached ``llama-imatrix``/``llama-quantize`` build (``bin/`` inside),
    building it first if needed: the pinned sdist's vendored llama.cpp, ``cmake`` with
    :data:`TOOLS_CMAKE_ARGS`, ``cmake --build -j TOOLS_JOBS --target`` :data:`TOOL_TARGETS` only. Built in a
    temporary directory and renamed into place under a file lock; the build time is logged and recorded in
    ``build-info.json``."""
    return _ensure_cmake(tools_dir(), TOOL_TARGETS, TOOLS_CMAKE_ARGS, TOOLS_RECIPE, tools_key(), ".tmp-tools-",
                         force=force)


def ensure_server(*, force: bool = False) -> Path:
    """Return the directory of the cached ``llama-server`` build (``bin/llama-server``), building it first if
    needed, as :func:`ensure_tools` does, with :data:`SERVER_CMAKE_ARGS`."""
    return _ensure_cmake(server_dir(), SERVER_TARGETS, SERVER_CMAKE_ARGS, SERVER_RECIPE, server_key(),
                         ".tmp-server-", force=force)


def tool(name: str) -> Path:
    """Path of the cached llama.cpp tool ``name`` (one of :data:`TOOL_TARGETS`), built if needed."""
    if name not in TOOL_TARGETS:
        raise LlamaCppError(f"no llama.cpp tool {name!r}; built: {', '.join(TOOL_TARGETS)}")
    return ensure_tools() / "bin" / name


# ---------------------------------------------------------------------------------------------------------
# Using it (needs the wheel installed)
# ---------------------------------------------------------------------------------------------------------


def quantize(src: str | Path, dst: str | Path, ftype: str, *, nthread: int = 0) -> None:
    """Quantize GGUF ``src`` into ``dst`` with llama.cpp's own quantizer (``llama_model_quantize`` with
    ``llama_model_quantize_default_params()``), ``ftype`` being the name of a ``LLAMA_FTYPE_MOSTLY_*``
    constant (``"Q4_K_M"``, ``"IQ4_XS"``, ...). Same as the ``llama-quantize SRC DST FTYPE`` tool."""
    import llama_cpp

    name = f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}"
    if not hasattr(llama_cpp, name):
        raise LlamaCppError(f"llama_cpp has no {name}")
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, name)
    params.nthread = nthread
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0 or not Path(dst).is_file():
        raise LlamaCppError(f"llama_model_quantize({src}, {dst}, {name}) returned {rc}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wheel", help="build the wheel if needed; print its path")
    w.add_argument("--force", action="store_true", help="rebuild even if cached")
    i = sub.add_parser("install", help="install the wheel (built if needed) into this environment")
    i.add_argument("--force", action="store_true", help="reinstall even if that wheel is installed")
    t = sub.add_parser("tools", help="build llama-imatrix and llama-quantize if needed; print their folder")
    t.add_argument("--force", action="store_true", help="rebuild even if cached")
    sv = sub.add_parser("server", help="build llama-server if needed; print its folder")
    sv.add_argument("--force", action="store_true", help="rebuild even if cached")
    q = sub.add_parser("quantize", help="llama.cpp's quantizer: SRC DST FTYPE (e.g. Q4_K_M)")
    q.add_argument("src")
    q.add_argument("dst")
    q.add_argument("ftype")
    q.add_argument("--nthread", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "wheel":
            print(ensure_wheel(force=args.force))
        elif args.cmd == "install":
            print(install(force=args.force))
        elif args.cmd == "tools":
            print(ensure_tools(force=args.force) / "bin")
        elif args.cmd == "server":
            print(ensure_server(force=args.force) / "bin")
        else:
            quantize(args.src, args.dst, args.ftype, nthread=args.nthread)
    except LlamaCppError as e:
        print(f"{LOG_PREFIX} error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
