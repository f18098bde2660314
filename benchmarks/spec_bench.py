"""MTP speculation on a 43-layer preset (dummy weights): what a verify + draft step costs, what a
known acceptance buys, and adaptive speculation against plain decoding.

    python -m benchmarks.spec_bench [--model v4-flash-43l8e] [--p 0.75] [--budget-s 400] [--smoke]

1. Step-cost ratio: for d = 1, 2, 3 drafts at batch 1, 8, 64, the median engine step (schedule,
   verify + draft, bookkeeping) against a plain decode step of an engine without speculation. One
   speculative engine (k = 3, graphs for every 1 + d) runs every d, forced per cell: the graphs a
   k = d engine replays, its ring rows (window + k) aside.
2. Expected against measured tokens/s at per-draft acceptance p: an oracle drafter proposes the
   target's own greedy continuation (from the plain engine's run of the same prompts) with
   probability p per draft and a wrong token otherwise. It runs the MTP drafter first (its cost is
   paid) and only replaces the tokens, so the drafts go through the same verify path; expected
   tokens per step are (1 - p^(d+1)) / (1 - p) (i.i.d.). Dummy weights give near-flat logits, whose
   greedy continuation the verify step's numerics would tip at the first token; so, in both engines,
   the target's logits carry a large bias on one token (`force_greedy_token`, patched into this
   process's `compute_logits`: one small kernel in every step of both), which makes the continuation
   that token, repeated, whatever the numerics, and the measured acceptance p. The MTP layer's own
   logits are not biased (its drafts stay wrong: the adaptive "mtp" sweep). `--no-force` leaves the
   logits alone. A constant token routes every hash-MoE layer's tokens to the same experts.
3. Adaptive speculation (the engine's policy, step costs timed at start-up) against plain
   decoding at batch 1..256, with the oracle drafter at p and with the MTP layer's own drafts
   (dummy weights: almost never accepted, so the policy should fall back to plain steps).

Steps are synchronous in both engines (`--async` for async scheduling in both). `--side-stream`
sets both engines' `side_stream` (default "auto": the plain engine's graphs use the side stream, the
speculative engine's do not, docs/architecture.md). Cells that would
start past `--budget-s` are skipped and listed. `--smoke`: the tiny checkpoint on the CPU, in seconds.
Writes benchmarks/results/spec_bench.json (or --out).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from benchmarks import result_file, write_result
from sparseserve import LLM, RequestOutputKind, SamplingParams
from sparseserve.benchmarks.throughput import free_device_memory, synchronize
from sparseserve.model.host_copy import to_device
from sparseserve.names import SIDE_STREAM_MODES
from sparseserve.model.loader import CONFIGS_DIR
from sparseserve.spec_decode.adaptive import expected_tokens
from sparseserve.spec_decode.mtp_proposer import MTPProposer


FORCED_TOKEN = 17
FORCE_MARGIN = 1.0e4


@contextlib.contextmanager
def force_greedy_token(token: int = FORCED_TOKEN, margin: float = FORCE_MARGIN):
    """Within the block, every target forward's logits get `margin` added at `token`, so greedy
    decoding emits `token` whatever the numerics. Build the engines inside it: their captured graphs
    record the addition."""
    from sparseserve.model.deepseek_v4 import DeepseekV4ForCausalLM

    original = DeepseekV4ForCausalLM.compute_logits

    def compute_logits(self, streams: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = original(self, streams, out)
        logits[:, token] += margin
        return logits

    DeepseekV4ForCausalLM.compute_logits = compute_logits
    try:
        yield
    finally:
        DeepseekV4ForCausalLM.compute_logits = original


class OracleDrafter(MTPProposer):
    """The MTP drafter, whose draft tokens are replaced by the true continuation with probability p
    per draft (a wrong token otherwise). Unbound (no continuations yet) it is the MTP drafter."""

    def __init__(self, inner: MTPProposer, p: float, vocab_size: int, seed: int = 0) -> None:
        self.__dict__.update(inner.__dict__)
        self.p, self.vocab_size = p, vocab_size
        self.table: torch.Tensor | None = None  # [slots, positions] the true tokens by slot
        self.gen: torch.Generator | None = None
        self.seed = seed

    def bind(self, engine, sequences: dict[str, list[int]]) -> None:
        """The running requests' prompt + continuation, by the slot each holds."""
        running = {r.request_id: r for r in engine.scheduler.running}
        device = engine.runner.device
        length = max(len(s) for s in sequences.values())
        table = torch.zeros(engine.config.max_num_seqs + 1, length, dtype=torch.long)
        for rid, seq in sequences.items():
            if rid in running:
                table[running[rid].slot, :len(seq)] = torch.tensor(seq)
        self.table = table.to(device)
        self.gen = torch.Generator(device=device).manual_seed(self.seed)

    def unbind(self) -> None:
        self.table = None

    def draft(self, chunks, target_streams, input_ids, rows, drafting, positions, sampling, num=None):
        drafts, probs = super().draft(chunks, target_streams, input_ids, rows, drafting, positions, sampling, num)
        if self.table is None or drafts.shape[1] == 0:
            return drafts, probs
        slots = to_device([c.slot for c in drafting], drafts.device)
        # Draft j of a sequence whose last accepted position is P is the token at P + 2 + j.
        at = (positions.unsqueeze(1) + 2 + torch.arange(drafts.shape[1], device=drafts.device)).clamp(
            max=self.table.shape[1] - 1)
        true = self.table[slots.unsqueeze(1), at]
        right = torch.rand(drafts.shape, generator=self.gen, device=drafts.device) < self.p
        return torch.where(right, true, (true + 1) % self.vocab_size), probs


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=gen).tolist() for _ in range(batch)]


def timed_steps(engine, prompts: list[list[int]], max_tokens: int, warmup: int, steps: int, tag: str,
                finish: bool = False) -> dict:
    """Add the prompts, run the prefill and `warmup` steps, then time `steps` engine steps (a sync
    on each side). Returns the median step, tokens/s, the step's acceptance counts and, with
    `finish`, every request's tokens after running them to the end (else they are aborted)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, ids_ in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": ids_}, params)
    reqs = [engine.requests[rid] for rid in ids]

    def generated() -> int:
        return sum(len(r.output_token_ids) + r.num_pending_tokens for r in reqs)

    while any(len(r.output_token_ids) + r.num_pending_tokens == 0 for r in reqs):
        engine.step()
    for _ in range(warmup):
        engine.step()
    m = engine.spec_metrics
    before = (m.num_accepted_tokens, m.num_checked_tokens, m.num_verify_steps, m.num_draft_tokens)
    sync = lambda: synchronize(engine.device)  # noqa: E731
    times = []
    sync()
    start, tokens0 = time.perf_counter(), generated()
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        sync()
        times.append(time.perf_counter() - t)
    elapsed, tokens = time.perf_counter() - start, generated() - tokens0
    accepted, checked, verify_steps, drafted = (a - b for a, b in zip(
        (m.num_accepted_tokens, m.num_checked_tokens, m.num_verify_steps, m.num_draft_tokens), before))
    result = {"batch": len(prompts), "step_ms_median": 1e3 * statistics.median(times),
              "tokens_per_s": tokens / elapsed, "tokens_per_step": tokens / steps / len(prompts),
              "acceptance_measured": accepted / checked if checked else None,
              "drafts_per_verify": drafted / verify_steps if verify_steps else None}
    if finish:
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        by_id = {o.request_id: o.outputs[0].token_ids for o in outputs}
        result["sequences"] = {rid: p + list(by_id[rid]) for rid, p in zip(ids, prompts)}
    else:
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    return result


def make_engine(args, batches: list[int], spec_k: int) -> LLM:
    kw = dict(device="cpu", dtype="float32", enforce_eager=True) if args.smoke else dict(load_format="dummy")
    if spec_k:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": spec_k, "adaptive": True}
    return LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=max(batches),
               cuda_graph_sizes=None if args.smoke else sorted(set(batches)),
               kv_cache_memory_bytes=args.kv_cache_bytes, async_scheduling=args.async_scheduling,
               side_stream=args.side_stream, use_tqdm_on_load=False, **kw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="v4-flash-43l8e")
    parser.add_argument("--ks", default="1,2,3", help="drafts per step of the step-cost cells")
    parser.add_argument("--batches", default="1,8,64", help="batches of the step-cost and acceptance cells")
    parser.add_argument("--sweep", default="1,2,4,8,16,32,64,128,256", help="batches of adaptive vs plain")
    parser.add_argument("--p", type=float, default=0.75, help="the oracle drafter's per-draft acceptance")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per cell")
    parser.add_argument("--warmup", type=int, default=4, help="steps after the prefill before timing")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-bytes", type=int, default=8 * 1024**3)
    parser.add_argument("--async", dest="async_scheduling", action="store_true",
                        help="async scheduling in both engines (default: synchronous steps)")
    parser.add_argument("--side-stream", default="auto", choices=SIDE_STREAM_MODES,
                        help="both engines' side_stream (auto: plain graphs on the side stream, speculative not)")
    parser.add_argument("--no-force", dest="force", action="store_false",
                        help="leave the target's logits alone (dummy weights: the oracle's continuation tips)")
    parser.add_argument("--budget-s", type=float, default=400.0, help="skip cells that would start past this")
    parser.add_argument("--smoke", action="store_true", help="the tiny checkpoint on the CPU, a few steps")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/spec_bench.json")
    args = parser.parse_args()
    if args.smoke:
        args.model = str(CONFIGS_DIR / "tiny") if args.model == parser.get_default("model") else args.model
        args.ks, args.batches, args.sweep = "1,2", "2", "2"
        args.steps, args.warmup, args.prompt_len, args.max_model_len = 2, 1, 8, 128
        args.kv_cache_bytes = 64 * 1024**2
    started = time.perf_counter()
    with force_greedy_token() if args.force else contextlib.nullcontext():
        run(args, started)


def run(args, started: float) -> None:
    ks = [int(k) for k in args.ks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    sweep = [int(b) for b in args.sweep.split(",")]
    all_batches = sorted(set(batches) | set(sweep))
    k_max = max(ks)
    # Adaptive cells warm up longer: the policy's acceptance estimate has to move from what it saw before.
    adaptive_warmup = max(args.warmup, 4 * args.steps)
    # Long enough for every timed step to accept all drafts, plus the drafts past the last one.
    cont_len = 8 + (adaptive_warmup + args.steps) * (k_max + 1) + k_max + 2
    skipped: list[str] = []

    def over_budget(what: str) -> bool:
        if time.perf_counter() - started > args.budget_s:
            skipped.append(what)
            print(f"skipped (past --budget-s {args.budget_s:.0f}): {what}", flush=True)
            return True
        return False

    # Phase 1: plain decoding; its greedy continuations feed the oracle drafter.
    llm = make_engine(args, all_batches, 0)
    engine = llm.llm_engine
    vocab = engine.vocab_size
    plain, sequences = {}, {}
    for b in all_batches:
        if over_budget(f"plain batch {b}"):
            continue
        row = timed_steps(engine, random_prompts(b, args.prompt_len, vocab, b), cont_len, args.warmup, args.steps,
                          f"b{b}", finish=True)
        sequences[b] = row.pop("sequences")
        plain[b] = row
        print(f"plain batch {b}: {row['step_ms_median']:.3f} ms/step, {row['tokens_per_s']:.0f} tokens/s",
              flush=True)
    card = torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu"
    del llm, engine
    free_device_memory()

    # Phase 2: one speculative engine (graphs for every 1 + d), d forced per cell or chosen by the policy.
    llm = make_engine(args, all_batches, k_max)
    engine = llm.llm_engine
    policy = engine.spec_policy
    speculator = engine.runner.speculator
    oracle = OracleDrafter(speculator.proposer, args.p, vocab)
    speculator.proposer = oracle
    cells = []
    for b in batches:
        for d in ks:
            if b not in sequences or over_budget(f"d={d} batch {b}"):
                continue
            engine.scheduler.draft_limit = lambda n, d=d: d
            row = run_spec_cell(engine, oracle, list(sequences[b].values()), cont_len - k_max - 2, args, f"s{b}-{d}")
            ratio = row["step_ms_median"] / plain[b]["step_ms_median"]
            e = expected_tokens(args.p, d)
            row.update({"d": d, "step_ratio": ratio, "expected_tokens_per_step": e,
                        "expected_tokens_per_s": b * e / (row["step_ms_median"] / 1e3),
                        "expected_speedup": e / ratio,
                        "measured_speedup": row["tokens_per_s"] / plain[b]["tokens_per_s"]})
            cells.append(row)
            print(f"batch {b} d={d}: verify+draft {row['step_ms_median']:.3f} ms = {ratio:.2f}x plain; at p={args.p}: "
                  f"expected {row['expected_tokens_per_s']:.0f} tokens/s, measured {row['tokens_per_s']:.0f} "
                  f"(acceptance {row['acceptance_measured']}), {row['measured_speedup']:.2f}x plain", flush=True)
    adaptive = []
    engine.scheduler.draft_limit = None
    for drafter in ("oracle", "mtp"):
        if policy is not None:  # each drafter's sweep starts from the policy's prior
            policy.reset()
        for b in sweep:
            if b not in sequences or over_budget(f"adaptive ({drafter}) batch {b}"):
                continue
            choices: list[int] = []

            def choose(n: int) -> int:
                choices.append(policy.choose(n))
                return choices[-1]

            engine.scheduler.draft_limit = choose if policy is not None else None
            row = run_spec_cell(engine, oracle if drafter == "oracle" else None, list(sequences[b].values()),
                                cont_len - k_max - 2, args, f"a{drafter}{b}", adaptive_warmup)
            row.update({"drafter": drafter, "p": args.p if drafter == "oracle" else None,
                        "vs_plain": row["tokens_per_s"] / plain[b]["tokens_per_s"],
                        "drafts_chosen": {d: choices.count(d) for d in sorted(set(choices))},
                        "acceptance_estimate": policy.acceptance if policy is not None else None})
            adaptive.append(row)
            print(f"adaptive ({drafter}) batch {b}: {row['tokens_per_s']:.0f} tokens/s = {row['vs_plain']:.2f}x plain; "
                  f"drafts chosen {row['drafts_chosen']}", flush=True)
    costs = getattr(engine.runner, "step_costs", None) or (policy.costs if policy is not None else None)
    report = {"card": card, "torch": torch.__version__, "model": args.model, "p": args.p,
              "forced_token": FORCED_TOKEN if args.force else None,
              "async_scheduling": args.async_scheduling, "side_stream": args.side_stream, "prompt_len": args.prompt_len, "steps": args.steps,
              "step_costs": costs.as_dict() if costs is not None else None,
              "policy_drafts_by_bucket": ({str(a): policy.table(a) for a in (0.0, 0.5, args.p, 0.9)}
                                          if policy is not None else None),
              "plain": [plain[b] for b in sorted(plain)], "cells": cells, "adaptive": adaptive,
              "skipped": skipped, "elapsed_s": time.perf_counter() - started}
    del llm, engine
    free_device_memory()
    out = args.out or result_file("spec_bench")
    write_result(out, report)
    print(f"wrote {out} in {report['elapsed_s']:.0f} s", flush=True)


def run_spec_cell(engine, oracle: OracleDrafter | None, sequences: list[list[int]], max_tokens: int, args,
                  tag: str, warmup: int | None = None) -> dict:
    """`timed_steps` on the speculative engine for the sequences' prompts; the oracle (if any) is bound
    to their continuations once every request holds a slot (a prefill may take several steps)."""
    ids = [f"{tag}-{i}" for i in range(len(sequences))]
    original = engine.step
    pending = oracle is not None

    def step():
        nonlocal pending
        out = original()
        if pending and all(engine.requests[rid].slot is not None for rid in ids if rid in engine.requests):
            oracle.bind(engine, dict(zip(ids, sequences)))
            pending = False
        return out

    engine.step = step
    try:
        return timed_steps(engine, [s[:args.prompt_len] for s in sequences], max_tokens,
                           args.warmup if warmup is None else warmup, args.steps, tag)
    finally:
        engine.step = original
        if oracle is not None:
            oracle.unbind()


if __name__ == "__main__":
    main()
