"""Wall time of a streaming run's start, its first prefill and its first decode steps, separately: what populating
the slot pools at start (experts/pool.py ``huge_empty``) moves from the first tokens into the load.

One process, no cap: ``load_model`` (the pools allocated and, by default, populated), ``Engine.prefill`` of ``-p``
random token ids, then ``-n`` decode steps; prints the three times and their total. Compare the pools' settings
with the environment switches, each in its own process::

    python tools/time_start.py -m q30b-8l-q4_k_m.gguf --slots 128 -t 2
    MOESTREAM_POOL_POPULATE=0 python tools/time_start.py -m q30b-8l-q4_k_m.gguf --slots 128 -t 2
    MOESTREAM_POOL_HUGEPAGE=0 MOESTREAM_POOL_POPULATE=0 python tools/time_start.py -m q8l.gguf --slots 128 -t 2
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--slots", type=int, required=True, help="slots per MoE layer")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--prompt", type=int, default=128, help="prompt tokens (random ids)")
    ap.add_argument("-n", "--steps", type=int, default=16, help="decode steps after the prefill")
    ap.add_argument("--direct-io", default="on")
    a = ap.parse_args()
    from moestream.bench import row_options
    from moestream.engine import Engine
    from moestream.models.base import load_model
    from moestream.options import set_compute_threads

    set_compute_threads(a.threads, "blocks")
    cfg = {"model": a.model, "n_prompt": a.prompt, "n_gen": a.steps, "moe_stream": True, "slots": a.slots,
           "direct_io": a.direct_io == "on", "io_threads": 8, "prefetch": False, "overlap": True}
    t0 = time.perf_counter()
    model = load_model(a.model, row_options(cfg))
    engine = Engine(model)
    t1 = time.perf_counter()
    rng = random.Random(1)
    cache = model.new_cache(a.prompt + a.steps + 1)
    engine.prefill([rng.randrange(model.n_vocab) for _ in range(a.prompt)], cache)
    t2 = time.perf_counter()
    for pos in range(a.prompt, a.prompt + a.steps):
        engine.decode_step(rng.randrange(model.n_vocab), pos, cache)
    t3 = time.perf_counter()
    print(f"load {t1 - t0:.2f} s, prefill {a.prompt} tokens {t2 - t1:.2f} s, {a.steps} decode steps {t3 - t2:.2f} s, "
          f"total {t3 - t0:.2f} s")
    model.store.close()


if __name__ == "__main__":
    main()
