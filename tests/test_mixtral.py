"""Mixtral (GGUF ``llama`` with routed experts, models/llama.py) on the ``mixtral-tiny`` fixture
(tools/fixtures_mixtral.py): a random-weight transformers ``MixtralForCausalLM`` converted by llama.cpp's converter
(F32, Q8_0), and Q4_K_M by llama.cpp's quantizer (the standard tests' quantized file).

* the standard bars (tests/family.py): transformers < 1e-4 on F32 with 32 greedy tokens, llama.cpp < 1e-4 on the
  same F32 file (measured 3.6e-5 here over 33 prompt positions + 31 decode steps, FIELD-NOTES 6.6e-6 on another
  tiny mixtral: the same float32 graph, different summation orders), streaming vs resident bitwise,
  slot ids != expert ids, the CLI;
* Mixtral's own: the RMSNorm epsilon's default when the file lacks the key (1e-5, the published and llama.cpp
  value); a dense llama file (no routed experts) refused; the per-expert 2-D tensor layout of early Mixtral
  GGUFs (``blk.N.ffn_gate.E.weight``) refused with one line naming the file and the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from family import IDENTITY_PROMPT, Family, standard_tests
from ggufedit import read as GGUFReader
from helpers import moestream
from moestream.errors import GGUFError
from moestream.models.base import LoadOptions, load_model
from moestream.tokenizer import GGUFTokenizer

FAM = Family(fixture="mixtral-tiny", arch="llama", hf_class="MixtralForCausalLM", top_k=2, n_experts=8,
             n_layers=2, moe_layers=2, quant="q4_k_m")
standard_tests(globals(), FAM)


def rewrite(src: Path, dst: Path, drop_keys: frozenset[str] = frozenset(),
            tensors: Callable[[str, np.ndarray, int], list[tuple[str, np.ndarray]]] | None = None) -> Path:
    """Copy the GGUF ``src`` to ``dst`` with the gguf package's GGUFWriter, leaving out the metadata keys
    ``drop_keys`` and passing each tensor through ``tensors(name, raw data, ggml type) -> [(name, raw data)]``
    (the raw data as the reader gives it: numpy [..., rows, cols] for F32, uint8 [..., rows, row bytes] for
    quantized types; an empty list drops the tensor)."""
    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment") or key in drop_keys:
            continue
        if f.types[0] == GGUFValueType.ARRAY:
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(key, f.contents(), f.types[0])
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = np.asarray(t.data)
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            data = data.reshape(shape)
        out = tensors(t.name, data, t.tensor_type) if tensors else [(t.name, data)]
        for name, arr in out:
            if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                w.add_tensor(name, np.ascontiguousarray(arr))
            else:
                w.add_tensor(name, np.ascontiguousarray(arr), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def per_expert(name: str, data: np.ndarray, ggml_type: int) -> list[tuple[str, np.ndarray]]:
    """``blk.N.ffn_X_exps.weight`` [n_exp, rows, cols] -> ``blk.N.ffn_X.E.weight`` [rows, cols] for each expert E
    (the layout of early Mixtral GGUFs); other tensors unchanged."""
    if "_exps." not in name:
        return [(name, data)]
    base = name.replace("_exps.weight", "")
    return [(f"{base}.{e}.weight", data[e]) for e in range(data.shape[0])]


@pytest.fixture(scope="module")
def per_expert_file(fam_files, tmp_path_factory) -> Path:
    return rewrite(fam_files["q8_0"], tmp_path_factory.mktemp("mixtral") / "per-expert.gguf", tensors=per_expert)


def test_per_expert_layout_refused(per_expert_file):
    """The real converted fixture with its merged expert tensors rewritten one 2-D tensor per expert: a GGUFError
    of one line naming the file and the layout, for a full load and for metadata only."""
    r = GGUFReader(str(per_expert_file))
    names = {t.name for t in r.tensors}
    assert "blk.0.ffn_gate.7.weight" in names and not any("_exps" in n for n in names)
    for opts in (LoadOptions(moe_stream=False), LoadOptions(metadata_only=True)):
        with pytest.raises(GGUFError) as e:
            load_model(str(per_expert_file), opts)
        msg = str(e.value)
        assert "\n" not in msg and str(per_expert_file) in msg
        assert "one 2-D tensor per expert" in msg and "blk.0.ffn_gate.0.weight" in msg


def test_per_expert_layout_cli(per_expert_file):
    """``inspect`` and ``run`` on that file: exit 1, one ``moestream: error:`` line, no traceback."""
    for args in (("inspect", "-m", str(per_expert_file)),
                 ("run", "-m", str(per_expert_file), "-n", "2", "-p", "Hello")):
        p = moestream(*args)
        assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
        assert "Traceback" not in p.stderr
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("moestream: error: "), p.stderr
        assert str(per_expert_file) in lines[0] and "one 2-D tensor per expert" in lines[0]


def test_dense_llama_refused(fam_files, tmp_path):
    """A llama file without routed experts (the fixture with its expert and router tensors left out, expert
    counts removed): refused with the base class's one-line 'no routed-expert tensors'."""
    dense = rewrite(fam_files["q8_0"], tmp_path / "dense.gguf",
                    drop_keys=frozenset({"llama.expert_count", "llama.expert_used_count"}),
                    tensors=lambda n, d, t: [] if ("_exps." in n or "ffn_gate_inp" in n) else [(n, d)])
    with pytest.raises(GGUFError, match="no routed-expert tensors") as e:
        load_model(str(dense), LoadOptions(moe_stream=False))
    assert "\n" not in str(e.value) and str(dense) in str(e.value)


def test_rms_eps_default(fam_files, fam_hf, tmp_path):
    """A file without ``llama.attention.layer_norm_rms_epsilon``: the default is 1e-5 (llama.cpp's, and
    Mixtral-8x7B's published ``rms_norm_eps``, the transformers checkpoint's value), so the logits equal the
    full file's bitwise."""
    assert fam_hf.config.rms_norm_eps == 1e-5
    src = fam_files["q8_0"]
    bare = rewrite(src, tmp_path / "no-eps.gguf", drop_keys=frozenset({"llama.attention.layer_norm_rms_epsilon"}))
    assert "llama.attention.layer_norm_rms_epsilon" not in GGUFReader(str(bare)).fields
    ids = torch.tensor(GGUFTokenizer.from_gguf(str(src)).encode(IDENTITY_PROMPT)[:12])
    out = []
    for path in (src, bare):
        model = load_model(str(path), LoadOptions(moe_stream=False))
        try:
            assert model.eps == pytest.approx(1e-5, rel=1e-6)
            out.append(model.forward(ids, 0, model.new_cache(len(ids)), logits_all=True))
        finally:
            model.store.close()
    assert torch.equal(out[0], out[1])


def test_llama3_rope_factors_refused(fam_files, tmp_path):
    """A llama file with a ``rope_freqs.weight`` tensor (Llama 3's RoPE frequency factors, which llama.cpp's llama
    graph applies and models/llama.py does not): refused in one line naming the file and the tensor."""
    def add(n: str, d: np.ndarray, t: int) -> list[tuple[str, np.ndarray]]:
        return [(n, d), ("rope_freqs.weight", np.ones(32, np.float32))] if n == "output_norm.weight" else [(n, d)]
    bad = rewrite(fam_files["q8_0"], tmp_path / "rope-freqs.gguf", tensors=add)
    with pytest.raises(GGUFError, match="rope_freqs.weight") as e:
        load_model(str(bad), LoadOptions(metadata_only=True))
    assert "\n" not in str(e.value) and str(bad) in str(e.value)
