"""The compile report's analysis column: what a launch does per token, argued from its block sizes.

Each op's `specs.py` attaches a `Work` to its `KernelCase`s: per token (a query row of the launch),
the FLOPs the op needs (`useful_flops`: 2 x the multiply-adds of the op's formula, counted once),
the FLOPs the kernel issues (`issued_flops`: every `tl.dot` of the launch at its block sizes,
recomputation and padding counted), the bytes it reads from global memory (`read_bytes`: every
load the kernel issues, gathers and re-reads counted, whether L2 would serve them or not) and the
bytes it writes (`write_bytes`: stores plus atomic adds). These are formulas over the launch's own
arguments, written next to the planning function they describe, not measurements.

From the compiled kernel the report adds the tensor-core instruction shapes in the PTX
(`wgmma_shapes`: static instruction counts per shape, e.g. `m64n64k16 x 32`) and the occupancy
(`occupancy`: resident CTAs per SM from registers, shared memory and threads).

`roofline` turns a `Work` into an **estimate** of the time per token on an H100 SXM
(`H100`: 989 TFLOPS dense bf16, 3.35 TB/s HBM3): max(issued FLOPs / peak, bytes moved / bandwidth),
and the useful TFLOPS that time implies. It ignores L2 hits (a re-read served by L2 is counted at
HBM cost), latency, occupancy and the tensor cores' real efficiency: an upper bound on speed
that ranks designs by what they issue and move; a measurement on a GPU replaces it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# H100 SXM5 peaks used by the roofline estimate (NVIDIA's datasheet figures, dense bf16, HBM3).
H100 = dict(name="H100 SXM", flops=989e12, bytes_per_s=3.35e12)

# Per-SM resources of the architectures the report compiles for (compute capability ->).
SM_RESOURCES = {
    80: dict(regs=65536, smem=164 * 1024, threads=2048, ctas=32),
    90: dict(regs=65536, smem=228 * 1024, threads=2048, ctas=32),
    100: dict(regs=65536, smem=228 * 1024, threads=2048, ctas=32),
}
SMEM_RESERVED_PER_CTA = 1024  # the driver reserves 1 KB of shared memory per resident CTA


@dataclass(frozen=True)
class Work:
    """Per token (one query row of the launch): see the module docstring. `anchor` names the
    figures of the reference design for the same op (e.g. FlashMLA's bytes per token), when
    there is one, as a dict of the same keys plus `name`."""

    useful_flops: float
    issued_flops: float
    read_bytes: float
    write_bytes: float
    anchor: dict = field(default_factory=dict)
    gather_bytes: float | None = None  # of read_bytes, the rows gathered by index (sparse kernels)

    @property
    def recompute(self) -> float:
        """issued / useful FLOPs (1.0 = nothing recomputed or padded)."""
        return self.issued_flops / self.useful_flops if self.useful_flops else float("nan")


def roofline(work: Work, peak: dict = H100, replication: float = 1.0) -> dict:
    """The roofline **estimate** for one token: seconds, the bound that sets it, useful TFLOPS.
    `replication`: the compiled kernel's warp-group replication of its dots
    (`warpgroup_replication`), multiplying the FLOPs the tensor cores actually execute."""
    t_compute = work.issued_flops * replication / peak["flops"]
    t_memory = (work.read_bytes + work.write_bytes) / peak["bytes_per_s"]
    seconds = max(t_compute, t_memory)
    return dict(seconds=seconds, bound="compute" if t_compute >= t_memory else "memory",
                useful_tflops=work.useful_flops / seconds / 1e12 if seconds else float("nan"))


_WGMMA_SHAPE = re.compile(r"\bwgmma\.mma_async\S*?\.(m\d+n\d+k\d+)\b")
_MMA_SYNC_SHAPE = re.compile(r"\bmma\.sync\S*?\.(m\d+n\d+k\d+)\b")


def instruction_shapes(ptx: str) -> dict[str, dict[str, int]]:
    """Static counts of the tensor-core instructions per shape in the PTX:
    {"wgmma": {"m64n64k16": 32, ...}, "mma_sync": {"m16n8k16": 36}}."""
    out = {}
    for key, pattern in (("wgmma", _WGMMA_SHAPE), ("mma_sync", _MMA_SYNC_SHAPE)):
        counts: dict[str, int] = {}
        for shape in pattern.findall(ptx):
            counts[shape] = counts.get(shape, 0) + 1
        out[key] = dict(sorted(counts.items(), key=lambda kv: -kv[1]))
    return out


_MMA_V3_LAYOUT = re.compile(r"^#(mma\d*) = #ttg\.nvidia_mma<\{versionMajor = 3,.*?warpsPerCTA = \[(\d+), (\d+)\]"
                            r".*?instrShape = \[\d+, (\d+), \d+\]", re.M)
_WG_DOT = re.compile(r"ttng\.warp_group_dot .*?: (?:!ttg\.memdesc|tensor)<(\d+)x(\d+)x[^>]*>.*?"
                     r"-> tensor<(\d+)x(\d+)xf32, #(mma\d*)>")


def warpgroup_replication(ttgir: str) -> dict:
    """Dots that Triton's layout makes several warp groups compute alike, from the TTGIR.

    A wgmma layout (`#ttg.nvidia_mma`, version 3) with warpsPerCTA [wm, wn] and instruction
    width n covers a [16 wm, n wn] tile; a smaller [M, N] result is broadcast over the rest, i.e.
    computed max(1, 16 wm / M) x max(1, n wn / N) times. Triton assigns all warps to M for a dot
    whose result feeds another dot (the flash-attention layout), so with 8 warps an M = 64 logits
    tile is computed by both warp groups. -> {"ratio": FLOPs the dots issue over their FLOPs
    counted once (each dot of the IR once, the loop body's dots dominate), "replicated": ["MxNxK
    xR", ...]}."""
    layouts = {m.group(1): tuple(int(g) for g in m.group(2, 3, 4)) for m in _MMA_V3_LAYOUT.finditer(ttgir)}
    once = issued = 0.0
    replicated = []
    for line in ttgir.splitlines():
        m = _WG_DOT.search(line)
        if not m or m.group(5) not in layouts:
            continue
        k = int(m.group(2))
        rows, cols = int(m.group(3)), int(m.group(4))
        wm, wn, inst_n = layouts[m.group(5)]
        rep = max(1, 16 * wm // rows) * max(1, inst_n * wn // cols)
        flops = 2.0 * rows * cols * k
        once += flops
        issued += flops * rep
        if rep > 1:
            replicated.append(f"{rows}x{cols}x{k} x{rep}")
    return dict(ratio=round(issued / once, 3) if once else 1.0, replicated=replicated)


def occupancy(registers: int, num_warps: int, shared_bytes: int, cap: int) -> dict:
    """Resident CTAs (and warps) per SM and what limits them: registers (allocated per warp in
    units of 256, i.e. per thread rounded up to a multiple of 8), shared memory (plus the 1 KB the
    driver reserves per CTA), threads, or the CTA limit."""
    res = SM_RESOURCES[cap]
    threads = num_warps * 32
    regs_per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    limits = {
        "registers": res["regs"] // (regs_per_warp * num_warps),
        "shared": res["smem"] // (shared_bytes + SMEM_RESERVED_PER_CTA),
        "threads": res["threads"] // threads,
        "ctas": res["ctas"],
    }
    ctas = min(limits.values())
    return dict(ctas=ctas, warps=ctas * num_warps, limit=min(limits, key=limits.get))


def mb(x: float) -> str:
    return f"{x / 1e6:.2f} MB"


def describe_dict(d: dict) -> str:
    """One line of the text report for the JSON form (`as_dict`), anchor included."""
    est = d["estimate"]
    rep = d.get("replication", 1.0)
    if d["recompute"] is None:  # no dot products
        flops = "no dot products"
    else:
        flops = (f"useful {d['useful_flops_per_token'] / 1e9:.2f} GF, tl.dot issues {d['issued_flops_per_token'] / 1e9:.2f} GF "
                 f"(x{d['recompute']:.2f}" + (f"; x{d['recompute'] * rep:.2f} with the warp-group replication"
                                               if rep != 1.0 else "") + ")")
    speed = (f"{est['useful_tflops']:.0f} TFLOPS" if d["recompute"] is not None
             else f"{est['seconds_per_token'] * 1e6:.3f} us per token")
    gathered = d.get("gather_bytes_per_token")
    text = (f"{flops}, read {mb(d['read_bytes_per_token'])}"
            + (f" (gathered rows {mb(gathered)})" if gathered is not None else "") + f", write {mb(d['write_bytes_per_token'])}; "
            f"estimate {speed} ({est['bound']}-bound)")
    anchor = d.get("anchor")
    if anchor:
        text += f"; {anchor['name']}: " + ", ".join(
            f"{k.replace('_', ' ')} {mb(v) if 'bytes' in k else f'{v:.3f}' if k.endswith('_over_useful') else f'{v / 1e9:.2f} GF'}"
            for k, v in anchor.items() if k != "name")
    return text


def as_dict(work: Work | None, peak: dict = H100, replication: float = 1.0) -> dict | None:
    """The JSON form of a `Work` with its roofline estimate (labelled as such); `replication` as
    in `roofline` (the compile report passes the compiled kernel's)."""
    if work is None:
        return None
    est = roofline(work, peak, replication)
    return dict(useful_flops_per_token=work.useful_flops, issued_flops_per_token=work.issued_flops,
                recompute=round(work.recompute, 4) if work.useful_flops else None, replication=replication, read_bytes_per_token=work.read_bytes,
                write_bytes_per_token=work.write_bytes, gather_bytes_per_token=work.gather_bytes,
                anchor=work.anchor or None,
                estimate=dict(machine=peak["name"], seconds_per_token=est["seconds"], bound=est["bound"],
                              useful_tflops=round(est["useful_tflops"], 1),
                              note="roofline estimate from issued FLOPs (x warp-group replication) and bytes, "
                                   "not a measurement"))


def budget_anchor(name: str, parts: list, useful_flops: float, factor: float) -> dict:
    """An `anchor` for a kernel that is one launch of a step with a FLOP budget (issue 32's fused
    KL: the indexer-lse pre-pass + the fused pass, together at most `factor` x the useful FLOPs of
    one pass): the step's issued FLOPs and bytes per token (the `Work`s of its launches, `parts`,
    added), the budget, and the step's issued over useful FLOPs (`issued_over_useful`, printed as
    a plain number)."""
    issued = sum(w.issued_flops for w in parts)
    return dict(name=name, issued_flops=issued, read_bytes=sum(w.read_bytes for w in parts),
                write_bytes=sum(w.write_bytes for w in parts), budget_flops=factor * useful_flops,
                issued_over_useful=issued / useful_flops)
