"""The shared MoE layer: router output -> slot plan -> reads -> (shared/dense FFN overlap) -> expert matmuls.

Every architecture file uses this. It supplies the top-k real expert ids and weights (its own gating),
an optional shared/dense FFN to run while the reads are in flight, and the expert activation; this
layer does the rest, the same way whether the store streams or is resident, so streaming on and off
give bitwise-identical results.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import quant
from .layout import ExpertLayout
from .pool import ExpertStore

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up (Qwen/Mixtral experts)."""
    return F.silu(gate) * up


class MoE:
    """Routed experts of one layer.

    layer: MoE layer index. layout: the file's ExpertLayout. store_of: callable returning the current
    ExpertStore (so a model can swap resident/streaming stores). act: (gate, up) -> hidden activation.
    """

    def __init__(self, layer: int, layout: ExpertLayout, store_of: Callable[[], ExpertStore],
                 act: Activation = swiglu):
        self.layer = layer
        self.mats = layout[layer]
        self.store_of = store_of
        self.act = act
        self.merged = "gate_up" in self.mats

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 shared: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 overlap: bool = True, expert_scale: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [tokens, hidden] float32; ids: [tokens, top_k] int64 real expert ids; weights: [tokens, top_k]
        float32 routing weights. shared: the shared expert / dense FFN, run while the misses are read when
        ``overlap`` (else before the reads start). expert_scale: optional [n_experts] per-expert output
        scale, indexed by real expert id. Returns (routed output [tokens, hidden], shared output or None).

        With ``overlap`` (the default) the reads hide behind every computation that does not need them:
        after the router's top-k the misses go to the IO threads, the shared/dense FFN runs, then the hits'
        matmuls, then each miss's matmul right after its own reads are joined (reads finish roughly in the
        order they were queued). Without it: shared FFN, then the reads, one join, then the experts.

        When a chunk selects more distinct experts than the pool holds (prefill through a small pool), the
        experts are walked in tiles: load a tile, compute every token routed to it, next tile. With
        ``overlap`` a tile is half the pool, and the next tile's reads start (its slots chosen with the current
        tile pinned) before the current tile is computed, so reads hide behind expert compute too; without it,
        tiles fill the pool and each load waits for the previous tile's compute. Each token's top-k outputs are
        summed in top-k order at the end and every expert sees the same tokens either way, so neither tiling
        nor overlap changes a bit of the result.
        """
        store = self.store_of()
        n_tok, top_k = ids.shape
        experts = torch.unique(ids).tolist()  # sorted real ids
        cap = store.capacity(self.layer)
        size = cap // 2 if overlap and len(experts) > cap and cap >= 2 else cap
        tiles = [experts[i:i + size] for i in range(0, len(experts), size)]
        if expert_scale is not None:
            weights = weights * expert_scale[ids]  # real ids, never slot ids
        out = x.new_zeros((n_tok, top_k, x.shape[-1]))
        shared_out = None
        if shared is not None and not overlap:
            shared_out = shared(x)
        unjoined: list = []  # tickets whose reads were started and not yet joined (discarded on an error)

        def start(tile: list[int], pinned: list[int] = ()) -> tuple[list[int], object]:
            slot_ids, ticket = store.prepare(self.layer, tile, pinned=pinned)
            unjoined.append(ticket)
            return slot_ids, ticket

        try:
            nxt = start(tiles[0])
            if shared is not None and overlap:
                shared_out = shared(x)  # runs while the IO threads read the first tile's misses
            for ti, tile in enumerate(tiles):
                slot_ids, ticket = nxt
                if overlap and ti + 1 < len(tiles):  # start the next tile's reads; this tile stays pinned
                    nxt = start(tiles[ti + 1], pinned=tile)
                slot_of = dict(zip(tile, slot_ids, strict=True))
                if overlap:  # hits first, then each miss as soon as its own reads are joined
                    reading = store.reading(ticket)
                    misses = set(reading)
                    order = [e for e in tile if e not in misses] + reading
                else:  # one join, then the tile in order
                    store.wait(ticket)
                    misses, order = set(), tile
                for expert in order:
                    if expert in misses:
                        store.wait(ticket, through=expert)
                    tok, kk = (ids == expert).nonzero(as_tuple=True)
                    y = self._expert(store, slot_of[expert], x[tok])
                    out[tok, kk] = y * weights[tok, kk, None]
                unjoined.remove(ticket)  # every read of it was joined above
                if not overlap and ti + 1 < len(tiles):
                    nxt = start(tiles[ti + 1])
        except BaseException:
            for ticket in unjoined:
                store.discard(ticket)
            raise
        return out.sum(dim=1), shared_out

    def _expert(self, store: ExpertStore, slot: int, xs: torch.Tensor) -> torch.Tensor:
        """One expert's FFN on xs [n, hidden] with its matrices at ``slot`` of the store's pools."""
        def lin(name: str, v: torch.Tensor) -> torch.Tensor:
            m = self.mats[name]
            raw = store.matrix(self.layer, name)[slot].view(m.rows, -1)
            return quant.linear(v, raw, m.ggml_type, m.cols)

        if self.merged:
            gu = lin("gate_up", xs)
            gate, up = gu.chunk(2, dim=-1)
        else:
            gate, up = lin("gate", xs), lin("up", xs)
        return lin("down", self.act(gate, up))
