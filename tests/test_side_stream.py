"""The side-stream schedule (model/side_stream.py): inline on the CPU and for large steps, and on
the GPU the same logits as the one-stream schedule, bit for bit (same kernels, same inputs)."""
import pytest
import torch

from sparseserve.kernels import moe
from sparseserve.model.side_stream import OVERLAP_MAX_TOKENS, SideStream, SideStreams

LIMIT = 7.0


def test_inline_on_cpu_and_bad_mode():
    for mode in SideStreams.MODES:
        assert not SideStreams(mode).for_step(torch.device("cpu"), 1).active
    with pytest.raises(ValueError, match="side-stream mode"):
        SideStreams("sometimes")
    streams = SideStreams()
    with pytest.raises(ValueError, match="side-stream mode"):
        streams.mode = "on"
    assert streams.mode == "graphs"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_modes_on_gpu():
    """"always": every small step; "graphs": only inside a capture, whose replays then run the fork."""
    dev = torch.device("cuda", torch.cuda.current_device())
    always = SideStreams("always")
    assert always.for_step(dev, OVERLAP_MAX_TOKENS).active
    assert not always.for_step(dev, OVERLAP_MAX_TOKENS + 1).active
    assert not SideStreams("never").for_step(dev, 1).active
    graphs = SideStreams("graphs")
    assert not graphs.for_step(dev, 1).active  # not capturing
    x = torch.zeros(4, device=dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        side = graphs.for_step(dev, 1)
        x.add_(side.run(lambda: torch.ones(4, device=dev)).result())
        side.join()
    assert side.active
    g.replay()
    g.replay()
    assert torch.equal(x, torch.full((4,), 2.0, device=dev))


def test_inline_run_calls_at_once_and_returns_the_value():
    side = SideStream()
    calls = []
    work = side.run(lambda a, b=0: calls.append((a, b)) or a + b, 2, b=3)
    assert calls == [(2, 3)] and work.result() == 5 and work.event is None
    side.join()  # nothing queued: a no-op
    side.keep_until_done(torch.zeros(1), None)


def test_inline_then_and_run_from_call_at_once():
    side = SideStream()
    assert side.mark() is None
    assert side.then(lambda a: a * 2, 4).result() == 8
    work = side.run_from(None, lambda: "x")
    assert work.value == "x" and work.event is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_then_and_run_from_order_side_work_in_a_capture():
    """`then` runs after the side stream's earlier work without waiting for the main stream's later work;
    `run_from` waits for the main stream only up to its mark: both replay the captured order."""
    dev = torch.device("cuda", torch.cuda.current_device())
    streams = SideStreams("graphs")
    streams.for_step(dev, 1)  # the side stream is made outside the capture
    a, b = torch.zeros(4, device=dev), torch.zeros(4, device=dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        side = streams.for_step(dev, 1)
        a.add_(1)
        mark = side.mark()
        side.run(lambda: a.mul_(3))  # side: a = 3
        side.then(lambda: a.add_(1))  # side, after it: a = 4
        b.add_(5)  # main, after the mark
        copied = side.run_from(mark, lambda: a.clone())  # side: after its own work, a = 4
        b.add_(copied.result())
        side.join()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(a, torch.full((4,), 4.0, device=dev)) and torch.equal(b, torch.full((4,), 9.0, device=dev))


def test_fused_moe_takes_the_shared_output_as_a_function():
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, top_k = 5, 32, 16, 4, 2
    x = torch.randn(tokens, hidden, generator=gen)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w_down = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    weights = torch.rand(tokens, top_k, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    shared = torch.randn(tokens, hidden, generator=gen)
    calls = []

    def later():
        calls.append(1)
        return shared

    want = moe.fused_moe(x, w_gate_up, w_down, weights, ids, LIMIT, shared=shared)
    got = moe.fused_moe(x, w_gate_up, w_down, weights, ids, LIMIT, shared=later)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(want, moe.fused_moe(x, w_gate_up, w_down, weights, ids, LIMIT))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_side_stream_schedule_equals_one_stream():
    """Prefill chunks and decode steps of three sequences (CSA, HCA and sliding layers, hash and
    scored MoE) with the side stream and without: equal logits at every step."""
    from oracle import Driver
    from test_model_gpu import randomize_on_device

    from sparseserve.config import ModelConfig
    from sparseserve.model.deepseek_v4 import DeepseekV4ForCausalLM
    from sparseserve.model.loader import load_hf_config, resolve_model_dir

    model_dir, overrides = resolve_model_dir("v4-flash-4l64e")
    cfg = load_hf_config(model_dir, overrides)
    with torch.device("cuda"):  # made on the GPU: no host copy of 4 layers x 64 experts
        model = DeepseekV4ForCausalLM(ModelConfig(cfg, dtype=torch.bfloat16))
    randomize_on_device(model, 3)
    model.to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (300, 517, 130)]

    def run(mode: str) -> list[torch.Tensor]:
        model.side_streams.mode = mode
        driver = Driver(model, num_slots=3, num_blocks=32, block_size=128, max_step_tokens=512, device="cuda",
                        dtype=torch.bfloat16)
        seqs: list[list[int]] = [[] for _ in prompts]
        last: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
        logits = []

        def step(batch):
            for (i, _, ids), out in zip(batch, driver.step(batch)):
                seqs[i] += ids
                last[i] = out[-1]
                logits.append(out)

        while any(len(s) < len(p) for s, p in zip(seqs, prompts)):  # prefill chunks of <= 480 tokens
            step([(i, len(seqs[i]), p[len(seqs[i]):len(seqs[i]) + 160])
                  for i, p in enumerate(prompts) if len(seqs[i]) < len(p)])
        for _ in range(6):  # greedy decode steps, crossing compress boundaries
            step([(i, len(seqs[i]), [int(last[i].argmax())]) for i in range(len(prompts))])
        torch.cuda.synchronize()
        return logits

    inline = run("never")
    overlapped = run("always")  # eager steps: the Driver captures no graph
    assert len(inline) == len(overlapped) > 20
    for a, b in zip(inline, overlapped):
        assert torch.equal(a, b)

