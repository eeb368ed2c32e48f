"""Where every routed expert lives in the GGUF file, from the tensor table alone (no data read)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGMLQuantizationType

from ..errors import GGUFError
from ..gguf import GGUFModel

# GGUF names of routed-expert tensors (llama.cpp's LLM_TENSOR_FFN_*_EXPS) -> matrix name.
EXPERT_MATRICES = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down",
                   "ffn_gate_up_exps": "gate_up"}
_EXPS_RE = re.compile(r"^blk\.(\d+)\.(ffn_(?:gate|up|down|gate_up)_exps)\.weight$")
# Early Mixtral GGUFs (llama.cpp before the merged ``_exps`` tensors): one 2-D tensor per expert.
_PER_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(?:gate|up|down)\.(\d+)\.weight$")


@dataclass(frozen=True)
class ExpertMatrix:
    """One routed-expert matrix of one layer, e.g. layer 3's ``down``.

    rows, cols: per-expert shape in elements (cols = row length, the input dim of the matmul).
    bytes_per_expert: bytes of one expert's matrix in the file's own ggml type.
    path, offset: the file and absolute byte offset of expert 0; expert e is at offset + e * bytes_per_expert.
    """

    layer: int
    matrix: str
    ggml_type: int
    n_experts: int
    rows: int
    cols: int
    bytes_per_expert: int
    path: str
    part: int
    offset: int

    def expert_offset(self, expert: int) -> int:
        """Absolute byte offset of ``expert`` in ``path``."""
        return self.offset + expert * self.bytes_per_expert

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name


class ExpertLayout:
    """The expert matrices of every MoE layer: ``layout[layer][matrix] -> ExpertMatrix``.

    Raises GGUFError if expert tensors of one layer disagree in expert count, or (one line naming the file and
    the first such tensor) if the file stores each expert as its own 2-D tensor (``blk.N.ffn_gate.E.weight``,
    the layout of early Mixtral GGUFs), which moestream does not read.
    """

    def __init__(self, model: GGUFModel):
        self.layers: dict[int, dict[str, ExpertMatrix]] = {}
        per_expert = next((n for n in model.tensors if _PER_EXPERT_RE.match(n)), None)
        if per_expert is not None:
            raise GGUFError(f"{model.path}: experts stored one 2-D tensor per expert (e.g. {per_expert}, the "
                            f"layout of early Mixtral GGUFs) are not supported; convert the model again with a "
                            f"current llama.cpp, which writes merged blk.N.ffn_*_exps tensors")
        for name, info in model.tensors.items():
            m = _EXPS_RE.match(name)
            if not m:
                continue
            layer, kind = int(m.group(1)), m.group(2)
            if len(info.shape) != 3:
                raise GGUFError(f"{model.path}: expert tensor {name} has shape {info.shape}, expected 3 dims")
            n_exp, rows, cols = info.shape
            if info.n_bytes % n_exp:
                raise GGUFError(f"{model.path}: expert tensor {name}: {info.n_bytes} bytes not divisible "
                                f"by {n_exp} experts")
            self.layers.setdefault(layer, {})[EXPERT_MATRICES[kind]] = ExpertMatrix(
                layer=layer, matrix=EXPERT_MATRICES[kind], ggml_type=info.ggml_type, n_experts=n_exp,
                rows=rows, cols=cols, bytes_per_expert=info.n_bytes // n_exp, path=info.path,
                part=info.part, offset=info.offset,
            )
        for layer, mats in self.layers.items():
            have = set(mats)
            need = ({"gate_up", "down"} if "gate_up" in have else {"gate", "up", "down"})
            if have != need:  # one matrix missing (or a merged gate_up beside a separate gate / up)
                names = {v: k for k, v in EXPERT_MATRICES.items()}
                missing = sorted(f"blk.{layer}.{names[m]}.weight" for m in need - have)
                extra = sorted(f"blk.{layer}.{names[m]}.weight" for m in have - need)
                what = (f"tensor {', '.join(missing)} is missing" if missing else
                        f"tensors {', '.join(extra)} beside blk.{layer}.ffn_gate_up_exps.weight")
                raise GGUFError(f"{model.path}: layer {layer}'s routed experts are incomplete: {what}")
            counts = {m.n_experts for m in mats.values()}
            if len(counts) != 1:
                raise GGUFError(f"{model.path}: layer {layer} expert tensors disagree on expert count: {counts}")
        self.layers = dict(sorted(self.layers.items()))

    def check_counts(self, path: str, n_experts: int, top_k: int) -> None:
        """Check the metadata's expert_count / expert_used_count against the expert tensors.

        Raises GGUFError naming the file and both values when they disagree or top-k is not in [1, n_experts].
        """
        for layer in self.layers:
            if self.n_experts(layer) != n_experts:
                raise GGUFError(f"{path}: metadata says expert_count={n_experts} but layer {layer}'s expert "
                                f"tensors hold {self.n_experts(layer)} experts")
        if not 1 <= top_k <= n_experts:
            raise GGUFError(f"{path}: metadata says expert_used_count={top_k}, which must be in [1, "
                            f"expert_count={n_experts}]")

    def __getitem__(self, layer: int) -> dict[str, ExpertMatrix]:
        return self.layers[layer]

    def __contains__(self, layer: int) -> bool:
        return layer in self.layers

    @property
    def moe_layers(self) -> list[int]:
        return list(self.layers)

    def bytes_per_expert(self, layer: int) -> int:
        """Bytes of one expert of ``layer``, all its matrices together."""
        return sum(m.bytes_per_expert for m in self.layers[layer].values())

    def n_experts(self, layer: int) -> int:
        return next(iter(self.layers[layer].values())).n_experts

    @property
    def total_bytes(self) -> int:
        """Bytes of all routed experts in the file."""
        return sum(self.bytes_per_expert(layer) * self.n_experts(layer) for layer in self.layers)

    def pool_bytes(self, n_slots: int) -> int:
        """Memory of slot pools with ``n_slots`` slots in every MoE layer."""
        return sum(self.bytes_per_expert(layer) * min(n_slots, self.n_experts(layer)) for layer in self.layers)
