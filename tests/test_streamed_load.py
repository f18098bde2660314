"""The parallel load (model/streamed_load.py): each rank's parts streamed and cut equal the whole
model loaded and then sharded, exactly; the parts are filled one at a time; the fit check counts
the rank's share."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparseserve.distributed.communicator import ParallelGroup
from sparseserve.errors import ModelTooLargeError
from sparseserve.model import loader
from sparseserve.model.loader import CONFIGS_DIR, CheckpointError, load_model
from sparseserve.model.meta_model import weight_plan
from sparseserve.model.release_writer import write_release_checkpoint
from sparseserve.model.sharding import RankSharder, shard_model
from sparseserve.model.streamed_load import model_parts
from sparseserve.model.weight_bytes import ParallelLayout

TINY = CONFIGS_DIR / "tiny"
CPU = torch.device("cpu")
LAYOUTS = [(2, False), (2, True), (4, False)]


def _load(path, shard=None, **kw):
    return load_model(str(path), torch.float32, CPU, progress=False, shard=shard, **kw)


def _assert_same_shard(path, world: int, ep: bool, **kw) -> None:
    for rank in range(world):
        group = ParallelGroup(rank, world, expert_parallel=ep)
        whole, _, whole_mtp = _load(path, **kw)
        shard_model(whole, group)
        streamed, _, streamed_mtp = _load(path, RankSharder(group), **kw)
        want = dict(whole.named_parameters()) | dict(whole.named_buffers())
        got = dict(streamed.named_parameters()) | dict(streamed.named_buffers())
        assert want.keys() == got.keys()
        for name, value in want.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
        for a, b in zip(whole.model.layers, streamed.model.layers):
            assert (a.self_attn.num_heads, a.self_attn.o_groups) == (b.self_attn.num_heads, b.self_attn.o_groups)
            assert getattr(a.mlp, "local_experts", None) == getattr(b.mlp, "local_experts", None)
            assert b.self_attn.tp is group and b.mlp.tp is group
        assert streamed.tp is group
        assert whole_mtp.keys() == streamed_mtp.keys()
        assert all(torch.equal(whole_mtp[k], streamed_mtp[k]) for k in whole_mtp)


@pytest.mark.parametrize("world,ep", LAYOUTS)
def test_streamed_dummy_weights_equal_load_then_shard(world, ep):
    _assert_same_shard(TINY, world, ep, load_format="dummy", seed=3)


@pytest.mark.parametrize("world,ep", LAYOUTS)
def test_streamed_checkpoint_equals_load_then_shard(world, ep):
    _assert_same_shard(TINY, world, ep)


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory):
    """A tiny release checkpoint (FP8 linears, FP4 experts, mtp.* tensors), in small shards."""
    return write_release_checkpoint(tmp_path_factory.mktemp("release") / "fp4", TINY, expert_dtype="fp4", seed=1,
                                    max_shard_bytes=300_000)


@pytest.mark.parametrize("world,ep", [(2, False), (2, True)])
def test_streamed_release_checkpoint_equals_load_then_shard(release_dir, world, ep):
    _assert_same_shard(release_dir, world, ep)


class _Recorder:
    """Records, as each part is cut, which parts are still unallocated (on the meta device)."""

    def __init__(self, group: ParallelGroup) -> None:
        self.inner, self.seen = RankSharder(group), []

    @property
    def layout(self) -> ParallelLayout:
        return self.inner.layout

    def part(self, name, module):
        self.seen.append((name, [n for n, p in self.model.named_parameters() if p.is_meta]))
        self.inner.part(name, module)

    def finish(self, model):
        self.inner.finish(model)


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_parts_are_filled_one_at_a_time_in_parameter_order(monkeypatch, load_format):
    recorder = _Recorder(ParallelGroup(1, 2))
    build = loader.DeepseekV4ForCausalLM

    def keep(config):
        recorder.model = build(config)
        return recorder.model
    monkeypatch.setattr(loader, "DeepseekV4ForCausalLM", keep)
    keep.rope_buffers = build.rope_buffers
    model, _, _ = _load(TINY, recorder, load_format=load_format)
    parts = model_parts(model)
    assert [name for name, _ in recorder.seen] == [name for name, _ in parts]
    order = [n for name, part in parts for n, _ in part.named_parameters(prefix=name)]
    assert order == [n for n, _ in model.named_parameters()]  # every parameter in exactly one part, in order
    for k, (name, still_meta) in enumerate(recorder.seen):
        done = {n for pname, part in parts[:k + 1] for n, _ in part.named_parameters(prefix=pname)}
        assert set(still_meta) == set(order) - done, name  # this part and the earlier ones only are allocated


@pytest.mark.parametrize("world,ep", [(1, False), (2, False), (2, True), (4, False), (4, True)])
def test_bytes_per_gpu_are_what_a_rank_holds(world, ep):
    """The fit check's per-GPU count is the streamed shard's bytes exactly (the tiny model has 2
    output groups: 4 ranks share each)."""
    plan = weight_plan(loader.ModelConfig(loader.load_hf_config(TINY), dtype=torch.float32), torch.float32)
    want = plan.at(ParallelLayout(world, ep)).per_gpu_bytes
    for rank in range(world):
        sharder = RankSharder(ParallelGroup(rank, world, expert_parallel=ep)) if world > 1 else None
        model, _, _ = _load(TINY, sharder, load_format="dummy")
        held = [*model.parameters(), *model.buffers()]
        assert sum(t.numel() * t.element_size() for t in held) == want, rank


def test_fit_check_counts_the_ranks_share(monkeypatch):
    plan = weight_plan(loader.ModelConfig(loader.load_hf_config(TINY), dtype=torch.float32), torch.float32)
    whole, share = plan.at().per_gpu_bytes, plan.at(ParallelLayout(2, True)).per_gpu_bytes
    assert share < whole
    monkeypatch.setattr(loader, "available_memory_bytes", lambda device: (whole + share) // 2)
    with pytest.raises(ModelTooLargeError, match="per GPU"):
        _load(TINY, load_format="dummy")
    model, _, _ = _load(TINY, RankSharder(ParallelGroup(0, 2, expert_parallel=True)), load_format="dummy")
    assert model.tp.world_size == 2
    monkeypatch.setattr(loader, "available_memory_bytes", lambda device: share - 1)
    with pytest.raises(ModelTooLargeError, match="per GPU"):
        _load(TINY, RankSharder(ParallelGroup(0, 2, expert_parallel=True)), load_format="dummy")


def _tiny_copy(tmp_path, edit):
    tmp_path.mkdir()
    tensors = load_file(str(TINY / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    return tmp_path


def test_streamed_load_names_missing_and_unexpected_tensors(tmp_path):
    sharder = RankSharder(ParallelGroup(0, 2))
    name = next(n for n in load_file(str(TINY / "model.safetensors")) if ".layers.1." in n)
    missing = _tiny_copy(tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="missing"):
        _load(missing, sharder)
    extra = _tiny_copy(tmp_path / "extra", lambda t: t.update(stray=torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unexpected tensor.*stray"):
        _load(extra, sharder)


def test_quantization_with_a_parallel_load_is_refused():
    with pytest.raises(ValueError, match="quantization='fp8'"):
        _load(TINY, RankSharder(ParallelGroup(0, 2)), load_format="dummy", quantization="fp8")
