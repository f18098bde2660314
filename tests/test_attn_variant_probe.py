"""tools/attn_variant_probe.py's trace summary reads the clock marks as the trace variant writes them."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import attn_variant_probe as probe  # noqa: E402


def test_trace_summary_reads_phases_per_tile():
    """Two programs: the first with units of 2 tiles and 1 tile, the second with one tile; untraced slots are -1.
    Each tile's phases last 10, 20, 30, 40 cycles and its epilogue 5 (50 on a unit's last tile), with a gap of 3
    between tiles."""
    trace = torch.full((2, probe.TRACE_TILES, 8), -1, dtype=torch.int64)
    tiles = {0: [(0, 0), (0, 1), (132, 0)], 1: [(1, 0)]}  # program -> [(unit, tile in unit)]
    for prog, seq in tiles.items():
        t = 1000 * (prog + 1)
        for j, (unit, tile) in enumerate(seq):
            unit_ends = j + 1 == len(seq) or seq[j + 1][1] == 0
            marks = [t, t + 10, t + 30, t + 60, t + 100, t + 100 + (50 if unit_ends else 5)]
            trace[prog, j, :6] = torch.tensor(marks)
            trace[prog, j, 6:] = torch.tensor([unit, tile])
            t = marks[5] + 3
    out = probe.trace_summary(trace)
    assert out["rows landed"] == 10 and out["QK^T"] == 20 and out["softmax + p"] == 30 and out["PV"] == 40
    assert out["tiles traced"] == 4 and out["loop gap"] == 3
    # Last tiles of a unit that the trace can see (the next tile starts a unit): program 0's tile 1 only.
    assert out["epilogue (units' last tiles)"] == 50
    assert out["cycles per program"] == ((105 + 3 + 150 + 3 + 150) + 150) / 2


def test_trace_summary_reads_epilogue_and_gather_marks():
    """trace_epi's marks (slots 8-11) split a unit's last-tile epilogue into five pieces; trace_gather's (12, 13) give
    the gather's issue-to-landed time on every tile that has them. One program, two one-tile units."""
    trace = torch.full((1, probe.TRACE_TILES, probe.TRACE_SLOTS), -1, dtype=torch.int64)
    for j in range(2):
        t = 1000 * j
        trace[0, j, :6] = torch.tensor([t, t + 10, t + 30, t + 60, t + 100, t + 100 + 150])
        trace[0, j, 6:8] = torch.tensor([j, 0])
        trace[0, j, 8:12] = torch.tensor([t + 110, t + 130, t + 160, t + 200])  # pieces 10, 20, 30, 40, then 50
        trace[0, j, 12:14] = torch.tensor([t + 12, t + 12 + 7 * (j + 1)])  # 7 and 14 cycles
    out = probe.trace_summary(trace)
    assert out["epilogue (units' last tiles)"] == 150
    assert [out["epilogue: " + name] for name in probe._EPI_PHASES] == [10, 20, 30, 40, 50]
    assert out["gather: issue -> landed"] == 10.5
