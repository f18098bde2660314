"""CPU tests of the graph machinery's host logic: buckets, padding, the audit's comparison,
and the watchdog."""
import pytest

from sparseserve.model.batch import SequenceChunk
from sparseserve.worker.cuda_graph import decode_batch, default_graph_sizes, pad_chunks, pick_bucket
from sparseserve.worker.graph_signature import GraphNode, node_difference
from sparseserve.engine.graph_audit import interesting_lengths
from sparseserve.worker.watchdog import StepTimeoutError, StepWatchdog


def test_default_sizes_and_bucket_choice():
    assert default_graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_graph_sizes(3) == [1, 2, 3]
    sizes = [1, 2, 4, 8, 16]
    assert [pick_bucket(sizes, n) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert pick_bucket(sizes, 17) is None


def test_padding_touches_only_the_dummy_slot_and_no_blocks():
    real = [SequenceChunk(slot=0, start_pos=40, token_ids=[7], block_ids=[3, 4, 5]),
            SequenceChunk(slot=2, start_pos=9, token_ids=[8], block_ids=[6])]
    padded = pad_chunks(real, 4, 1, dummy_slot=5)
    batch = decode_batch(padded, [4, 16], "cpu", max_blocks=8, num_entries={4: 64, 16: 16})
    assert batch.seq_slots.tolist() == [0, 2, 5, 5]
    assert (batch.block_table[2:] == -1).all() and batch.block_table[0, :3].tolist() == [3, 4, 5]
    assert batch.logits_indices.tolist() == [0, 1, 2, 3]
    assert batch.positions[:2].tolist() == [40, 9]
    assert batch.num_entries == {4: 64, 16: 16}
    assert all(t.tolist() == [0, 1, 2, 3] for t in batch.emit_tokens.values())  # kernels mask non-closing ones


def captured_nodes(reset_workspace: bool, grid: int = 4) -> list[GraphNode]:
    """A decode graph's nodes as the driver lists them (fake): the persistent top-k's workspace zeroing
    (a fill kernel) is recorded only when the host `if` let it run at capture time."""
    nodes = [GraphNode("KERNEL", "_embed_streams_kernel", (grid, 4, 1), (128, 1, 1)),
             GraphNode("KERNEL", "_indexer_scores_kernel", (grid * 8, 1, 1), (128, 1, 1), 0),
             GraphNode("EVENT_RECORD"), GraphNode("WAIT_EVENT"),
             GraphNode("KERNEL", "_p_select_kernel", (132, 1, 1), (256, 1, 1), 1024)]
    if reset_workspace:
        nodes.insert(2, GraphNode("KERNEL", "vectorized_elementwise_kernel<FillFunctor>", (1, 1, 1), (128, 1, 1)))
    return nodes


def test_node_comparison_catches_the_frozen_workspace_reset():
    """The seed's bug class: the capture at a short dummy length skipped the zeroing that the capture at
    max_model_len recorded. The comparison names the missing node; listing order does not matter."""
    short, long = captured_nodes(reset_workspace=False), captured_nodes(reset_workspace=True)
    diff = node_difference(short, long, "short", "long")
    assert diff is not None and "FillFunctor" in diff and "0 only in the first capture, 1 only in the second" in diff
    assert node_difference(long, list(reversed(long)), "a", "b") is None
    assert node_difference(short, captured_nodes(reset_workspace=False), "a", "b") is None


def test_node_comparison_catches_a_launch_shape_frozen_from_the_lengths():
    """A grid computed on the host from the dummy lengths differs between the two captures."""
    diff = node_difference(captured_nodes(False, grid=4), captured_nodes(False, grid=5), "short", "long")
    assert diff is not None and "_embed_streams_kernel grid=(4, 4, 1)" in diff
    assert "_embed_streams_kernel grid=(5, 4, 1)" in diff and "_p_select_kernel" not in diff
    assert str(GraphNode("MEMSET")) == "MEMSET"


def test_audit_samples_each_topk_path_and_the_extremes():
    """The default capture audit compares the smallest and largest bucket and the first of each top-k
    path; with the replay audit, every bucket."""
    from sparseserve.worker.cuda_graph import CudaGraphRunner

    runner = CudaGraphRunner.__new__(CudaGraphRunner)  # only the fields audit_sizes reads
    runner.sizes, runner.query_len = [1, 2, 4, 8, 16, 24, 32, 40], 1
    runner.topk_for = lambda rows: (None, "standard" if rows < 16 else "persistent")
    assert runner.audit_sizes(every=False) == [1, 16, 40]
    assert runner.audit_sizes(every=True) == runner.sizes
    runner.topk_for = None
    assert runner.audit_sizes(every=False) == [1, 40]


def test_interesting_lengths_cover_boundaries():
    pts = interesting_lengths(4096, [4, 128], 2048)
    for p in (3, 4, 5, 127, 128, 129, 2047, 2048, 2049, 4096):
        assert p in pts


class NeverDone:
    def query(self):
        return False


class DoneAfter:
    def __init__(self, n):
        self.n = n

    def query(self):
        self.n -= 1
        return self.n <= 0


def test_watchdog_turns_a_hang_into_an_error():
    dog = StepWatchdog(0.05)
    with pytest.raises(StepTimeoutError, match="graph batch=8, query_len=1, topk_path=persistent"):
        dog.wait(NeverDone(), lambda: "graph batch=8, query_len=1, topk_path=persistent, lengths 5/4000")
    dog.wait(DoneAfter(3), lambda: "unused")
    with pytest.raises(ValueError):
        StepWatchdog(0)



def test_static_batch_fill_reproduces_a_verify_step_batch():
    """Graph inputs arrive through one flat int64 buffer plus the block table; every field must
    come out as the host batch built for the step (here a verify step: 2 tokens per sequence)."""
    import torch

    from sparseserve.worker.cuda_graph import StaticBatch

    template = decode_batch(pad_chunks([], 4, 2, 7, want_logits="all"), [4], "cpu", max_blocks=4, num_entries={4: 8})
    static = StaticBatch(template)
    real = [SequenceChunk(0, 5, [11, 12], [0, 1], "all"), SequenceChunk(1, 9, [13, 14], [2], "all")]
    step = decode_batch(pad_chunks(real, 4, 2, 7, want_logits="all"), [4], "cpu", max_blocks=4, num_entries={4: 8})
    static.fill(step)
    for name in (*StaticBatch.INT64_FIELDS, "block_table"):
        assert torch.equal(getattr(static.batch, name), getattr(step, name)), name
    assert static.batch.input_ids.tolist() == [11, 12, 13, 14, 0, 0, 0, 0]
    assert static.batch.logits_indices.tolist() == list(range(8))


def test_padded_decode_steps_equal_plain_steps():
    """Decode steps built as graphs build them (padded to a bucket, every token a possible window
    closer, the per-slot block-table cache, async scheduling) give the tokens of plain eager steps,
    over lengths that cross compress windows and block boundaries, with requests finishing and
    their slots reused mid-run."""
    from sparseserve import LLM, SamplingParams
    from sparseserve.model.loader import CONFIGS_DIR

    prompts = [{"prompt_token_ids": [(3 + 11 * i + 5 * j) % 500 + 2 for i in range(n)]}
               for j, n in enumerate([3, 15, 16, 17, 62, 127, 129, 40, 7])]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (21, 9, 30, 14, 25, 5, 18, 33, 12)]
    results = []
    for padded in (False, True):
        llm = LLM(str(CONFIGS_DIR / "tiny"), device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4,
                  cuda_graph_sizes=[1, 2, 4], async_scheduling=True)
        llm.llm_engine.runner.pad_like_graphs = padded
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.llm_engine.all_cache_free()
    assert results[0] == results[1]


def test_historical_topk_bug_patch_sees_the_host_lengths(historical_topk_bug):
    """The test-only patch reads the longest sequence of the batch built last, as the frozen host
    `if` did: a padded decode step's dummy rows count, and the skip happens only at <= k."""
    real = [SequenceChunk(slot=0, start_pos=40, token_ids=[7], block_ids=[3]),
            SequenceChunk(slot=1, start_pos=9, token_ids=[8], block_ids=[6])]
    decode_batch(pad_chunks(real, 4, 1, dummy_slot=5, dummy_len=2), [4], "cpu", max_blocks=2, num_entries={4: 16})
    assert historical_topk_bug.host_max_len == 41
    decode_batch(pad_chunks([], 2, 1, dummy_slot=5, dummy_len=2), [4], "cpu", max_blocks=2, num_entries={4: 16})
    assert historical_topk_bug.host_max_len == 2
    assert historical_topk_bug.skips_reset(k=2) and not historical_topk_bug.skips_reset(k=1)


def test_a_catch_up_graph_takes_the_target_graphs_metadata_on_the_device():
    """`StaticBatch.fill_like`: the drafter's catch-up graph (no compress rates) copies the metadata of
    the target graph (the model's rates) that just ran the same chunks, and gets what a host build of
    those chunks would give it; a bucket of another size copies nothing."""
    import torch

    from sparseserve.model.batch import INT64_FIELDS, build_batch
    from sparseserve.worker.cuda_graph import StaticBatch

    def static(batch_size: int, rates: list[int]) -> StaticBatch:
        template = decode_batch(pad_chunks([], batch_size, 1, 5, 2), rates, "cpu", 8, {r: 256 // r for r in rates})
        return StaticBatch(template)

    real = [SequenceChunk(0, 40, [7], [3, 4, 5]), SequenceChunk(2, 9, [8], [6]), SequenceChunk(1, 70, [9], [1, 2])]
    padded = pad_chunks(real, 4, 1, dummy_slot=5)
    target, catch_up, by_host = static(4, [4, 16]), static(4, []), static(4, [])
    target.fill(build_batch(padded, [4, 16], "cpu", max_blocks=8, num_entries={4: 64, 16: 16}))
    by_host.fill(build_batch(padded, [], "cpu", max_blocks=8, num_entries={}))
    assert catch_up.fill_like(target)
    for name in INT64_FIELDS + ("block_table",):
        assert torch.equal(getattr(catch_up.batch, name), getattr(by_host.batch, name)), name
    assert catch_up.batch.positions[:3].tolist() == [40, 9, 70]
    other = static(8, [])
    before = other.flat.clone()
    assert not other.fill_like(target) and torch.equal(other.flat, before)
