"""FP8 KV cache against bf16 in one run (H200): decode attention and indexer scores at V4-Flash shapes, and the
sequences that fit at 128K context in the same memory (docs/kv-cache.md).

    python -m benchmarks.kv_fp8_bench [--out PATH] [--smoke]

Cases: attention decode, V4-Flash (64 heads, D = 512, top-k 512), CSA and HCA row lists, batch 64 / 256 x context
32K / 128K; indexer decode (64 heads x 128) at the same batches and contexts. Inputs and timing are
benchmarks/kernels.py's (input sets cycled in one captured graph, so rows come from HBM); the FP8 pool is the
bf16 pool quantized, read through the same row lists. Each case records the bf16 engine kernel (Hopper where it
serves the call), the portable Triton kernel on bf16 rows, the FP8 kernel (its config, and the registers, spills
and shared memory of its compiled variant; neighbouring FP8 configs timed beside it), the role-split Hopper kernel's
FP8 form under its named config (`select.fp8_hopper_attention_config`, not the engine's selection: `fp8_hopper_*`),
their speedups and the share of HBM the FP8 kernels' own bytes reach.
--smoke: tiny shapes on the CPU under TRITON_INTERPRET=1 (a script check).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

import benchmarks.kernels as K
from benchmarks import result_file, write_result
from sparseserve.config import ModelConfig
from sparseserve.engine.kv_cache import plan_kv
from sparseserve.kernels.attention import (
    AttnConfig,
    attention_config,
    engine_attention_config,
    sparse_mqa_attention_ref,
    sparse_mqa_attention_triton,
)
from sparseserve.kernels.attention.hopper_fp8 import hopper_fp8_supported
from sparseserve.kernels.attention.select import fp8_hopper_attention_config
from sparseserve.kernels.attention.triton_kernel import _sparse_mqa_fwd_kernel
from sparseserve.kernels.indexer import indexer_config, indexer_scores_triton
from sparseserve.kv_format import IndexFormat, KVFormat, dequantize_kv_rows, quantize_index_rows, quantize_kv_rows
from sparseserve.model.loader import load_hf_config, resolve_model_dir

FMT = KVFormat(K.D, 64)
BATCHES = (64, 256)
CONTEXTS = (32768, 131072)
CHUNK = 1 << 16  # rows quantized at a time (bounded fp32 temporaries)


def _quantized(pool: torch.Tensor, index: bool = False):
    parts = [(quantize_index_rows if index else lambda r: quantize_kv_rows(r, FMT))(pool[i:i + CHUNK])
             for i in range(0, pool.shape[0], CHUNK)]
    if index:
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return torch.cat(parts)


def _compiled_variants() -> dict[str, object]:
    """The attention kernel's compiled variants by cache key (Triton-internal layout: best effort, {} if it moved)."""
    out = {}
    try:
        for entry in _sparse_mqa_fwd_kernel.device_caches.values():
            out.update({str(key): k for key, k in entry[0].items()})
    except (AttributeError, IndexError, TypeError):
        pass
    return out


_FP8_RESOURCES: dict[str, dict] = {}


def _fp8_resources(cfg_key: str, before: dict[str, object]) -> dict:
    """Registers, spills and shared memory of the variant the first launch of this FP8 config compiled."""
    if cfg_key not in _FP8_RESOURCES:
        new = [k for key, k in _compiled_variants().items() if key not in before]
        if len(new) != 1:
            return {"fp8_kernel": f"{len(new)} new variants: not attributed"}
        k = new[0]
        _FP8_RESOURCES[cfg_key] = dict(fp8_regs=getattr(k, "n_regs", None), fp8_spills=getattr(k, "n_spills", None),
                                       fp8_shared=getattr(k.metadata, "shared", None))
    return _FP8_RESOURCES[cfg_key]


def _fp8_alternatives(cfg: AttnConfig) -> list[AttnConfig]:
    """Neighbours of the selected FP8 config, timed beside it (data for the selection table's FP8 rows): the other
    tile height (32 or 64 rows), three stages, and no row splits where it splits."""
    alts = [replace(cfg, block_n=32 if cfg.block_n == 64 else 64), replace(cfg, num_stages=3)]
    if cfg.num_splits > 1:
        alts.append(replace(cfg, num_splits=1))
    return alts


def _alt_label(cfg: AttnConfig) -> str:
    return f"h{cfg.block_h}_n{cfg.block_n}_w{cfg.num_warps}_st{cfg.num_stages}_s{cfg.num_splits}"


def _graph_us(sets, launch) -> float:
    return K._bench_graph([(lambda a=a: launch(a)) for a in sets])


def _fp8_hopper(case: dict, packed: torch.Tensor, ref: torch.Tensor, fp8_bytes: int, t_bf16: float, t_fp8: float,
                num_sms: int) -> dict:
    """The Hopper kernel's FP8 form timed on the same inputs (where it can serve them): its config, time, error
    against the reference, speedups over the bf16 engine kernel and the FP8 Triton launch, share of HBM."""
    q, _, rows = case["args"][:3]
    if not hopper_fp8_supported(q, packed, FMT):
        return dict(fp8_hopper="not served here (needs sm_90, bf16 q, 64-head multiples)")
    cfg = fp8_hopper_attention_config(q.shape[0], q.shape[1], rows.shape[1], num_sms)
    launch = lambda a: sparse_mqa_attention_triton(a[0], packed, *a[2:], cfg, kv_format=FMT)  # noqa: E731
    try:
        rel = ((launch(case["args"]).float() - ref).norm() / ref.norm()).item()
        t = _graph_us(case["sets"], launch)
    except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
        return dict(fp8_hopper_config=repr(cfg), fp8_hopper_error=repr(exc)[:300])
    return dict(fp8_hopper_config=repr(cfg), fp8_hopper_us=round(t, 2), fp8_hopper_rel_err_vs_ref=round(rel, 5),
                fp8_hopper_speedup=round(t_bf16 / t, 3), fp8_hopper_vs_fp8_triton=round(t_fp8 / t, 3),
                fp8_hopper_hbm_frac=round(fp8_bytes / (t * 1e-6) / K.HBM_BPS, 3))


def attention_case(kind: str, batch: int, ctx: int, gen: torch.Generator, num_sms: int) -> dict:
    case = K.attn_decode_case("flash", kind, batch, ctx, gen)
    q, kv, rows, sinks, scale = case["args"]
    packed = _quantized(kv)
    engine = engine_attention_config(q, kv, rows.shape[1])
    triton_cfg = attention_config(batch, q.shape[1], rows.shape[1], K.D, num_sms)
    fp8_cfg = engine_attention_config(q, packed, rows.shape[1])
    fp8 = lambda a: sparse_mqa_attention_triton(a[0], packed, *a[2:], fp8_cfg, kv_format=FMT)  # noqa: E731
    before = _compiled_variants()
    out = fp8(case["args"])
    resources = _fp8_resources(repr(fp8_cfg), before)
    ref = sparse_mqa_attention_ref(q.float(), dequantize_kv_rows(packed, FMT), rows, sinks, scale)
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    t_bf16 = _graph_us(case["sets"], lambda a: sparse_mqa_attention_triton(*a, engine))
    t_triton = _graph_us(case["sets"], lambda a: sparse_mqa_attention_triton(*a, triton_cfg))
    t_fp8 = _graph_us(case["sets"], fp8)
    alternatives = {}
    for alt in _fp8_alternatives(fp8_cfg):
        launch = lambda a, c=alt: sparse_mqa_attention_triton(a[0], packed, *a[2:], c, kv_format=FMT)  # noqa: E731
        try:
            alt_rel = ((launch(case["args"]).float() - ref).norm() / ref.norm()).item()
            alternatives[_alt_label(alt)] = dict(us=round(_graph_us(case["sets"], launch), 2),
                                                 rel_err_vs_ref=round(alt_rel, 5))
        except Exception as exc:  # noqa: BLE001 (e.g. out of shared memory: recorded, the run goes on)
            alternatives[_alt_label(alt)] = dict(error=repr(exc)[:300])
    valid = batch * case["rows"]
    fp8_bytes = case["bytes"] - valid * K.D * 2 + valid * FMT.row_bytes
    return dict(kernel="attn", kind=kind, batch=batch, ctx=ctx, rows=case["rows"], bf16_config=repr(engine),
                fp8_config=repr(fp8_cfg), bf16_us=round(t_bf16, 2), bf16_triton_us=round(t_triton, 2),
                fp8_us=round(t_fp8, 2), speedup=round(t_bf16 / t_fp8, 3),
                speedup_vs_triton_bf16=round(t_triton / t_fp8, 3),
                fp8_hbm_frac=round(fp8_bytes / (t_fp8 * 1e-6) / K.HBM_BPS, 3),
                bf16_hbm_frac=round(case["bytes"] / (t_bf16 * 1e-6) / K.HBM_BPS, 3), rel_err_vs_ref=round(rel, 5),
                fp8_alternatives=alternatives, **resources,
                **_fp8_hopper(case, packed, ref, fp8_bytes, t_bf16, t_fp8, num_sms))


def indexer_case(batch: int, ctx: int, gen: torch.Generator, num_sms: int) -> dict:
    case = K.indexer_decode_case(batch, ctx, gen)
    a0 = case["args"]
    codes, scales = _quantized(a0[2], index=True)
    cfg = indexer_config(batch, K.IDX_HEADS, K.IDX_DIM, a0[-1], num_sms)
    t_bf16 = _graph_us(case["sets"], lambda a: indexer_scores_triton(*a, config=cfg))
    t_fp8 = _graph_us(case["sets"], lambda a: indexer_scores_triton(a[0], a[1], codes, *a[3:], config=cfg,
                                                                    index_scale=scales))
    vis = batch * case["entries"]
    fp8_bytes = case["bytes"] - vis * K.IDX_DIM * 2 + vis * IndexFormat(K.IDX_DIM).row_bytes
    return dict(kernel="indexer", batch=batch, ctx=ctx, bf16_us=round(t_bf16, 2), fp8_us=round(t_fp8, 2),
                speedup=round(t_bf16 / t_fp8, 3), fp8_hbm_frac=round(fp8_bytes / (t_fp8 * 1e-6) / K.HBM_BPS, 3))


def concurrency(cache_gib: float = 100.0, ctx: int = 131072) -> dict:
    model_dir, overrides = resolve_model_dir("deepseek-v4-flash")
    mc = ModelConfig(load_hf_config(model_dir, overrides))
    cache = int(cache_gib * 1024**3)
    fits = {kv: plan_kv(mc, 2, 128, 8192, kv_cache_dtype=kv).max_concurrency(ctx, cache) for kv in ("bfloat16", "fp8")}
    return dict(cache_gib=cache_gib, ctx=ctx, bf16_seqs=fits["bfloat16"], fp8_seqs=fits["fp8"],
                ratio=round(fits["fp8"] / max(fits["bfloat16"], 1), 3))


def run() -> dict:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if K.DEV == "cuda" else 132
    gen = torch.Generator(device=K.DEV).manual_seed(0)
    results = []
    for batch in BATCHES:
        for ctx in CONTEXTS:
            for kind in ("csa", "hca"):
                results.append(attention_case(kind, batch, ctx, gen, num_sms))
                print(json.dumps(results[-1]), flush=True)
            results.append(indexer_case(batch, ctx, gen, num_sms))
            print(json.dumps(results[-1]), flush=True)
    card = torch.cuda.get_device_properties(0).name if K.DEV == "cuda" else "cpu (interpreter smoke run)"
    return dict(device=card, kv_row_bytes=FMT.row_bytes, index_row_bytes=IndexFormat(K.IDX_DIM).row_bytes,
                cases=results, concurrency_128k=concurrency())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=result_file("kv_fp8"))
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run under TRITON_INTERPRET=1 (script check)")
    args = ap.parse_args(argv)
    if args.smoke:
        global BATCHES, CONTEXTS
        K.DEV, K.DTYPE = "cpu", torch.float32
        BATCHES, CONTEXTS = (2,), (1024,)
    report = run()
    write_result(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
