"""H200 probe: where a unit's time goes in the Gluon attention kernels, by source variants.

    PYTHONPATH=. python tools/attn_variant_probe.py [--cases flash-hca-4096,...] [--variants base,no_store,...]
                                                   [--out PATH]

Each variant is the kernel module's source with named text edits, loaded as a sibling module of
sparseserve.kernels and swapped in for the launcher that `sparse_mqa_attention_triton` calls; every
variant runs on the same inputs in the same process (do_bench, L2 flushed; decode: graph replays over input sets
larger than L2). `trace` also prints the clock cycles per tile in each phase of the loop. Ablations (no_store, no_q)
compute wrong outputs on purpose: they only measure what the removed work costs; real candidates are
checked against the fp32 reference (rel_err) before they are timed.
Diagnostic; the kernel benchmark (`python -m sparseserve.benchmarks.kernels`) is the record.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import json
import pathlib
import sys
import tempfile

import torch
from attn_latency_probe import _NoLaunch  # (tools/ is this script's directory, so first on sys.path)

from sparseserve.benchmarks import kernels as kb
from sparseserve.kernels import sparse_attention as sa
from sparseserve.kernels.sparse_attention import (AttnConfig, attention_config, sparse_mqa_attention_ref,
                                                  sparse_mqa_attention_triton)

KERNELS = pathlib.Path(sa.__file__).parent
WGMMA_SRC = (KERNELS / "sparse_attention_wgmma.py").read_text()

# Ablated stores stay in the code, predicated off at run time (no unit has a negative token): a store removed
# outright leaves the accumulator without a reader, and ptxas then drops most of the PV products that feed it
# (3 of a tile's 4 HGMMA instructions, 255 -> 114-151 registers), which session 19's no_store and
# no_part_store did, so they overstated what the store costs (`tools/kernel_resources.py --variants` checks this).
_NEVER = "gl.expand_dims(offs_oh, 1) < (tok < 0).to(gl.int32) * 64"
_STORE = "            gl.store(out_rows + gl.expand_dims(offs_od, 0), out.to(out_ptr.dtype.element_ty))\n"
_STORE_OFF = f"            gl.store(out_rows + gl.expand_dims(offs_od, 0), out.to(out_ptr.dtype.element_ty), mask={_NEVER})\n"
_Q_NEXT = "            if last & (nu < num_units):\n"
_NO_Q = (_Q_NEXT, "            if last & (nu < 0):\n")  # the next unit's q never loaded (stale q)
_NO_TMA = dict(tma_store=False)
# A split's partial output: its TMA store (64-row tiles; the output still goes through the ring slot, and a
# one-split launch keeps its store), or its store from registers.
_TMA_STORE = "                            _tma_store(out_desc, [row0, c * 64], k_tile.slice(c * 64, 64, dim=1))\n"
_PART_STORE = [
    (_TMA_STORE, "                            if NUM_SPLITS == 1:\n    " + _TMA_STORE),
    ("                gl.store(acc_rows + gl.expand_dims(offs_od, 0), acc.to(part_acc_ptr.dtype.element_ty))\n",
     f"                gl.store(acc_rows + gl.expand_dims(offs_od, 0), acc.to(part_acc_ptr.dtype.element_ty), mask={_NEVER})\n"),
]

# The trace variant: warp 0 of each program reads %clock64 at six points of every tile (TRACE_TILES per program
# at most) into a buffer the launcher keeps in TRACE["last"]: the loop top, the tile's rows landed (after the
# wait and the barrier), QK^T done, the softmax's p shared (after the barrier), PV done, and the iteration's end
# (after the unit's epilogue on its last tile); slots 6 and 7 hold the unit and the tile within it. The clock
# reads are volatile asm, so the variant's own time shows what the tracing costs.
TRACE_TILES = 512
TRACE_SLOTS = 16  # per tile: marks 0-5, unit and tile (6, 7), trace_epi (8-11), trace_gather (12, 13)
_MARK = "_trace_mark(trace_ptr, offs_sh, j, {k})\n"
_TRACE = [
    ("    @gluon.jit\n    def _sparse_mqa_wgmma_kernel(\n",
     f"""    @gluon.jit
    def _trace_value(trace_ptr, offs, j, k: gl.constexpr, value):
        slot = (gl.program_id(0).to(gl.int64) * {TRACE_TILES} + j) * {TRACE_SLOTS} + k + offs * 0
        gl.store(trace_ptr + slot, value + offs * 0, mask=(offs == 0) & (j < {TRACE_TILES}))

    @gluon.jit
    def _trace_mark(trace_ptr, offs, j, k: gl.constexpr):
        clock = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [offs], dtype=gl.int64, is_pure=False,
                                          pack=1)
        _trace_value(trace_ptr, offs, j, k, clock)

    @gluon.jit
    def _sparse_mqa_wgmma_kernel(
"""),
    ("        out_desc,  # OUT_TMA:", "        out_desc, trace_ptr,  # OUT_TMA:"),
    ("            _cp.wait_group(0)\n            _cta_barrier()\n            fence_async_shared()  # cp.async wrote",
     "            " + _MARK.format(k=0) + "            _cp.wait_group(0)\n            _cta_barrier()\n"
     "            " + _MARK.format(k=1) + "            fence_async_shared()  # cp.async wrote"),
    ("            s = warpgroup_mma_wait(num_outstanding=0, deps=[s])\n",
     "            s = warpgroup_mma_wait(num_outstanding=0, deps=[s])\n            " + _MARK.format(k=2)),
    ("            _cta_barrier()  # p is whole, and both warpgroups are done with q for this tile\n",
     "            _cta_barrier()  # p is whole, and both warpgroups are done with q for this tile\n            "
     + _MARK.format(k=3)),
    ("            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])\n\n",
     "            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])\n            " + _MARK.format(k=4)
     + "            _trace_value(trace_ptr, offs_sh, j, 6, cu)\n"
     + "            _trace_value(trace_ptr, offs_sh, j, 7, ct)\n\n"),
    ("            j = j + 1\n", "            " + _MARK.format(k=5) + "            j = j + 1\n"),
    ("        *args, rows.shape[1], out_desc, NUM_SPLITS=num_splits,",
     "        *args, rows.shape[1], out_desc, _trace_buffer(min(num_units, max_programs), q.device), NUM_SPLITS=num_splits,"),
    ("\ndef wgmma_supported(", f"""
TRACE = {{}}


def _trace_buffer(programs, device):
    # Kept across calls (a graph captures its address; no fill inside the timed launches); the probe resets it.
    if TRACE.get("key") != (programs, str(device)):
        TRACE["last"] = torch.full((programs, {TRACE_TILES}, {TRACE_SLOTS}), -1, dtype=torch.int64, device=device)
        TRACE["key"] = (programs, str(device))
    return TRACE["last"]


def wgmma_supported("""),
]
_PHASES = ("rows landed", "QK^T", "softmax + p", "PV", "epilogue")
# trace_epi: four more marks in the epilogue of a unit's last tile (the TMA path), slots 8-11, between PV done (4)
# and the iteration's end (5).
_EPI_MARKS = [
    ("                l_i = _unit_row_sum(gl.sum(l_cols, 1), m_i, m_sink, split)\n", 8),
    ("                        k_tile.store(out.to(dtype))\n", 9),
    ("                        fence_async_shared()  # generic-proxy writes, read by the TMA engine\n"
     "                        _cta_barrier()\n", 10),
    ("                        tma_pending = True\n", 11),
]
_TRACE_EPI = _TRACE + [(anchor, anchor + " " * (len(anchor) - len(anchor.lstrip())) + _MARK.format(k=k))
                       for anchor, k in _EPI_MARKS]
_EPI_PHASES = ("row sums", "scale + stage", "fence + barrier", "TMA issue", "next unit's setup")
# trace_gather: how long a tile's gather takes to land while QK^T runs. The loop waits for it right after issuing
# it (marks 12 and 13) instead of a tile later, so the rest of the tile is delayed: only the marks count.
_GATHER = "            _issue_gather(kv_smem, kv_ptr, stride_kv, r_ahead, offs_d, (j + 1) % 2)\n"
_TRACE_GATHER = _TRACE + [(_GATHER, "            " + _MARK.format(k=12) + _GATHER + "            _cp.wait_group(0)\n"
                           "            " + _MARK.format(k=13))]


def trace_summary(trace: torch.Tensor) -> dict:
    """Mean clock cycles per tile in each phase (warp 0's view), over every traced tile of every program, the
    loop's own overhead (end of one tile to the top of the next), and the mean cycles per program."""
    t = trace.cpu()
    valid = t[:, :, 0] >= 0
    d = (t[:, :, 1:6] - t[:, :, 0:5]).double()[valid]  # [tiles, 5]
    gap = (t[:, 1:, 0] - t[:, :-1, 5]).double()[valid[:, 1:]]
    last_tile = torch.zeros_like(valid)
    last_tile[:, :-1] = valid[:, :-1] & (t[:, 1:, 7] == 0)  # the next tile starts a unit
    spans = [(t[p, valid[p], 5].max() - t[p, valid[p], 0].min()).item() for p in range(t.shape[0]) if valid[p].any()]
    out = {name: round(d[:, i].mean().item(), 1) for i, name in enumerate(_PHASES)}
    out["epilogue (units' last tiles)"] = round((t[:, :, 5] - t[:, :, 4]).double()[last_tile].mean().item(), 1)
    out["loop gap"] = round(gap.mean().item(), 1) if gap.numel() else 0.0
    out["tiles traced"] = int(valid.sum())
    gather = (t[:, :, 12:14] >= 0).all(-1) if t.shape[2] >= 14 else torch.zeros_like(valid)
    if gather.any():  # trace_gather
        out["gather: issue -> landed"] = round((t[:, :, 13] - t[:, :, 12]).double()[gather].mean().item(), 1)
    epi = last_tile & (t[:, :, 8:12] >= 0).all(-1) if t.shape[2] >= 12 else torch.zeros_like(valid)
    if epi.any():  # trace_epi: the last tiles' epilogue in five pieces (marks 4, 8-11, 5)
        marks = torch.cat([t[:, :, 4:5], t[:, :, 8:12], t[:, :, 5:6]], dim=2)[epi].double()
        for i, name in enumerate(_EPI_PHASES):
            out["epilogue: " + name] = round((marks[:, i + 1] - marks[:, i]).mean().item(), 1)
    out["cycles per program"] = round(sum(spans) / max(len(spans), 1), 1)
    return out

# Variants: name -> (edits of sparse_attention_wgmma.py, launcher keyword arguments, is an ablation whose
# output is not checked). The launcher arguments apply to both Gluon kernels (wgmma and tile-pair).
VARIANTS: dict[str, tuple[list[tuple[str, str]], dict, bool]] = {
    "base": ([], {}, False),
    # Units store their output from registers (the wgmma layout: 4 bytes per thread) instead of by TMA.
    "no_tma": ([], _NO_TMA, False),
    # Ablations of the register store (session 19, before the TMA store): the output store predicated off (its
    # division and conversion stay); the next unit's q never loaded (stale q); both.
    "no_store": ([(_STORE, _STORE_OFF)], _NO_TMA, True),
    "no_q": ([_NO_Q], _NO_TMA, True),
    "no_store_no_q": ([(_STORE, _STORE_OFF), _NO_Q], _NO_TMA, True),
    # Split launches (decode): no partial output store (the (max, sum) still written); no merge kernel.
    "no_part_store": (_PART_STORE, {}, True),
    "no_merge": ([], {}, True),
    # The per-tile rescale of the accumulator by exp2(m_old - m_new) left out (the 128 multiplies per thread between
    # the softmax and PV, while the tensor cores idle): what a rescale skipped when no row's max moved could gain at most.
    "no_rescale": ([("            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)\n",
                     "")], {}, True),
    # The softmax's 4,096 exponentials per tile (MUFU: 16 per SM per clock, 256 clocks a tile) replaced by a subtraction.
    "no_exp": ([("            p = gl.exp2(s - gl.expand_dims(m_new, 1))\n", "            p = s - gl.expand_dims(m_new, 1)\n")],
               {}, True),
    # Per-phase clock marks (above); the outputs are checked as the base kernel's.
    "trace": (_TRACE, {}, False),
    # The same with the epilogue of a unit's last tile in pieces; and that without the next unit's q load (ablation:
    # does the epilogue's proxy fence wait for it?).
    "trace_epi": (_TRACE_EPI, {}, False),
    "trace_epi_no_q": (_TRACE_EPI + [_NO_Q], {}, True),
    "trace_gather": (_TRACE_GATHER, {}, False),
}
# Session 19 also timed staging the output through the unit's last ring slot and storing it 16 bytes per
# thread (Flash HCA 4K 387 us against 476 from registers and 366 by TMA), and that store deferred to the
# next tile's QK^T (756 us: the stores then delay the gathers behind them): those variants are in 374a063.


def load_variant(name: str, edits: list[tuple[str, str]], tmp: pathlib.Path):
    src = WGMMA_SRC
    for old, new in edits:
        if src.count(old) != 1:
            sys.exit(f"variant {name}: the edit anchor occurs {src.count(old)} times, expected once:\n{old}")
        src = src.replace(old, new)
    path = tmp / f"_attn_variant_{name}.py"
    path.write_text(src)  # Gluon reads the kernel's source from its file
    spec = importlib.util.spec_from_file_location(f"sparseserve.kernels._attn_variant_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "sparseserve.kernels"
    spec.loader.exec_module(mod)
    return mod


def _accepted(fn, kwargs: dict) -> dict:
    """The launcher options that fn takes (a variant's option may exist for one of the two kernels only)."""
    return {k: v for k, v in kwargs.items() if k in inspect.signature(fn).parameters}


def _config(kernel: str, case: dict, sms: int) -> AttnConfig:
    """engine: what attention_config picks for the case; wgmma / pair, optionally -sN: that Gluon kernel at N
    splits (1 if not given)."""
    q, _, rows, _, _ = case["args"]
    if kernel == "engine":
        return attention_config(q.shape[0], q.shape[1], rows.shape[1], 512, sms, wgmma=True)
    name, _, splits = kernel.partition("-s")
    return AttnConfig(64, 64, 8, 2, int(splits or 1), band_prepass=True, wgmma=True, pair=name == "pair")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="flash-hca-4096,pro-hca-4096,flash-csa-4096,flash-hca-32768",
                    help="prefill MODEL-KIND-TOKENS, or decode bBATCH-MODEL-KIND-CTX (e.g. b64-flash-csa-32768)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--kernels", default="wgmma,pair",
                    help="engine (attention_config's pick), wgmma or pair, each optionally -sN (N splits)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tmp = pathlib.Path(tempfile.mkdtemp())
    names = args.variants.split(",")
    mods = {v: load_variant(v, VARIANTS[v][0], tmp) if VARIANTS[v][0] else None for v in names}
    originals = sa.launch_wgmma_attention, sa.launch_pair_attention, sa._sparse_mqa_merge_kernel
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = []
    for spec in args.cases.split(","):
        decode = spec.startswith("b")
        if decode:
            batch, model, kind, ctx = spec.split("-")
            case = kb.attn_decode_case(model, kind, int(batch[1:]), int(ctx), gen)
            units = int(batch[1:]) * case["args"][0].shape[1] // 64
        else:
            model, kind, tokens = spec.split("-")
            case = kb.attn_prefill_case(model, kind, int(tokens), gen)
            units = case["tokens"] * case["heads"] // 64
        ref = sparse_mqa_attention_ref(*case["args"]).float()
        for kernel in args.kernels.split(","):
            cfg = _config(kernel, case, sms)
            for name in names:
                edits, kwargs, ablation = VARIANTS[name]
                if edits and cfg.pair:
                    continue  # source edits are of the wgmma kernel
                wgmma_launch = (mods[name] or sys.modules[originals[0].__module__]).launch_wgmma_attention
                sa.launch_wgmma_attention = functools.partial(wgmma_launch, **_accepted(wgmma_launch, kwargs))
                sa.launch_pair_attention = functools.partial(originals[1], **_accepted(originals[1], kwargs))
                if name == "no_merge":
                    sa._sparse_mqa_merge_kernel = _NoLaunch()
                try:
                    out = sparse_mqa_attention_triton(*case["args"], cfg).float()
                    err = ((out - ref).norm() / ref.norm()).item()
                    if decode:  # graph replays over input sets that do not fit L2, as the kernel benchmark
                        t = kb._bench_graph([(lambda a=a, c=cfg: sparse_mqa_attention_triton(*a, c)) for a in case["sets"]])
                    else:
                        t = kb._bench(lambda a=case["args"], c=cfg: sparse_mqa_attention_triton(*a, c))
                    phases = None
                    if name.startswith("trace") and cfg.wgmma and not cfg.pair:  # one more eager call on the timed inputs: its marks
                        mods[name].TRACE["last"].fill_(-1)
                        sparse_mqa_attention_triton(*(case["sets"][0] if decode else case["args"]), cfg)
                        torch.cuda.synchronize()
                        phases = trace_summary(mods[name].TRACE["last"])
                finally:
                    sa.launch_wgmma_attention, sa.launch_pair_attention, sa._sparse_mqa_merge_kernel = originals
                r = dict(case=spec, kernel=kernel, config=repr(cfg), variant=name, ablation=ablation, us=round(t, 2),
                         rel_err=err, bf16_frac=round(case["flops"] / (t * 1e-6) / kb.BF16_FLOPS, 3),
                         hbm_frac=round(case["bytes"] / (t * 1e-6) / kb.HBM_BPS, 3),
                         us_per_unit_per_sm=round(t * sms / units, 2))
                if phases:
                    r["trace_cycles_per_tile"] = phases
                res.append(r)
                print(f"{spec:20s} {kernel:8s} S{cfg.num_splits} {name:14s} {t:9.1f} us  {100 * r['bf16_frac']:4.0f}% bf16 "
                      f"{100 * r['hbm_frac']:4.0f}% HBM  {r['us_per_unit_per_sm']:6.2f} us/unit/SM  err {err:.2e}"
                      f"{' (ablation)' if ablation else ''}", flush=True)
                if phases:
                    print("    cycles per tile (warp 0): " + ", ".join(f"{k} {v}" for k, v in phases.items()), flush=True)
        del case, ref
        torch.cuda.empty_cache()
    if args.out:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=res),
                  open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
