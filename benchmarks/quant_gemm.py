"""Quantized kernels against their rooflines and against bf16 cuBLAS, V4-Flash shapes, one run (H200).

    python -m benchmarks.quant_gemm [--budget-s 270] [--only linear,moe] [--out PATH] [--smoke]

Linear cases (N x K of the release's FP8 projections: q_a 1024 x 4096, q_b 32768 x 1024 (64 heads x 512),
kv 512 x 4096, o_b 4096 x 8192, the shared expert's gate+up 4096 x 4096 and down 4096 x 2048) at decode
(M = 1, 8, 64) and prefill (M = 512, 2048, 8192) sizes; routed experts (256 experts, top-6, D 4096, I 2048,
FP4 and FP8 weights) at T = 1, 8, 64, 512, 2048 (and 8192 for FP4).

Measured in the same process, each a CUDA graph replayed back to back (kernel time without launch cost), weights
cycled through copies of >= 256 MB where one call reads less, and small expert batches through shifted
routings (so every call reads its weights from HBM, not L2):
  * the kernel (`quant_linear_triton` with its table's config: act_quant + the GEMM; `fused_moe_quant_triton`);
  * the FP8 ceiling: `torch._scaled_mm` (per-tensor scales, so no block-scale work) at the same shape (M padded
    to 16 where it needs it);
  * bf16 cuBLAS (`torch.matmul`) at the same shape; for experts, the bf16 Triton grouped kernel (kernels/moe.py);
  * a read of the kernel's weight bytes (`read_sum`), the HBM ceiling a read of that size reaches.
Beside the table's config, each case times the alternatives select.py names for its size (`linear_variants`:
in the streaming row the fp16 dot and 8 warps; `moe_quant_variants`, FP4: the fp8 form the row does not take,
`fp4_one_dot` or `fp4_four_dot`, the bf16 forms (tl.dot_scaled, the scalar nibble decode), the activations
quantized inside the GEMMs and narrower gate-up tiles in the decode rows, the FP4 weight-streaming form
`fp4_gemv` / `fp4_gemv_8_warps` at T <= 16, 4 warps in the prefill rows), each
checked against the reference (or the table's output where the reference
would be slow): the case's line ends with their times and the fastest correct one, its JSON row has them under
`variants` and `fastest_variant`; a wrong or failing alternative fails the run.
Floors: bytes / copy bandwidth (measured) and FLOPs / the FP8 ceiling's rate at the same shape; `floor_us` is
the larger. Output: a line per case, the JSON file (one per run), and `quant_gemm.png` beside it when matplotlib
is installed. A case that fails records its error and the run goes on; cases past the time budget are skipped.
`--smoke` runs tiny shapes on the CPU under the Triton interpreter (checks the script, times nothing real).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks import result_file  # noqa: E402
from sparseserve.kernels.quant import reference as ref  # noqa: E402
from sparseserve.kernels.quant.formats import QuantWeight  # noqa: E402
from sparseserve.kernels.quant.linear import quant_linear_triton  # noqa: E402
from sparseserve.kernels.quant.moe_quant import fused_moe_quant_triton  # noqa: E402
from sparseserve.kernels.dispatch import num_sms  # noqa: E402
from sparseserve.kernels.quant.select import linear_variants, moe_quant_variants  # noqa: E402

LINEAR_SHAPES = [("q_a", 1024, 4096), ("q_b (64 x 512)", 32768, 1024), ("kv", 512, 4096), ("o_b", 4096, 8192),
                 ("shared gate+up", 4096, 4096), ("shared down", 4096, 2048)]
LINEAR_M = [1, 8, 64, 512, 2048, 8192]
MOE_TOKENS = {"fp4": [1, 8, 64, 512, 2048, 8192], "fp8_block": [1, 8, 64, 512, 2048]}
MOE_SHAPE = (256, 6, 4096, 2048)  # experts, top-k, D, I
SMOKE_LINEAR = [("tiny", 192, 256)]
SMOKE_M = [1, 20]
SMOKE_MOE = (8, 2, 128, 128)
COLD_BYTES = 256 << 20


class Timer:
    """CUDA graphs of `calls` calls replayed back to back (GPU); perf_counter around eager calls (smoke)."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke

    def us(self, body, calls: int) -> float:
        if self.smoke:
            t = time.perf_counter()
            body()
            return (time.perf_counter() - t) * 1e6 / calls
        from benchmarks.timing import capture_graph, replay_ms

        graph, _ = capture_graph(body, warmup=1)
        return replay_ms(graph, reps=3) * 1e3 / calls


def copies_for(nbytes: int, smoke: bool) -> int:
    return 1 if smoke else max(1, COLD_BYTES // max(nbytes, 1) + 1)


def fp8_ceiling_us(timer: Timer, m: int, n: int, k: int, device) -> tuple[float | None, str]:
    """torch._scaled_mm with per-tensor scales at [m, k] x [k, n] (m padded to 16), cold weights."""
    if timer.smoke or not hasattr(torch, "_scaled_mm"):
        return None, "not measured"
    mp = -(-m // 16) * 16
    a = torch.randn(mp, k, device=device).to(torch.float8_e4m3fn)
    w0 = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
    ws = [w0] + [w0.clone() for _ in range(copies_for(w0.nbytes, False) - 1)]
    one = torch.ones((), device=device)
    try:
        def body():
            for w in ws:
                torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        return timer.us(body, len(ws)), f"_scaled_mm per-tensor, M padded to {mp}" if mp != m else "_scaled_mm"
    except Exception as exc:  # an unsupported shape: no ceiling for this case
        return None, f"_scaled_mm failed: {type(exc).__name__}: {exc}"[:200]


def read_us(timer: Timer, tensors: list[torch.Tensor]) -> float | None:
    if timer.smoke:
        return None
    from benchmarks.ceilings import read_sum

    flat = [t.view(torch.uint8).reshape(-1).view(torch.bfloat16) for t in tensors]
    outs = [torch.empty(-(-f.numel() // 8192), dtype=torch.float32, device=f.device) for f in flat]
    return timer.us(lambda: [read_sum(f, o) for f, o in zip(flat, outs)], len(flat))


def linear_case(timer: Timer, name: str, m: int, n: int, k: int, bw: float, device, log) -> dict:
    gen = torch.Generator(device=device).manual_seed(m + n + k)
    x = torch.randn(m, k, device=device, generator=gen).bfloat16()
    w = ref.quantize_fp8_block(torch.randn(n, k, device=device, generator=gen) * k ** -0.5)
    ws = [w] + [QuantWeight(w.data.clone(), w.scale.clone(), w.fmt) for _ in range(copies_for(w.nbytes, timer.smoke) - 1)]
    got = quant_linear_triton(x, w)
    want = ref.quant_linear_ref(x, w, out_dtype=torch.float32)
    rel_err = ((got.float() - want).norm() / want.norm()).item()
    row = {"case": name, "m": m, "n": n, "k": k, "rel_err": rel_err, "correct": rel_err < 4e-3}
    row["kernel_us"] = timer.us(lambda: [quant_linear_triton(x, wc) for wc in ws], len(ws))
    configs = linear_variants(m, n, k, num_sms(x.device), interpret=timer.smoke)
    row["variants"] = time_variants(timer, configs, row["kernel_us"], want, 4e-3,
                                    lambda cfg: quant_linear_triton(x, w, config=cfg),
                                    lambda cfg: [quant_linear_triton(x, wc, config=cfg) for wc in ws], len(ws))
    wb = [ref.dequant_weight(wc).bfloat16() for wc in ws[: copies_for(n * k * 2, timer.smoke)]]
    row["bf16_cublas_us"] = timer.us(lambda: [torch.matmul(x, wc.t()) for wc in wb], len(wb))
    del wb
    row["fp8_ceiling_us"], row["fp8_ceiling_note"] = fp8_ceiling_us(timer, m, n, k, device)
    row["weight_read_us"] = read_us(timer, [wc.data for wc in ws])
    flops = 2 * m * n * k
    row["bytes"] = w.nbytes + m * k * 2 + m * n * 2 + (0 if m <= 16 else 4 * m * k)  # + act_quant's traffic
    row["flops"] = flops
    bytes_floor = row["bytes"] / bw * 1e6
    # Prefill: the FP8 tensor cores' time at this shape (the ceiling) bounds too; decode: the bytes.
    row["floor_us"] = max(bytes_floor, row["fp8_ceiling_us"] or 0.0) if m > 16 else bytes_floor
    row["kernel_tflops"] = flops / row["kernel_us"] / 1e6
    row["kernel_tb_s"] = row["bytes"] / row["kernel_us"] / 1e6
    row["share_of_fp8_ceiling"] = row["fp8_ceiling_us"] / row["kernel_us"] if row["fp8_ceiling_us"] else None
    row["share_of_hbm"] = bytes_floor / row["kernel_us"]
    row["speedup_vs_bf16"] = row["bf16_cublas_us"] / row["kernel_us"]
    log(f"linear {name:<16} M={m:<5} kernel {row['kernel_us']:8.1f} us ({row['kernel_tflops']:6.1f} TFLOP/s, "
        f"{row['kernel_tb_s']:.2f} TB/s) | fp8 ceiling {_fmt(row['fp8_ceiling_us'])} | bf16 {row['bf16_cublas_us']:8.1f}"
        f" | read {_fmt(row['weight_read_us'])} | floor {row['floor_us']:7.1f} | x{row['speedup_vs_bf16']:.2f} vs bf16"
        f" | err {rel_err:.1e}{_variants_text(row['variants'])}")
    return row


def time_variants(timer: Timer, configs: dict, table_us: float, want: torch.Tensor, tol: float,
                  one, body, calls: int) -> dict:
    """Each alternative config (select.py's *_variants) timed like the table's and checked against `want` (the
    reference, or for large expert batches the table's output): {name: {"kernel_us", "rel_err", "correct",
    "config"}}; a failure is recorded in its entry and the others go on."""
    out = {}
    for name, cfg in configs.items():
        entry: dict = {"config": dataclasses.asdict(cfg)}
        try:
            if name == "table":
                entry["kernel_us"] = table_us
            else:
                got = one(cfg)
                entry["rel_err"] = ((got.float() - want).norm() / want.norm()).item()
                entry["correct"] = entry["rel_err"] < tol
                entry["kernel_us"] = timer.us(lambda: body(cfg), calls)
        except Exception as exc:  # one config must not cost the case
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out[name] = entry
    return out


def _variants_text(variants: dict) -> str:
    if len(variants) < 2:
        return ""
    parts = [f"{name} {'FAILED' if 'error' in v else format(v['kernel_us'], '.1f')}" for name, v in variants.items()]
    return f" | variants (us): {', '.join(parts)}; fastest {fastest_variant(variants) or '-'}"


def fastest_variant(variants: dict) -> str | None:
    timed = {name: v["kernel_us"] for name, v in variants.items() if "kernel_us" in v and v.get("correct", True)}
    return min(timed, key=timed.get) if timed else None


def make_experts(fmt: str, experts: int, rows: int, cols: int, device, gen) -> QuantWeight:
    """Random experts quantized one at a time (the fp32 originals of all 256 would not fit)."""
    quant = ref.quantize_fp4 if fmt == "fp4" else ref.quantize_fp8_block
    parts = [quant(torch.randn(rows, cols, device=device, generator=gen) * cols ** -0.5) for _ in range(experts)]
    return QuantWeight(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]), fmt)


def bf16_experts(w: QuantWeight) -> torch.Tensor:
    return torch.stack([ref.dequant_weight(QuantWeight(w.data[e], w.scale[e], w.fmt)).bfloat16()
                        for e in range(w.data.shape[0])])


def moe_case(timer: Timer, fmt: str, num_tokens: int, shape: tuple[int, int, int, int], bw: float, device, log
             ) -> dict:
    from sparseserve.kernels import moe

    experts, top_k, hidden, inter = shape
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, device=device, generator=gen).bfloat16()
    q_gu = make_experts(fmt, experts, 2 * inter, hidden, device, gen)
    q_dn = make_experts(fmt, experts, hidden, inter, device, gen)
    scores = torch.rand(num_tokens, experts, device=device, generator=gen)
    weights, ids = scores.topk(top_k, dim=1)
    got = fused_moe_quant_triton(x, q_gu, q_dn, weights, ids, 10.0)
    touched = int(torch.unique(ids).numel())
    row = {"case": f"experts {fmt}", "tokens": num_tokens, "experts": experts, "top_k": top_k, "hidden": hidden,
           "inter": inter, "experts_touched": touched}
    want = got.float()  # the alternatives are checked against the table's output where there is no reference
    if num_tokens <= 64 or timer.smoke:  # the reference loops over experts: only where it is quick
        want = ref.fused_moe_quant_ref(x, q_gu, q_dn, weights, ids, 10.0).float()
        row["rel_err"] = ((got.float() - want).norm() / want.norm()).item()
        row["correct"] = row["rel_err"] < 2e-2
    # Small batches touch few experts (L2 would keep them): calls cycle through shifted routings, so each
    # reads other experts from HBM. From 512 tokens one call touches nearly all of them.
    routes = [(ids + top_k * c) % experts for c in range(8 if num_tokens <= 64 and not timer.smoke else 1)]
    row["calls_per_graph"] = len(routes)
    row["kernel_us"] = timer.us(lambda: [fused_moe_quant_triton(x, q_gu, q_dn, weights, r, 10.0) for r in routes],
                                len(routes))
    row["variants"] = time_variants(
        timer, moe_quant_variants(num_tokens, top_k, experts, fmt, interpret=timer.smoke), row["kernel_us"],
        want, 2e-2,
        lambda cfg: fused_moe_quant_triton(x, q_gu, q_dn, weights, ids, 10.0, config=cfg),
        lambda cfg: [fused_moe_quant_triton(x, q_gu, q_dn, weights, r, 10.0, config=cfg) for r in routes],
        len(routes))
    bf_gu, bf_dn = bf16_experts(q_gu), bf16_experts(q_dn)
    row["bf16_triton_us"] = timer.us(lambda: [moe.fused_moe_triton(x, bf_gu, bf_dn, weights, r, 10.0) for r in routes],
                                     len(routes))
    del bf_gu, bf_dn
    per_expert = (q_gu.nbytes + q_dn.nbytes) / experts
    row["bytes"] = int(touched * per_expert + num_tokens * hidden * 4 + num_tokens * top_k * (hidden + inter) * 2)
    row["flops"] = 6 * num_tokens * top_k * hidden * inter
    row["floor_us"] = row["bytes"] / bw * 1e6
    row["kernel_tb_s"] = row["bytes"] / row["kernel_us"] / 1e6
    row["kernel_tflops"] = row["flops"] / row["kernel_us"] / 1e6
    row["share_of_hbm"] = row["floor_us"] / row["kernel_us"]
    row["speedup_vs_bf16"] = row["bf16_triton_us"] / row["kernel_us"]
    log(f"experts {fmt:<9} T={num_tokens:<5} kernel {row['kernel_us']:8.1f} us ({row['kernel_tflops']:6.1f} TFLOP/s, "
        f"{row['kernel_tb_s']:.2f} TB/s) | bf16 Triton {row['bf16_triton_us']:8.1f} | weight-read floor "
        f"{row['floor_us']:7.1f} | x{row['speedup_vs_bf16']:.2f} vs bf16 | err {_fmt(row.get('rel_err'), '.1e')}"
        f"{_variants_text(row['variants'])}")
    return row


def _fmt(v, spec: str = "8.1f") -> str:
    return "-" if v is None else format(v, spec)


def plot(result: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # matplotlib is optional
        print(f"[quant_gemm] no plot: matplotlib is not available ({exc})")
        return None
    rows = [r for r in result["cases"] if "kernel_us" in r]
    if not rows:
        return None
    labels = [f"{r['case']} {'M' if 'm' in r else 'T'}={r.get('m', r.get('tokens'))}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.35), 5))
    xs = range(len(rows))
    ax.bar([i - 0.3 for i in xs], [r["floor_us"] / r["kernel_us"] for r in rows], 0.3, label="floor / kernel")
    ax.bar(list(xs), [(r.get("fp8_ceiling_us") or 0) / r["kernel_us"] for r in rows], 0.3,
           label="_scaled_mm / kernel")
    ax.bar([i + 0.3 for i in xs], [r["speedup_vs_bf16"] for r in rows], 0.3, label="bf16 / kernel")
    ax.axhline(0.7, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=7)
    ax.set_ylabel("time ratio (higher: kernel faster)")
    ax.set_title(f"quantized kernels, {result['card']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=result_file("quant_gemm"))
    ap.add_argument("--only", default="linear,moe", help="comma-separated: linear, moe")
    ap.add_argument("--budget-s", type=float, default=270.0, help="skip the cases that would start after this")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("quant_gemm needs a CUDA GPU (or --smoke on the CPU)")
    device = torch.device("cpu" if smoke else "cuda")
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    timer = Timer(smoke)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    if smoke:
        bw, card = 4.23e12, "cpu (smoke run: times mean nothing)"
    else:
        from benchmarks.ceilings import hbm_bandwidth

        bw, card = hbm_bandwidth(), torch.cuda.get_device_properties(0).name
        log(f"copy rate {bw / 1e12:.2f} TB/s")
    import triton

    result = {"card": card, "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "torch": torch.__version__, "triton": triton.__version__, "copy_bytes_per_s": bw,
              "command": "python -m benchmarks.quant_gemm " + " ".join(sys.argv[1:] if argv is None else argv),
              "timing": "CUDA graph of calls replayed back to back; weights cycled over >= 256 MB of copies",
              "cases": [], "skipped": []}
    plan = []  # by size, linear and experts alternating: a run cut by the budget still has both at small sizes
    for size in SMOKE_M if smoke else LINEAR_M:
        if "linear" in only:
            plan += [("linear", name, size, n, k) for name, n, k in (SMOKE_LINEAR if smoke else LINEAR_SHAPES)]
        if "moe" in only:
            plan += [("moe", fmt, size) for fmt, tokens in MOE_TOKENS.items() if (size == 1 if smoke else size in tokens)]
    for case in plan:
        if time.perf_counter() - t0 > args.budget_s:
            result["skipped"].append(list(case))
            continue
        try:
            if case[0] == "linear":
                row = linear_case(timer, *case[1:], bw, device, log)
            else:
                row = moe_case(timer, case[1], case[2], SMOKE_MOE if smoke else MOE_SHAPE, bw, device, log)
        except Exception as exc:  # record it and go on: one shape must not cost the whole run
            row = {"case": list(case), "error": f"{type(exc).__name__}: {exc}"[:500]}
            log(f"{case}: FAILED {row['error']}")
        if "variants" in row:
            row["fastest_variant"] = fastest_variant(row["variants"])
            row["variants_ok"] = all("error" not in v and v.get("correct", True) for v in row["variants"].values())
        result["cases"].append(row)
        if not smoke:
            torch.cuda.empty_cache()
    if result["skipped"]:
        log(f"skipped past the budget: {result['skipped']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {args.out}")
    if not smoke:
        png = plot(result, os.path.splitext(args.out)[0] + ".png")
        if png:
            log(f"wrote {png}")
    bad = [r for r in result["cases"] if "error" in r or r.get("correct") is False or r.get("variants_ok") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
