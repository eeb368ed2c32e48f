"""``--mem SIZE``: the memory moestream may use in all, and the slot pools sized to fit it.

A plan adds up what a run holds besides the pools -- the process itself (interpreter, torch, the kernels, the
tokenizer: measured as this process's resident memory less the dense weights it holds), the resident dense
weights, the KV cache for the context, and scratch (activations of one prefill chunk, logits, the kernels'
per-call buffers) -- and gives the slot pools what is left: as many slots per MoE layer as fit, at least top-k
(a step needs its top-k experts at once), at most every expert (then nothing is evicted: each expert is read
once). What does not divide evenly goes to the layers whose slots are cheapest, one slot each, layer order.

Without ``--mem`` and ``--slots`` the budget is the memory available at start (``MemAvailable``, or what the
process's memory cgroup still allows when tighter) plus what this process already holds, less
:data:`AUTO_MARGIN_SHARE` of it (at least :data:`AUTO_MARGIN_MIN`), which is left to the rest of the machine.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import psutil

from .errors import ConfigError

GiB = 2**30
MiB = 2**20

#: Share of the auto budget (memory available at start) left to the rest of the machine.
AUTO_MARGIN_SHARE = 0.10
#: ... and at least this many bytes.
AUTO_MARGIN_MIN = 256 * MiB
#: Fixed part of the scratch estimate: allocator slack, torch's and glibc's arenas, Python objects of a run.
SCRATCH_FIXED = 48 * MiB
#: Room the suggested smallest --mem leaves for the process measure moving between starts (bytes).
PROCESS_JITTER = 40 * MiB
#: Smallest --mem accepted at all (the interpreter and torch alone take more).
MIN_MEM = 64 * MiB
#: Host memory a CUDA run takes after its plan is made, which the plan's measured ``process`` cannot see yet
#: (``--pool host``: pools in pinned host memory under ``--mem``). Measured with benchmarks/host_mem_probe.py on
#: the H200 machine (torch 2.11, Triton 3.6, q32.gguf, ``--pool host --mem 5GiB`` in an 8 GiB cgroup;
#: benchmarks/gpu-h200/2026-12-04-session3/pin): the CUDA context, when the plan is made before it exists (RSS
#: 500 -> 623 MiB), and the kernels' module loads and compiles from the load to the 32nd token (anonymous memory
#: 441 -> 901 MiB, Triton's cache already warm: the same growth either way).
CUDA_CONTEXT_HOST = 128 * MiB
CUDA_KERNELS_HOST = 480 * MiB


def parse_mem(text: str, option: str = "--mem") -> int:
    """``--mem``'s value in bytes (sizes as ``--mem-cap``: K/M/G/T and KiB.. powers of 2, KB.. powers of 10, no unit =
    bytes). ConfigError naming ``option`` for an empty, malformed or absurd value."""
    from .memcap import parse_size

    if text is None or not str(text).strip():
        raise ConfigError(f"{option}: the value is empty (e.g. 4GiB)" + (
            f"; to size the pools from the free memory, leave {option} out" if option in ("--mem", "--gpu-mem")
            else ""))
    try:
        n = parse_size(text)
    except ConfigError as e:
        raise ConfigError(str(e).replace("--mem-cap", option)) from None
    if n < MIN_MEM:
        raise ConfigError(f"{option} {text.strip()}: below the 64 MiB minimum (a number without a unit is bytes)")
    if n >= 2**63:
        raise ConfigError(f"{option} {text}: {n} bytes is more than any machine has")
    return n


def process_rss(exclude: tuple[str, ...] | list[str] = ()) -> int:
    """Resident memory of this process now, bytes, less the pages of memory maps of the files ``exclude`` (the
    model's GGUF parts: expert or embedding pages touched through a map are page cache a cap can reclaim, not
    memory the process holds). From /proc/self/smaps_rollup where none of ``exclude`` is mapped (/proc/self/maps; the
    kernel's sum: a few times faster than reading the 20 lines per mapping of a process that imported torch), else
    /proc/self/smaps; psutil's RSS where neither can be read."""
    skip = {os.path.realpath(p) for p in exclude}
    with contextlib.suppress(OSError, ValueError, IndexError):
        mapped = False
        if skip:
            with open("/proc/self/maps") as f:
                mapped = any(len(parts := line.split(None, 5)) > 5 and parts[5].strip() in skip for line in f)
        if not mapped:
            with open("/proc/self/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        return int(line.split()[1]) * 1024
    try:
        total, counting = 0, True
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if not head.endswith(":"):  # a mapping's header: "start-end perms offset dev inode [path]"
                    parts = line.split(None, 5)
                    path = parts[5].strip() if len(parts) > 5 else ""
                    counting = not (path and path in skip)
                elif head == "Rss:" and counting:
                    total += int(line.split()[1]) * 1024
        return total
    except (OSError, ValueError, IndexError):
        return psutil.Process().memory_info().rss


def _cgroup_available() -> int | None:
    """Bytes this process's memory cgroups still allow (limit - usage + reclaimable file pages), the tightest
    over the cgroup and its ancestors, for cgroup v2 (``memory.max``) and v1 (``memory.limit_in_bytes``); None
    when no limit applies or none can be read."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    best: int | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        ctrl, path = parts[1], parts[2].strip("/")
        if ctrl == "":  # v2: the unified hierarchy, at /sys/fs/cgroup or (hybrid set-ups) /sys/fs/cgroup/unified
            root = "/sys/fs/cgroup" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else "/sys/fs/cgroup/unified"
            names = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in ctrl.split(","):
            root, names = "/sys/fs/cgroup/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                    "total_inactive_file")
        else:
            continue
        segs = path.split("/") if path else []
        for k in range(len(segs), -1, -1):
            d = os.path.join(root, *segs[:k])
            try:
                limit_text = open(os.path.join(d, names[0])).read().strip()
                if limit_text == "max" or int(limit_text) >= 2**60:
                    continue
                usage = int(open(os.path.join(d, names[1])).read())
                inactive = 0
                for stat in open(os.path.join(d, "memory.stat")).read().splitlines():
                    key, _, value = stat.partition(" ")
                    if key == names[2]:
                        inactive = int(value)
            except (OSError, ValueError):
                continue
            left = max(int(limit_text) - usage + inactive, 0)
            best = left if best is None else min(best, left)
    return best


def available_memory() -> int:
    """Bytes of memory available now: the system's (``MemAvailable``) or, when tighter, what the process's
    memory cgroup still allows (a container's or ``--mem-cap``'s limit)."""
    avail = psutil.virtual_memory().available
    cg = _cgroup_available()
    return avail if cg is None else min(avail, cg)


def capped_budget(limit: int) -> int:
    """The budget bench gives a row under ``--mem-cap`` of ``limit`` bytes when neither ``--mem`` nor ``--slots``
    is given: what :func:`auto_budget` leaves in a fresh cgroup of that limit, the limit less its margin
    (:data:`AUTO_MARGIN_SHARE`, at least :data:`AUTO_MARGIN_MIN`), so a capped row measures what ``run`` does
    there. A plan of the whole limit leaves the file pages the process maps (the libraries' code, the token
    embeddings' map) no room beyond their size at start: at the limit every new page reclaims some of them and
    they fault back in (2-core, 8-layer file, 1.6 GiB cap: 563 minor faults per token with the whole cap, 6 with
    1.4 GiB; tools/profile_capped.py)."""
    return max(limit - max(int(AUTO_MARGIN_SHARE * limit), AUTO_MARGIN_MIN), MIN_MEM)


def auto_budget() -> tuple[int, str]:
    """(bytes, description) of the budget when neither --mem nor --slots is given (see the module docstring)."""
    avail, rss = available_memory(), process_rss()
    have = avail + rss  # this process's own pages are part of what the plan prices (its "process" part)
    margin = max(int(AUTO_MARGIN_SHARE * have), AUTO_MARGIN_MIN)
    return max(have - margin, 0), (f"{have / GiB:.2f} GiB at start (available {avail / GiB:.2f} + this process "
                                   f"{rss / GiB:.2f}) less a {margin / GiB:.2f} GiB margin "
                                   f"({AUTO_MARGIN_SHARE:.0%}, at least {AUTO_MARGIN_MIN // MiB} MiB)")


@dataclass
class MemoryPlan:
    """What a run holds, bytes. ``slots``: slots per MoE layer (real layer index -> count). ``budget``: the
    memory asked for; ``source``: where it came from (``--mem 4GiB`` or the auto budget's description)."""

    budget: int
    source: str
    process: int
    dense: int
    kv: int
    n_ctx: int
    scratch: int
    slots: dict[int, int]
    pools: int
    n_experts: int
    top_k: int
    minimum: int  # the smallest budget that works (top-k slots in every layer)
    all_fit: bool = False
    notes: list[str] = field(default_factory=list)
    #: what the budget covers: "memory" (host) or "GPU memory" (--gpu-mem: pools in VRAM)
    kind: str = "memory"
    #: where every expert fits, what the lines add about resident mode (the CPU's: "--moe-stream off reads them in
    #: place"), or ""
    resident_hint: str = ""
    #: bytes of the host tier (--host-cache) this budget holds besides the pools
    tier: int = 0
    #: KV caches of ``n_ctx`` tokens in ``kv`` (serve -np N: one per slot)
    n_seqs: int = 1

    @property
    def ctx_desc(self) -> str:
        """``"4096 tokens"`` or, with several KV caches, ``"4 x 4096 tokens"``."""
        return f"{self.n_ctx} tokens" if self.n_seqs == 1 else f"{self.n_seqs} x {self.n_ctx} tokens"

    @property
    def fixed(self) -> int:
        """Everything but the pools."""
        return self.process + self.dense + self.kv + self.scratch + self.tier

    @property
    def left(self) -> int:
        return self.budget - self.fixed - self.pools

    def slots_desc(self) -> str:
        """``"32 slots/layer"`` or ``"32-33 slots/layer"``."""
        lo, hi = min(self.slots.values()), max(self.slots.values())
        return f"{lo} slots/layer" if lo == hi else f"{lo}-{hi} slots/layer"

    def _hint(self) -> str:
        return f"; {self.resident_hint}" if self.resident_hint else ""

    def line(self) -> str:
        """One line for stderr: the plan's parts."""
        fit = f", every expert fits: nothing is evicted{self._hint()}" if self.all_fit else ""
        return (f"{self.kind} plan: {self.source} = process {self.process / GiB:.2f} + dense {self.dense / GiB:.2f} "
                f"+ KV "
                f"{self.kv / GiB:.2f} ({self.ctx_desc}) + scratch {self.scratch / GiB:.2f} + "
                + (f"host tier {self.tier / GiB:.2f} + " if self.tier else "") + "pools "
                f"{self.pools / GiB:.2f} GiB ({self.slots_desc()} of {self.n_experts}{fit}), "
                f"{self.left / GiB:.2f} GiB left")

    def lines(self) -> list[str]:
        """``inspect --mem``'s report."""
        out = [
            f"{self.kind + ' plan':<15} {self.source}: {self.budget / GiB:.3f} GiB",
            (f"  process       {self.process / GiB:.3f} GiB (interpreter, torch, kernels, tokenizer: measured here; "
             f"run measures its own)" if self.kind == "memory" else
             "  process       - (the CUDA context is outside this budget: free GPU memory at start excludes it)"),
            f"  dense weights {self.dense / GiB:.3f} GiB (resident)",
            f"  KV cache      {self.kv / GiB:.3f} GiB ({self.ctx_desc})",
            f"  scratch       {self.scratch / GiB:.3f} GiB (activations of one prefill chunk, logits, kernel buffers)",
            *([f"  host tier     {self.tier / GiB:.3f} GiB (--host-cache)"] if self.tier else []),
            f"  slot pools    {self.pools / GiB:.3f} GiB: {self.slots_desc()} of {self.n_experts} experts "
            f"({100 * sum(self.slots.values()) / (self.n_experts * len(self.slots)):.1f}% of experts"
            + (f"; every expert fits, nothing is evicted{self._hint()}" if self.all_fit else "") + ")",
            f"  left          {self.left / GiB:.3f} GiB",
            (f"  minimum       about {self.minimum / GiB:.3f} GiB ({self.top_k} slots per layer, the top-k; "
             f"the process part is this process's, run measures its own, often tens of MiB more: give run --mem "
             f"{_size_text(self.minimum + process_margin(self.minimum, self.process))} or more)"
             if self.process else
             f"  minimum       {self.minimum / GiB:.3f} GiB ({self.top_k} slots per layer, the top-k)"),
        ]
        return out + [f"  note          {n}" for n in self.notes]


def plan_pools(budget: int, source: str, *, process: int, dense: int, kv: int, n_ctx: int, scratch: int,
               slot_bytes: dict[int, int], n_experts: dict[int, int], top_k: int, what: str,
               strict: bool = True, option: str = "--mem", kind: str = "memory", tier: int = 0,
               n_seqs: int = 1) -> MemoryPlan:
    """Slots per layer for ``budget`` bytes in all (see the module docstring).

    slot_bytes: bytes of one slot of each MoE layer (all its expert matrices, padding included); n_experts:
    experts of each layer. ``kv``: the bytes of ``n_seqs`` KV caches of ``n_ctx`` tokens. ``what``: the file, for
    the error. When ``top_k`` slots per layer do not fit:
    ConfigError with the smallest budget that works, or (not ``strict``: the auto budget, which nobody asked
    for) the plan of that smallest budget, with a note saying so.
    """
    fixed = process + dense + kv + scratch + tier
    layers = sorted(slot_bytes)
    min_slots = {la: min(top_k, n_experts[la]) for la in layers}
    minimum = fixed + sum(slot_bytes[la] * min_slots[la] for la in layers)
    notes = []
    if minimum > budget and not strict:
        notes.append(f"{source} is less than the {minimum / GiB:.2f} GiB that top-k slots per layer need: planned "
                     f"for that")
        budget, source = minimum, f"{source}, raised to the minimum"
    if minimum > budget:
        # the process part is measured, and moves by 10-20 MiB from one start to the next: the size suggested
        # leaves room for that, so that running with it works
        margin = process_margin(minimum, process)
        need = _size_text(minimum + margin)
        ctx = n_ctx if n_seqs == 1 else f"{n_seqs} x {n_ctx}"
        raise ConfigError(
            f"{what}: {source} is too small: process {process / GiB:.2f} + dense weights {dense / GiB:.2f} + KV cache "
            f"{kv / GiB:.2f} ({ctx} tokens) + scratch {scratch / GiB:.2f} + "
            + (f"host tier {tier / GiB:.2f} + " if tier else "") + f"{top_k} slots per layer "
            f"{(minimum - fixed) / GiB:.2f} GiB = {minimum / GiB:.2f} GiB; {option} {need} works"
            + (f" (that sum and {margin // MiB} MiB of room for the process's size, which moves between starts)"
               if margin else "")
            + (" (or a smaller context)" if kv > 64 * MiB else ""))
    room = budget - fixed
    # the largest uniform count that fits (clamped per layer to its experts), then one more slot each for the
    # cheapest layers while it fits
    lo, hi = max(min_slots.values()), max(n_experts.values())

    def cost(n: int) -> int:
        return sum(slot_bytes[la] * max(min_slots[la], min(n, n_experts[la])) for la in layers)

    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= room:
            lo = mid
        else:
            hi = mid - 1
    slots = {la: max(min_slots[la], min(lo, n_experts[la])) for la in layers}
    used = cost(lo)
    for la in sorted(layers, key=lambda la: (slot_bytes[la], la)):
        if slots[la] < n_experts[la] and used + slot_bytes[la] <= room:
            slots[la] += 1
            used += slot_bytes[la]
    all_fit = all(slots[la] == n_experts[la] for la in layers)
    return MemoryPlan(budget=budget, source=source, process=process, dense=dense, kv=kv, n_ctx=n_ctx,
                      scratch=scratch, slots=slots, pools=used, n_experts=max(n_experts.values()), top_k=top_k,
                      minimum=minimum, all_fit=all_fit, notes=notes, kind=kind, tier=tier, n_seqs=n_seqs)


def cuda_host_growth() -> int:
    """Bytes of host memory a CUDA run will add to the process after its plan is measured: the kernels' share
    (:data:`CUDA_KERNELS_HOST`) and, while this process has no CUDA context yet (``inspect``, or a plan made before
    the first tensor reaches the GPU), the context's (:data:`CUDA_CONTEXT_HOST`)."""
    import sys

    torch = sys.modules.get("torch")
    ready = torch is not None and torch.cuda.is_initialized()
    return CUDA_KERNELS_HOST + (0 if ready else CUDA_CONTEXT_HOST)


def process_margin(minimum: int, process: int) -> int:
    """Room the smallest --mem suggested for a plan of ``minimum`` bytes leaves for the process's size, which is
    measured by each start (0 when the plan has no process part)."""
    return max(PROCESS_JITTER, minimum // 50) if process else 0


def _size_text(n: int) -> str:
    """``n`` bytes rounded up to 10 MiB, as --mem takes it: ``"470MiB"``, ``"12.35GiB"`` (rounded up)."""
    n = -(-n // (10 * MiB)) * (10 * MiB)
    if n < 10 * GiB:
        return f"{n // MiB}MiB"
    return f"{-(-n * 100 // GiB) / 100:.2f}GiB"


def scratch_bytes(*, n_ctx: int, ubatch: int, n_embd: int, n_vocab: int, n_head: int, top_k: int, n_ff: int,
                  logits_rows: int = 1) -> int:
    """Estimate of the scratch memory of a forward pass, bytes (float32 activations):

    one prefill chunk of T = min(ubatch, n_ctx) tokens: ~16 hidden-sized tensors (residual, norms, q/k/v, attention
    output), the routed outputs [T, top_k, hidden], the experts' intermediate [T, top_k, 2 n_ff], the attention
    scores and softmax [n_head, T, n_ctx] twice, ``logits_rows`` rows of logits (1 unless every position's logits
    are kept), plus :data:`SCRATCH_FIXED`.
    """
    t = max(1, min(ubatch, n_ctx))
    acts = 16 * t * n_embd + t * top_k * n_embd + t * top_k * 2 * n_ff + 2 * n_head * t * n_ctx
    return 4 * (acts + max(logits_rows, 1) * n_vocab) + SCRATCH_FIXED


def resolve_budget(mem: int | None, source: str | None) -> tuple[int, str]:
    """(bytes, source) of the budget: --mem's (``source`` as given, e.g. ``"--mem 4GiB"``), else the auto budget."""
    if mem is not None:
        return mem, source or f"--mem {mem}B"
    return auto_budget()


def gpu_budget(mem: int | None, source: str | None, device: object) -> tuple[int, str]:
    """(bytes, source) of the GPU memory budget: --gpu-mem's, else the device's free memory at start plus what this
    process's CUDA allocator already holds (the dense weights), less :data:`AUTO_MARGIN_SHARE` (at least
    :data:`AUTO_MARGIN_MIN`). torch.cuda.mem_get_info."""
    if mem is not None:
        return mem, source or f"--gpu-mem {mem}B"
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    have = free + torch.cuda.memory_reserved(device)
    margin = max(int(AUTO_MARGIN_SHARE * have), AUTO_MARGIN_MIN)
    return max(have - margin, 0), (f"{have / GiB:.2f} GiB of GPU memory free at start less a {margin / GiB:.2f} GiB "
                                   f"margin ({AUTO_MARGIN_SHARE:.0%}, at least {AUTO_MARGIN_MIN // MiB} MiB)")


def warn_over_available(mem: int, option: str = "--mem") -> str | None:
    """A warning when ``mem`` is more than this machine (or cgroup) has now, else None."""
    have = available_memory() + process_rss()
    if mem > have:
        return (f"warning: {option}: {mem / GiB:.2f} GiB is more than the {have / GiB:.2f} GiB available now; "
                f"the pools are sized to it as asked, and the machine may swap or kill the run")
    return None
