"""The padded piecewise forward (model/pieces.py, what the prefill graphs capture and run between their
pieces) on the CPU: it equals the plain forward bit for bit and leaves the same state, the padding tokens
route to no expert, and the buckets and their option are checked."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from sparseserve.config import EngineConfig
from sparseserve.errors import ConfigError, ConfigTypeError
from sparseserve.worker.prefill_graphs import (default_prefill_graph_sizes, map_tensors, prefill_graph_sizes,
                                               tensor_addresses, weak_ref)
from sparseserve.worker.cuda_graph import pick_bucket

TESTS = pathlib.Path(__file__).parent


def test_padded_forward_equals_the_plain_forward_bitwise_and_leaves_the_same_state():
    """Mixed steps (chunked prefill beside decode rows, ragged lengths, chunks across compress windows and
    blocks, logits of all, last or no tokens) padded to 8/32/64-token buckets: the real tokens' streams and
    logits are bitwise those of the plain forward, and every state tensor is identical but for the trash
    rows (float32; every layer kind, hc 4 with other rates, block-FP8 weights; see prefill_pieces_check.py for
    why it runs in a process of its own)."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default",
               PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(TESTS / "prefill_pieces_check.py")], capture_output=True, text=True,
                          timeout=300, env=env, cwd=TESTS)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(results) == {"all-kinds", "fp8-weights", "hc4-rates-2-8-deeper"}
    for name, steps in results.items():
        assert any(s["bucket"] > s["tokens"] for s in steps) and any(s["bucket"] == s["tokens"] for s in steps)
        for i, step in enumerate(steps):
            assert step["streams_equal"] and step["logits_equal"], (name, i, step)
            assert not step["state_differs"], (name, i, step["state_differs"])


def test_padding_tokens_route_to_no_expert(monkeypatch):
    """`valid` (the padding mask) gives the padding tokens expert id -1, which the MoE skips: the real
    tokens get their unpadded output (to float rounding here: in this process the vectorised CPU kernels
    round a tensor's tail elements their own way) from the same expert ids."""
    from oracle import randomize, tiny_config
    from sparseserve.model.layers import moe as moe_layer

    routed = []
    fused = moe_layer.fused_moe

    def recording(x, w_gate_up, w_down, weights, ids, *args, **kwargs):
        routed.append(ids)
        return fused(x, w_gate_up, w_down, weights, ids, *args, **kwargs)

    monkeypatch.setattr(moe_layer, "fused_moe", recording)
    hf = tiny_config()
    for is_hash in (False, True):
        moe = moe_layer.SparseMoE(hf, is_hash)
        randomize(moe, 7)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(11, hf.hidden_size, generator=gen)
        ids = torch.randint(0, hf.vocab_size, (11,), generator=gen)
        with torch.no_grad():
            real = moe(x[:6], ids[:6])
            padded = moe(x, ids, valid=torch.arange(11) < 6)
        torch.testing.assert_close(padded[:6], real, rtol=0, atol=1e-5)
        assert (routed[-1][6:] == -1).all() and torch.equal(routed[-1][:6], routed[-2])


def test_default_buckets_and_bucket_choice():
    assert default_prefill_graph_sizes(8192) == [16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536,
                                                 1792, 2048]
    assert default_prefill_graph_sizes(1000)[-3:] == [768, 896, 1000]
    assert default_prefill_graph_sizes(100) == [16, 32, 64, 100]
    assert default_prefill_graph_sizes(8) == [8]
    sizes = default_prefill_graph_sizes(2048)
    assert [pick_bucket(sizes, n) for n in (1, 16, 17, 257, 1025, 2048)] == [16, 16, 32, 384, 1280, 2048]
    assert pick_bucket(sizes, 2049) is None  # a larger step runs eagerly


def test_bucket_option_is_checked():
    assert prefill_graph_sizes([512, 16, 512], 2048) == [16, 512]
    assert prefill_graph_sizes(None, 300)[-1] == 300
    for bad in ([0], [4096], [], [16, True], [16.0]):
        with pytest.raises(ConfigError, match="prefill_cuda_graph_sizes"):
            prefill_graph_sizes(bad, 2048)
    with pytest.raises(ConfigTypeError, match="prefill_cuda_graph_sizes"):
        EngineConfig(prefill_cuda_graph_sizes="16,32").validate()
    with pytest.raises(ConfigError, match=r"prefill_cuda_graph_sizes\[1\]"):
        EngineConfig(prefill_cuda_graph_sizes=[16, 9000], max_num_batched_tokens=8192).validate()
    with pytest.raises(ConfigError, match="cudagraph_mode"):
        EngineConfig(cudagraph_mode="piecewise").validate()
    EngineConfig(prefill_cuda_graph_sizes=[16, 8192], cudagraph_mode="full_decode_only").validate()


def test_the_command_line_sets_the_options():
    import argparse

    from sparseserve.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--prefill-cuda-graph-sizes", "64", "512", "--cudagraph-mode", "full_decode_only"])
    kwargs = engine_kwargs(args)
    assert kwargs["prefill_cuda_graph_sizes"] == [64, 512] and kwargs["cudagraph_mode"] == "full_decode_only"


def test_pieces_hand_on_views_that_do_not_own_their_memory():
    """What a captured piece keeps of its outputs: views at the same addresses, through every container the
    pieces return, that do not keep the memory allocated."""
    from sparseserve.model.pieces import AttnPre, LayerCarry, TokenInputs

    base = torch.arange(24.0)
    tokens = TokenInputs(base[:4].long(), {"main": (base[:2], base[2:4])}, base[4:8], {(4, True): base[8:12]})
    carry = LayerCarry(base.view(4, 6), pre=AttnPre(base[:6].view(2, 3), base[6:8], None, None, None, None, None))
    weak = map_tensors(weak_ref, (tokens, carry))
    assert tensor_addresses(weak) == tensor_addresses((tokens, carry))
    assert isinstance(weak[0], TokenInputs) and isinstance(weak[1], LayerCarry) and isinstance(weak[1].pre, AttnPre)
    base[7] = -1.0
    assert weak[1].pre.kv[1].item() == -1.0 and weak[0].comp_staging[(4, True)].stride() == (1,)
    assert weak[1].streams.shape == (4, 6) and weak[1].pre.comp is None
