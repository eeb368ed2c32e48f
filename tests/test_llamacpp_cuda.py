"""tools/llamacpp_cuda.py without building anything: what the slim tarball keeps (llama-bench, llama-quantize and
llama-server's sources; no tests, sample media or web UI sources), the configure flags per target set, and the
``--targets`` option (an unknown target is refused before anything is unpacked)."""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import llamacpp_cuda as lc  # noqa: E402

TOP = "llama_cpp_python-0.0.0/vendor/llama.cpp/"

KEPT = ["CMakeLists.txt", "src/llama.cpp", "common/arg.cpp", "vendor/cpp-httplib/httplib.h",
        "ggml/src/ggml.c", "ggml/src/ggml-cuda/common.cuh", "ggml/src/ggml-cpu/ggml-cpu.c",
        "tools/llama-bench/llama-bench.cpp", "tools/quantize/quantize.cpp",
        "tools/server/CMakeLists.txt", "tools/server/server-context.cpp", "tools/server/main.cpp",
        "tools/mtmd/CMakeLists.txt", "tools/mtmd/clip.cpp", "tools/mtmd/models/qwen3vl.cpp",
        "tools/mtmd/mtmd-cli.cpp", "tools/mtmd/debug/mtmd-debug.cpp", "tools/mtmd/deprecation-warning.cpp",
        "tools/ui/CMakeLists.txt", "tools/ui/ui.cpp.in", "tools/ui/ui.h.in", "scripts/ui-assets.cmake"]
DROPPED = ["tools/CMakeLists.txt", "ggml/src/ggml-vulkan/ggml-vulkan.cpp", "tools/server/tests/unit/test_basic.py",
           "tools/server/bench/bench.py", "tools/server/README.md", "tools/mtmd/test-3.mp4", "tools/mtmd/test-1.jpeg",
           "tools/mtmd/tests/test-1-positive.png", "tools/mtmd/legacy-models/llava_surgery.py",
           "tools/mtmd/README.md", "tools/ui/package-lock.json", "tools/ui/src/app.html", "tools/cli/cli.cpp",
           "scripts/server-bench.py", "examples/simple/simple.cpp", "tests/test-backend-ops.cpp"]


@pytest.mark.parametrize("rel", KEPT)
def test_kept(rel: str) -> None:
    assert lc._kept(rel)


@pytest.mark.parametrize("rel", DROPPED)
def test_dropped(rel: str) -> None:
    assert not lc._kept(rel)


def test_slim_of_a_sdist(tmp_path: Path) -> None:
    """A stand-in sdist: the slim tarball holds the kept files under llama.cpp/ and the rewritten
    tools/CMakeLists.txt (the server's folders behind LLAMA_BUILD_SERVER), and the same sdist gives the same bytes."""
    sdist = tmp_path / "sdist.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        for rel in KEPT + DROPPED:
            data = rel.encode()
            info = tarfile.TarInfo(TOP + rel)
            info.size, info.mtime = len(data), 1_600_000_000
            tf.addfile(info, io.BytesIO(data))
    out = lc.slim(str(tmp_path / "a.tar.xz"), str(sdist))
    with tarfile.open(out) as tf:
        names = tf.getnames()
        tools = tf.extractfile("llama.cpp/tools/CMakeLists.txt").read().decode()
        bench = tf.extractfile("llama.cpp/tools/llama-bench/llama-bench.cpp").read().decode()
    assert sorted(names) == sorted(["llama.cpp/" + r for r in KEPT] + ["llama.cpp/tools/CMakeLists.txt"])
    assert bench == "tools/llama-bench/llama-bench.cpp"
    assert tools == lc.TOOLS_CMAKELISTS
    server_part = tools[tools.index("if (LLAMA_BUILD_SERVER)"):]
    assert all(f"add_subdirectory({d})" in server_part for d in ("ui", "mtmd", "server"))
    assert lc.slim(str(tmp_path / "b.tar.xz"), str(sdist)).read_bytes() == out.read_bytes()


def test_cmake_args() -> None:
    bench = lc.cmake_args(cuda=True, arch="90", fa=False)
    assert "-DLLAMA_BUILD_SERVER=OFF" in bench and "-DGGML_CUDA=ON" in bench and "-DGGML_CUDA_FA=OFF" in bench
    server = lc.cmake_args(cuda=False, arch="90", fa=False, server=True)
    assert "-DLLAMA_BUILD_SERVER=OFF" not in server and "-DGGML_CUDA=OFF" in server
    assert all(a in server for a in ("-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"))


def test_unknown_target_refused_before_unpacking(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown build target"):
        lc.build(str(tmp_path / "missing.tar.xz"), str(tmp_path / "b"), 1, targets=("llama-cli",))
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(("argv", "targets"), [
    ([], lc.TARGETS),
    (["--bench-only"], ("llama-bench",)),
    (["--targets", "llama-bench,llama-server"], ("llama-bench", "llama-server")),
    (["--targets", " llama-server "], ("llama-server",)),
])
def test_targets_option(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, argv: list[str],
                        targets: tuple[str, ...]) -> None:
    seen = {}

    def fake_build(tarball: str, build_dir: str, jobs: int, **kw: object) -> list[Path]:
        seen.update(kw)
        return [Path(build_dir) / "build" / "bin" / t for t in kw["targets"]]

    monkeypatch.setattr(lc, "build", fake_build)
    assert lc.main(["build", "x.tar.xz", "/tmp/llb", "--cpu", *argv]) == 0
    assert seen["targets"] == targets and seen["cuda"] is False
    assert capsys.readouterr().out.split() == [f"/tmp/llb/build/bin/{t}" for t in targets]
