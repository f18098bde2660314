"""H200 probe: where a prefill unit's time goes in the Gluon attention kernels, by source variants.

    PYTHONPATH=. python tools/attn_variant_probe.py [--cases flash-hca-4096,...] [--variants base,no_store,...]
                                                   [--out PATH]

Each variant is the kernel module's source with named text edits, loaded as a sibling module of
sparseserve.kernels and swapped in for the launcher that `sparse_mqa_attention_triton` calls; every
variant runs on the same inputs in the same process (do_bench, L2 flushed). Ablations (no_store, no_q)
compute wrong outputs on purpose: they only measure what the removed work costs; real candidates are
checked against the fp32 reference (rel_err) before they are timed.
Diagnostic; the kernel benchmark (`python -m sparseserve.benchmarks.kernels`) is the record.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
import tempfile

import torch

from sparseserve.benchmarks import kernels as kb
from sparseserve.kernels import sparse_attention as sa
from sparseserve.kernels.sparse_attention import AttnConfig, sparse_mqa_attention_ref, sparse_mqa_attention_triton

KERNELS = pathlib.Path(sa.__file__).parent
WGMMA_SRC = (KERNELS / "sparse_attention_wgmma.py").read_text()

# The unit epilogue's store of the normalised output (NUM_SPLITS == 1) and the next unit's q load.
_STORE = "            gl.store(out_rows + gl.expand_dims(offs_od, 0), out.to(out_ptr.dtype.element_ty))\n"
_Q_NEXT = "            if last & (nu < num_units):\n"

_UNIT_STORE = """\
                _store_unit(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, tok, split, hb * BLOCK_H, num_heads,
                            stride_ot, stride_oh, c_end <= c_start, offs_oh, offs_od, offs_sh, NUM_SPLITS, True)
"""
_STAGED_STORE = """\
                if NUM_SPLITS == 1 and BLOCK_N == 64:
                    out = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
                    k_tile.store(out.to(dtype))
                    _cta_barrier()
                    staged = k_tile.load(gather_layout)
                    out_rows = out_ptr + tok * stride_ot + gl.expand_dims((hb * BLOCK_H + offs_qh).to(gl.int64) * stride_oh, 1)
                    gl.store(out_rows + gl.expand_dims(offs_d, 0), staged)
                else:
""" + _UNIT_STORE.replace("                _store_unit(", "                    _store_unit(").replace(
    "                            stride_ot", "                                stride_ot")

_TOP_FENCE = "            fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads the async one\n"
_LOOP_START = "        j = 0  # tiles computed so far: ring slot j % 2\n"
_GATHER_NEXT = "            _issue_gather(kv_smem, kv_ptr, stride_kv, r_ahead, offs_d, (j + 1) % 2)\n"
_PROGRAM_END = "        _cp.wait_group(0)  # nothing may still write shared memory when the program exits\n"
# Each thread reads back exactly the elements that its next gather into the slot overwrites (both use
# gather_layout), so its own program order keeps the read before the overwrite.
_FLUSH = """\
            if NUM_SPLITS == 1 and BLOCK_N == 64:
                if pend_off >= 0:
                    staged = kv_smem.index({slot}).load(gather_layout)
                    gl.store(out_ptr + pend_off + gl.expand_dims(offs_qh.to(gl.int64) * stride_oh, 1)
                             + gl.expand_dims(offs_d, 0), staged)
                    pend_off = pend_off * 0 - 1
"""
_DEFERRED_STORE = """\
                if NUM_SPLITS == 1 and BLOCK_N == 64:
                    out = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
                    k_tile.store(out.to(dtype))
                    pend_off = tok * stride_ot + (hb * BLOCK_H).to(gl.int64) * stride_oh
                else:
""" + _UNIT_STORE.replace("                _store_unit(", "                    _store_unit(").replace(
    "                            stride_ot", "                                stride_ot")

# Variants of the wgmma kernel: name -> (edits, is an ablation whose output is not checked).
VARIANTS: dict[str, tuple[list[tuple[str, str]], bool]] = {
    "base": ([], False),
    # The output store modes of launch_wgmma_attention (OUT_STORE_MODE: 0 wgmma layout, 1 staged, 2 TMA).
    **{f"out_store_{m}": ([("OUT_STORE_MODE = 2\n", f"OUT_STORE_MODE = {m}\n")], False) for m in (0, 1)},
    # No output store at all (the division and the conversion go with it).
    "no_store": ([(_STORE, "            pass\n")], True),
    # The next unit's q is never loaded: every unit after a program's first reuses stale q.
    "no_q": ([(_Q_NEXT, "            if last & (nu < 0):\n")], True),
    "no_store_no_q": ([(_STORE, "            pass\n"), (_Q_NEXT, "            if last & (nu < 0):\n")], True),
    # Candidate: the finished tile's ring slot (free once this warpgroup's PV is done: each warpgroup
    # writes only the 256 columns its own PV read) takes the bf16 output, which is read back 16 bytes
    # per thread and stored row-contiguous (the wgmma layout stores 4 bytes per thread, 16 per row run).
    "staged_store": ([(_UNIT_STORE, _STAGED_STORE)], False),
    # Ablation: staged through shared memory, but no global store (what the staging alone costs).
    "staged_no_global": ([(_UNIT_STORE, _STAGED_STORE.replace(
        "                    gl.store(out_rows + gl.expand_dims(offs_d, 0), staged)\n",
        "                    gl.store(out_rows + gl.expand_dims(offs_d, 0), staged, mask=gl.expand_dims(offs_d, 0) < 0)\n"))],
        True),
    # Ablation: no proxy fence after the loop-top barrier (does the fence wait for the unit's stores?).
    "no_top_fence": ([(_TOP_FENCE, "\n")], True),
    # Candidate: staged, and the global store deferred to the next tile, issued while its QK^T runs.
    "staged_deferred": ([(_LOOP_START, _LOOP_START + "        pend_off = (cu * 0).to(gl.int64) - 1  # output offset of a staged unit; -1: none\n"),
                         (_GATHER_NEXT, _FLUSH.replace("{slot}", "(j + 1) % 2") + _GATHER_NEXT),
                         (_UNIT_STORE, _DEFERRED_STORE),
                         (_PROGRAM_END, _PROGRAM_END + "        _cta_barrier()\n" + _FLUSH.replace("{slot}", "j % 2").replace(
                             "            ", "        "))], False),
}


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="flash-hca-4096,pro-hca-4096,flash-csa-4096,flash-hca-32768")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tmp = pathlib.Path(tempfile.mkdtemp())
    mods = {v: load_variant(v, VARIANTS[v][0], tmp) for v in args.variants.split(",")}
    original = sa.launch_wgmma_attention
    cfg = AttnConfig(64, 64, 8, 2, 1, band_prepass=True, wgmma=True)
    res = []
    for spec in args.cases.split(","):
        model, kind, tokens = spec.split("-")
        case = kb.attn_prefill_case(model, kind, int(tokens), gen)
        ref = sparse_mqa_attention_ref(*case["args"]).float()
        for name, mod in mods.items():
            sa.launch_wgmma_attention = mod.launch_wgmma_attention
            try:
                fn = lambda a=case["args"]: sparse_mqa_attention_triton(*a, cfg)  # noqa: E731
                out = fn().float()
                err = ((out - ref).norm() / ref.norm()).item()
                t = kb._bench(fn)
            finally:
                sa.launch_wgmma_attention = original
            r = dict(case=spec, variant=name, ablation=VARIANTS[name][1], us=round(t, 1), rel_err=err,
                     bf16_frac=round(case["flops"] / (t * 1e-6) / kb.BF16_FLOPS, 3),
                     us_per_unit_per_sm=round(t * torch.cuda.get_device_properties(0).multi_processor_count
                                              / (case["tokens"] * case["heads"] // 64), 2))
            res.append(r)
            print(f"{spec:18s} {name:16s} {t:9.1f} us  {100 * r['bf16_frac']:4.0f}% bf16  "
                  f"{r['us_per_unit_per_sm']:6.2f} us/unit/SM  err {err:.2e}{' (ablation)' if r['ablation'] else ''}",
                  flush=True)
        del case, ref
        torch.cuda.empty_cache()
    if args.out:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=res),
                  open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
