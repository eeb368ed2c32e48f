"""Compute threads do not change a bit: ``-t 1`` and ``-t 8`` give identical logits (the C kernels compute each
output element in one thread, in a fixed order), streaming on as well as off, for every family."""

from __future__ import annotations

import pytest
import torch

from moestream import kernels
from moestream.engine import Engine
from moestream.models.base import LoadOptions, load_model

PROMPT_IDS = [5, 17, 93, 211, 7, 64, 1000, 3, 88, 41, 12, 600, 250, 9, 77, 140, 31, 2, 500, 19]
STEPS = 12


def greedy_logits(model, ids: list[int], threads: int, ubatch: int = 8) -> list[torch.Tensor]:  # noqa: ANN001
    """Logits of every prompt position (prefill in chunks of ``ubatch``) and of ``STEPS`` greedy decode steps."""
    kernels.set_threads(threads)
    try:
        engine = Engine(model, ubatch=ubatch)
        cache = model.new_cache(len(ids) + STEPS)
        out = [engine.prefill(ids, cache, logits_all=True).clone()]
        tok = int(out[0][-1].argmax())
        for step in range(STEPS):
            out.append(engine.decode_step(tok, len(ids) + step, cache).clone())
            tok = int(out[-1].argmax())
        return out
    finally:
        kernels.set_threads(0)


@pytest.mark.parametrize("family", ["qwen3moe-tiny", "gemma4-tiny", "qwen35moe-tiny", "deepseek2-tiny"])
@pytest.mark.parametrize("stream", [False, True])
def test_threads_1_and_8_give_identical_logits(fixtures_tool, family, stream):
    fx = fixtures_tool.build_fixture(family)
    model = load_model(str(fx["q8_0"]), LoadOptions(moe_stream=stream, slots=None, io_threads=2))
    assert model.use_blocks, "the default matmul path is the C kernels"
    vocab = model.n_vocab
    ids = [i % vocab for i in PROMPT_IDS]
    try:
        one = greedy_logits(model, ids, 1)
        eight = greedy_logits(model, ids, 8)
    finally:
        model.store.close()
    assert len(one) == len(eight) == STEPS + 1
    for step, (a, b) in enumerate(zip(one, eight, strict=True)):
        assert torch.isfinite(a).all()
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"step {step}: -t 1 and -t 8 differ"


def test_cli_t_sets_the_kernel_threads_and_leaves_torch_one(capsys):
    """``-t N`` with ``--matmul blocks`` (the default) gives the kernels N threads and torch one; with
    ``--matmul dequant`` torch gets N."""
    from moestream import cli
    before = torch.get_num_threads()
    try:
        assert cli.main(["run", "-n", "2", "-t", "3", "--temp", "0"]) == 0
        assert (kernels.threads(), torch.get_num_threads()) == (3, 1)
        assert cli.main(["run", "-n", "2", "-t", "2", "--temp", "0", "--matmul", "dequant"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        kernels.set_threads(0)
        torch.set_num_threads(before)
    capsys.readouterr()
