"""Routed-MoE benchmark: Triton grouped kernels vs torch._grouped_mm vs the reference.

    python -m benchmarks.moe_bench [--sweep] [--align] [--out PATH]

V4-Flash shapes by default (D 4096, I 2048, E 256, top-6), tokens 1 8 64 512 4096. Each time is
the median over groups of CUDA-graph replays (the reference, which syncs with the host, is
timed eagerly). Floors: weight read = bytes of the experts actually touched (+ x and out) over
the HBM copy bandwidth measured in the same run; tensor core = T*k*6*D*I over the bf16 matmul
rate measured in the same run. Without CUDA it runs a tiny smoke version on the CPU
(Triton interpreter) to check the script itself.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks import result_file  # noqa: E402
from benchmarks.timing import capture_graph, replay_ms  # noqa: E402
from sparseserve.kernels import moe  # noqa: E402

NOMINAL_BW = 4.23e12  # B/s, HBM copy on the H200 (docs/performance.md, ceilings)
NOMINAL_TC = 790e12  # FLOP/s, bf16 dense GEMM on random data

# Candidate configs per regime (block_m, gate_up: BN BK warps stages, down: BN BK warps stages).
def _cfg(block_m, gu_n, gu_k, gu_w, gu_s, dn_n, dn_k, dn_w, dn_s, nfast=True) -> moe.MoeConfig:
    return moe.MoeConfig(block_m, gu_n, gu_k, gu_w, gu_s, dn_n, dn_k, dn_w, dn_s, m_fastest=not nfast)


# Candidate configs (block_m, gate_up: BN BK warps stages, down: BN BK warps stages); "_mfast":
# M tiles fastest in the grid, else N tiles fastest.
SWEEP = {
    "m16_n32_k128": _cfg(16, 32, 128, 4, 4, 64, 128, 4, 4),
    "m16_n64_k128_s3": _cfg(16, 64, 128, 4, 3, 128, 128, 4, 3),
    "m16_n64_k128_s3_mfast": _cfg(16, 64, 128, 4, 3, 128, 128, 4, 3, nfast=False),
    "m32_n64_k128_s3": _cfg(32, 64, 128, 4, 3, 128, 128, 4, 3),
    "m32_n64_k128_s3_mfast": _cfg(32, 64, 128, 4, 3, 128, 128, 4, 3, nfast=False),
    "m64_n128_k64_s4": _cfg(64, 128, 64, 4, 4, 256, 64, 4, 4),
    "m64_n128_k64_s4_mfast": _cfg(64, 128, 64, 4, 4, 256, 64, 4, 4, nfast=False),
    "m128_n128_k64_w8": _cfg(128, 128, 64, 8, 3, 256, 64, 8, 3),
    "m128_n128_k64_w8_mfast": _cfg(128, 128, 64, 8, 3, 256, 64, 8, 3, nfast=False),
    "m128_n128_k64_w8_s4": _cfg(128, 128, 64, 8, 4, 256, 64, 8, 4),
}


def sweep_for(num_tokens: int, top_k: int, num_experts: int) -> list[str]:
    avg = num_tokens * top_k / num_experts
    if avg <= 4:
        return ["m16_n64_k128_s3_mfast", "m16_n32_k128"]
    if avg <= 12:
        return ["m32_n64_k128_s3_mfast", "m16_n64_k128_s3", "m64_n128_k64_s4"]
    if avg <= 48:
        return ["m64_n128_k64_s4_mfast", "m32_n64_k128_s3", "m128_n128_k64_w8"]
    return ["m128_n128_k64_w8_mfast", "m128_n128_k64_w8_s4", "m64_n128_k64_s4"]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_graph(fn, reps: int, groups: int = 5) -> float:
    """Median ms per call over `groups` groups of `reps` graph replays."""
    graph, _ = capture_graph(fn)
    for _ in range(2):
        graph.replay()
    sync()
    ms = replay_ms(graph, reps, groups)
    del graph
    return ms


def time_eager(fn, reps: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_ceilings() -> tuple[float, float]:
    """HBM copy bandwidth (read + write bytes) and bf16 matmul rate on random data."""
    src = torch.randn(512 * 2**20, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = time_eager(lambda: dst.copy_(src), 10)
    bw = 2 * src.numel() * 2 / (ms * 1e-3)
    del src, dst
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_eager(lambda: a @ b, 10)
    tc = 2 * n**3 / (ms * 1e-3)
    return bw, tc


def routing(num_tokens: int, num_experts: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, uniform (as a balanced router gives); weights sum to 1."""
    scores = torch.rand(num_tokens, num_experts, device=device)
    ids = torch.topk(scores, top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, device=device) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids


def align_crossover(out: str) -> None:
    """Alignment alone, one-program Triton kernel vs the torch ops, inside CUDA graphs (as decode runs
    it), for decode-sized assignment counts: the data behind moe.align_kernel_max_assign."""
    rows = []
    for num_experts in (16, 256):
        for num_tokens in (64, 85, 128, 170, 200, 256, 341, 512, 683):
            _, ids = routing(num_tokens, num_experts, 6, "cuda")
            block_m = moe.moe_config(num_tokens, 6, num_experts, 4096, 2048).block_m
            row = {"experts": num_experts, "tokens": num_tokens, "assignments": num_tokens * 6, "block_m": block_m,
                   "triton_us": 1e3 * time_graph(lambda: moe.moe_align_triton(ids, num_experts, block_m), 50),
                   "torch_us": 1e3 * time_graph(lambda: moe.moe_align_torch(ids, num_experts, block_m), 50)}
            a, b = moe.moe_align_triton(ids, num_experts, block_m), moe.moe_align_torch(ids, num_experts, block_m)
            row["equal"] = all(torch.equal(x, y) for x, y in zip(a, b))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"card": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": __import__("triton").__version__,
                       "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       "command": "python -m benchmarks.moe_bench --align", "rows": rows},
                      f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 64, 512, 1024, 2048, 4096])
    parser.add_argument("--sweep", action="store_true", help="also time the candidate tile configs")
    parser.add_argument("--no-ref", action="store_true")
    parser.add_argument("--shape", default="flash", choices=["flash", "pro", "tiny"])
    parser.add_argument("--out", default="", help="default: benchmarks/results/moe.json "
                        "(moe_align.json with --align; the CPU smoke run: not written)")
    parser.add_argument("--align", action="store_true", help="only the alignment crossover (CUDA)")
    args = parser.parse_args()
    if args.align:
        return align_crossover(args.out or result_file("moe_align"))

    cuda = torch.cuda.is_available()
    if not cuda and not moe._INTERPRET:
        raise SystemExit("no CUDA: run the CPU smoke version as TRITON_INTERPRET=1 python -m benchmarks.moe_bench")
    device = torch.device("cuda" if cuda else "cpu")
    shape = args.shape if cuda else "tiny"
    hidden, inter, num_experts, top_k = {
        "flash": (4096, 2048, 256, 6),
        "pro": (7168, 3072, 384, 6),
        "tiny": (128, 64, 16, 6),
    }[shape]
    tokens = args.tokens if cuda else [1, 8, 33]
    limit = 10.0
    torch.manual_seed(0)
    if cuda:
        bw, tc = measure_ceilings()
        card = torch.cuda.get_device_name()
    else:
        bw, tc, card = NOMINAL_BW, NOMINAL_TC, "cpu (smoke run)"
    print(f"card {card}; torch {torch.__version__}; measured copy {bw / 1e12:.2f} TB/s, bf16 mm {tc / 1e12:.0f} TFLOP/s")
    dtype = torch.bfloat16
    # Weights of the size of real ones, so that nothing but the touched experts' reads fit L2.
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=dtype) * hidden**-0.5)
    w_down = torch.randn(num_experts, hidden, inter, device=device, dtype=dtype) * inter**-0.5
    has_grouped = moe.grouped_mm_available(device)
    rows = []
    for num_tokens in tokens:
        x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
        weights, ids = routing(num_tokens, num_experts, top_k, device)
        touched = int(torch.unique(ids).numel())
        floor_bytes = touched * 3 * inter * hidden * 2 + 2 * num_tokens * hidden * 2
        flops = num_tokens * top_k * 6 * hidden * inter
        floor_bw_ms = floor_bytes / bw * 1e3
        floor_tc_ms = flops / tc * 1e3
        floor_ms = max(floor_bw_ms, floor_tc_ms)
        reps = max(3, min(50, int(20 / max(floor_ms, 0.05))))
        row = {
            "tokens": num_tokens, "experts_touched": touched, "weight_bytes": floor_bytes, "flops": flops,
            "floor_weight_read_ms": floor_bw_ms, "floor_tensor_core_ms": floor_tc_ms,
        }
        call_args = (x, w_gate_up, w_down, weights, ids, limit)
        ref = None
        if not args.no_ref:
            ref = moe.fused_moe_ref(*call_args)
            row["ref_ms"] = time_eager(lambda: moe.fused_moe_ref(*call_args), 3)
        timer = (lambda fn: time_graph(fn, reps)) if cuda else (lambda fn: time_eager(fn, 1))
        cfg = moe.moe_config(num_tokens, top_k, num_experts, hidden, inter)
        out = moe.fused_moe_triton(*call_args)
        if ref is not None:
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            row["triton_rel_err_vs_ref"] = err
        row["triton_config"] = str(cfg)
        row["triton_ms"] = timer(lambda: moe.fused_moe_triton(*call_args))
        row["align_ms"] = timer(lambda: moe.moe_align(ids, num_experts, cfg.block_m))
        # Stage breakdown (default config): the two grouped GEMMs alone.
        sorted_ids, block_expert = moe.moe_align(ids, num_experts, cfg.block_m)
        act = moe.moe_gate_up(x, w_gate_up, sorted_ids, block_expert, top_k, limit, cfg)
        row["gate_up_ms"] = timer(lambda: moe.moe_gate_up(x, w_gate_up, sorted_ids, block_expert, top_k, limit, cfg))
        row["down_ms"] = timer(lambda: moe.moe_down(act, w_down, sorted_ids, block_expert, weights, cfg))
        del act
        if args.sweep:
            row["sweep_ms"] = {}
            row["triton_ms_again"] = None
            for name in sweep_for(num_tokens, top_k, num_experts):
                c = SWEEP[name]
                try:
                    if ref is not None:  # every timed config is also checked against the reference
                        got = moe.fused_moe_triton(*call_args, config=c).float()
                        row.setdefault("sweep_rel_err", {})[name] = ((got - ref.float()).norm() / ref.float().norm()).item()
                    row["sweep_ms"][name] = timer(lambda c=c: moe.fused_moe_triton(*call_args, config=c))
                except Exception as exc:  # a config that does not compile or fit is reported, not fatal
                    row["sweep_ms"][name] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
            row["triton_ms_again"] = timer(lambda: moe.fused_moe_triton(*call_args))
        if has_grouped:
            try:
                g_out = moe.fused_moe_grouped(*call_args)
                if ref is not None:
                    row["grouped_rel_err_vs_ref"] = ((g_out.float() - ref.float()).norm() / ref.float().norm()).item()
                row["grouped_mm_ms"] = timer(lambda: moe.fused_moe_grouped(*call_args))
            except Exception as exc:
                row["grouped_mm_ms"] = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
        logits = torch.randn(num_tokens, num_experts, device=device)
        bias = torch.randn(num_experts, device=device) * 0.1
        sel_args = (logits, top_k, "sqrtsoftplus", 1.5, bias)
        row["select_ms"] = timer(lambda: moe.select_experts(*sel_args))
        row["select_ref_ms"] = timer(lambda: moe.select_experts_ref(*sel_args))
        row["triton_over_floor"] = row["triton_ms"] / floor_ms
        rows.append(row)
        print(json.dumps(row), flush=True)
        del x, out, ref
    result = {
        "card": card, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__, "triton": __import__("triton").__version__,
        "command": "python -m benchmarks.moe_bench" + (" --sweep" if args.sweep else ""),
        "shape": {"hidden": hidden, "inter": inter, "experts": num_experts, "top_k": top_k, "dtype": "bf16"},
        "measured_copy_TBps": bw / 1e12, "measured_bf16_TFLOPs": tc / 1e12, "rows": rows,
    }
    out = args.out or (result_file("moe") if cuda else "")
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print()
    print(f"{'T':>5} {'touched':>7} {'floorBW':>8} {'floorTC':>8} {'triton':>8} {'again':>6} {'x floor':>7} {'grouped':>8} {'ref':>8} {'align':>7} {'gate_up':>7} {'down':>7} {'select':>6} {'sel_ref':>7}  sweep")
    for r in rows:
        fmt = lambda v: f"{v:8.3f}" if isinstance(v, float) else f"{'-':>8}"  # noqa: E731
        sweep = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}=X" for k, v in r.get("sweep_ms", {}).items())
        print(
            f"{r['tokens']:>5} {r['experts_touched']:>7} {fmt(r['floor_weight_read_ms'])} {fmt(r['floor_tensor_core_ms'])} "
            f"{fmt(r['triton_ms'])} {r.get('triton_ms_again') or 0:6.3f} {r['triton_over_floor']:7.2f} {fmt(r.get('grouped_mm_ms'))} {fmt(r.get('ref_ms'))} "
            f"{r['align_ms']:7.3f} {r['gate_up_ms']:7.3f} {r['down_ms']:7.3f} {r['select_ms']:6.3f} {r['select_ref_ms']:7.3f}  {sweep}"
        )


if __name__ == "__main__":
    main()
