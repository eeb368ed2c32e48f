"""How well the router lookahead guesses: per MoE layer and decode token, the experts the fast step's two predictions
name (``early``: from the layer before's residual after its attention; ``input``: from the layer's own input; see
runtime/fastdecode.py) against the experts the layer's router then picks.

No reads are measured here (every prediction is only recorded), so the numbers hold still on a loaded machine:

- recall: share of the picked experts that the prediction named (what ``bench``'s "prefetch recall" reports);
- precision by rank: share of the prediction's r-th expert (top-k order, most likely first) that was picked;
- read precision: of the predicted experts not in an LFU pool of ``--slots`` experts per layer (the pool fed by the
  picked experts only, as a step's prepare() feeds it), the share that was picked: what a prefetch read of them
  would be worth (the rest are wasted reads); and the predicted-and-missing experts per token (reads issued).

Decode from ``-p`` random token ids (a random-weight model routes no better on text), or with ``--text`` from a
text prompt with greedy sampling (a trained model: the embedded default one)::

    python tools/lookahead_recall.py -m q30b-8l-q4_k_m.gguf -n 64 --slots 47
    python tools/lookahead_recall.py -m src/moestream/data/default.gguf --text "Once upon a time" -n 64 --slots 16
"""

from __future__ import annotations

import argparse
import os
import random
from collections import defaultdict

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-p", "--prompt", type=int, default=16, help="random prompt tokens (without --text)")
    ap.add_argument("--text", default=None, help="a text prompt, greedy decode")
    ap.add_argument("-n", "--steps", type=int, default=64, help="decode tokens")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=0, help="pool size per layer for the read precision (0: half)")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    os.environ["MOESTREAM_LOOKAHEAD"] = "both"
    from moestream.engine import Engine
    from moestream.models.base import LoadOptions, load_model
    from moestream.options import set_compute_threads
    from moestream.runtime import fastdecode

    set_compute_threads(a.threads, "blocks")
    probe = load_model(a.model, LoadOptions(metadata_only=True))
    n_exp, top_k = probe.n_experts, probe.top_k
    slots = a.slots or n_exp // 2
    # every expert in the pool: predictions recorded, nothing read for them
    model = load_model(a.model, LoadOptions(slots=n_exp, prefetch=True, direct_io=False))
    engine = Engine(model)
    store = model.store
    rec: list[tuple[str, int, list[int]]] = []  # (kind, layer, experts)
    on = [False]

    def prefetch(layer, experts, pinned=(), read=True, cancel=False):  # noqa: ANN001, ANN202
        if on[0]:
            rec.append(("input" if cancel else "early", layer, list(experts)))
        return 0

    orig_prepare = store.prepare

    def prepare(layer, experts, pinned=()):  # noqa: ANN001, ANN202
        if on[0]:
            rec.append(("used", layer, list(experts)))
        return orig_prepare(layer, experts, pinned)

    store.prefetch, store.prepare = prefetch, prepare
    rng = random.Random(a.seed)
    if a.text:
        from moestream.cli import _tokenizer
        from moestream.gguf import GGUFModel
        prompt = _tokenizer(GGUFModel(a.model)).encode(a.text, add_special=True)
    else:
        prompt = [rng.randrange(model.n_vocab) for _ in range(a.prompt)]
    cache = model.new_cache(len(prompt) + a.steps + 1)
    with torch.inference_mode():
        logits = engine.prefill(prompt, cache)
        if fastdecode.plan(model) is None:
            raise SystemExit("the fast decode step does not apply to this model")
        on[0] = True
        tok = int(logits.reshape(-1, logits.shape[-1])[-1].argmax()) if a.text else rng.randrange(model.n_vocab)
        pos = len(prompt)
        for _ in range(a.steps):
            out = engine.decode_step(tok, pos, cache)
            pos += 1
            tok = int(out.reshape(-1)[:model.n_vocab].argmax()) if a.text else rng.randrange(model.n_vocab)
    store.close()
    # per layer: the last predictions of each kind before its prepare
    pending: dict[int, dict[str, list[int]]] = defaultdict(dict)
    hits = {k: [0, 0] for k in ("early", "input")}
    by_rank = {k: np.zeros((top_k, 2)) for k in ("early", "input")}
    reads = {k: [0, 0] for k in ("early", "input")}  # predicted and not in the pool: (issued, of those used)
    reads_rank = {k: np.zeros((top_k, 2)) for k in ("early", "input")}
    pool: dict[int, dict[int, int]] = defaultdict(dict)  # layer -> expert -> uses (LFU)
    tokens = 0
    for kind, layer, experts in rec:
        if kind != "used":
            pending[layer][kind] = experts
            continue
        if layer == min(pending or {layer: 0}):
            tokens += 1
        used = set(experts)
        p = pool[layer]
        for k, pred in pending.pop(layer, {}).items():
            hits[k][0] += len(used)
            hits[k][1] += sum(e in pred for e in used)
            for r, e in enumerate(pred[:top_k]):
                by_rank[k][r] += (1, e in used)
            out = [e for e in pred if e not in p]
            for r, e in enumerate(pred[:top_k]):
                if e not in p:
                    reads_rank[k][r] += (1, e in used)
            reads[k][0] += len(out)
            reads[k][1] += sum(e in used for e in out)
        for e in experts:  # LFU pool fed by the picked experts
            if e not in p and len(p) >= slots:
                del p[min(p, key=p.get)]
            p[e] = p.get(e, 0) + 1
    n_tok = max(a.steps, 1)
    print(f"{os.path.basename(a.model)}: {n_exp} experts, top-{top_k}, {a.steps} decode tokens, "
          f"{'text' if a.text else 'random ids'}; read precision over an LFU pool of {slots} per layer")
    for k in ("early", "input"):
        if not hits[k][0]:
            continue
        ranks = " ".join(f"{100 * h / max(n, 1):.0f}" for n, h in by_rank[k])
        print(f"  {k:5s}: recall {100 * hits[k][1] / hits[k][0]:.1f}%; precision by rank (%) {ranks}; reads "
              f"{reads[k][0] / n_tok:.1f}/token, read precision {100 * reads[k][1] / max(reads[k][0], 1):.1f}%")
        print("         read precision by rank (%, reads/token): " + " ".join(
            f"{100 * h / max(n, 1):.0f} ({n / n_tok:.1f})" for n, h in reads_rank[k]))


if __name__ == "__main__":
    main()
