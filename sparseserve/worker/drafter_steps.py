"""The MTP drafter's steps as the model runner runs them: the layer's forward (its streams out) and
its state-only catch-up (`MTPModule.forward_state`, for steps that propose nothing), each by graph
replay when a graph holds the step, else eagerly (on CUDA padded and built as the graph would be,
docs/design.md invariant 5); and the graph runners of both."""
from __future__ import annotations

import torch

from ..model.batch import BatchMetadata, SequenceChunk, build_batch
from .cuda_graph import BufferSpec, CudaGraphRunner, decode_batch, logits_mode, pad_chunks, set_positions


def drafter_graph_runners(runner, streams: BufferSpec, plain_target: CudaGraphRunner, pool,
                          common: dict) -> list[CudaGraphRunner]:
    """The drafter's graphs: its forward at every query length of the runner, and with adaptive
    speculation its state-only catch-up at query length 1 (plain steps), which reads the plain
    target graph's streams buffer in place (no copy of the streams before each replay)."""
    mtp = runner.mtp

    def forward_step(batch, topk, hidden, outputs) -> None:
        outputs[0].copy_(mtp(batch, hidden, runner.speculator.state, runner.model))

    def catch_up_step(batch, topk, hidden, outputs) -> None:
        mtp.forward_state(batch, hidden, runner.speculator.state, runner.model)

    runners = [CudaGraphRunner("mtp", forward_step, [streams], rates=mtp.config.rates,
                               sizes=runner.graph_sizes_for(q), query_len=q, num_entries={}, topk_for=None,
                               hidden=streams, pool=pool, **common) for q in runner.query_lens]
    if runner.options.adaptive_speculation:
        runners.append(CudaGraphRunner("mtp_state", catch_up_step, [], rates=mtp.config.rates,
                                       sizes=runner.graph_sizes_for(1), query_len=1, num_entries={}, topk_for=None,
                                       hidden=streams, hidden_buffer=plain_target.outputs[1], pool=pool, **common))
    return runners


def mtp_forward(runner, chunks: list[SequenceChunk], hidden: torch.Tensor, input_ids: torch.Tensor | None,
                positions: torch.Tensor | None) -> torch.Tensor:
    """The MTP block's streams for `chunks` (`ModelRunner.mtp_forward`)."""
    shape = runner.graph_shape(chunks, check_logits=False)
    if shape is not None and shape[1] in runner.mtp_graphs:
        return runner.mtp_graphs[shape[1]].run(chunks, hidden, input_ids, positions)[0][0]
    batch, hidden = _eager_batch(runner, chunks, shape, hidden, input_ids, positions)
    return runner.mtp(batch, hidden, runner.speculator.state, runner.model)


def mtp_catch_up(runner, chunks: list[SequenceChunk], hidden: torch.Tensor, input_ids: torch.Tensor | None) -> None:
    """The layer's state-only catch-up over `chunks` (`ModelRunner.mtp_catch_up`). When `chunks` are
    the ones the last target forward replayed, the replay takes that graph's metadata, copied on the
    device (no host metadata build)."""
    shape = runner.graph_shape(chunks, check_logits=False)
    if shape is not None and shape[1] in runner.mtp_state_graphs:
        replayed = runner.replayed
        like = replayed[1] if replayed is not None and replayed[0] is chunks else None
        runner.mtp_state_graphs[shape[1]].run(chunks, hidden, input_ids, like=like)
        return
    batch, hidden = _eager_batch(runner, chunks, shape, hidden, input_ids, None)
    runner.mtp.forward_state(batch, hidden, runner.speculator.state, runner.model)


def _eager_batch(runner, chunks: list[SequenceChunk], shape: tuple[int, int] | None, hidden: torch.Tensor,
                 input_ids: torch.Tensor | None, positions: torch.Tensor | None
                 ) -> tuple[BatchMetadata, torch.Tensor]:
    """An eager drafter step's metadata (padded like its graph on CUDA) and input rows."""
    num_tokens = sum(len(c.token_ids) for c in chunks)
    rates = runner.mtp.config.rates
    if shape is not None and runner.pad_like_graphs:
        bucket, q = shape
        chunks = pad_chunks(chunks, bucket, q, runner.max_num_seqs, want_logits=logits_mode(q))
        batch = decode_batch(chunks, rates, runner.device, runner.max_blocks_per_seq, {})
    else:
        batch = build_batch(chunks, rates, runner.device)
    if input_ids is not None:
        batch.input_ids[: input_ids.shape[0]] = input_ids
    if positions is not None:
        set_positions(batch, positions)
    rows = batch.num_tokens
    if hidden.shape[0] < rows:
        hidden = torch.cat([hidden[:num_tokens], hidden.new_zeros(rows - num_tokens, *hidden.shape[1:])])
    return batch, hidden[:rows]
