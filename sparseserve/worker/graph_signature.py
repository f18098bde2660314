"""What a captured CUDA graph recorded, as a comparable list of nodes, read from the graph itself.

The capture audit compares two captures of one graph made under different dummy lengths: a host
branch on data frozen into a capture (docs/design.md, invariant 1) shows up as a kernel or memset
that one capture holds and the other lacks, or as a launch of another shape. The nodes are read with
the driver's graph API (`cuGraphGetNodes`, `cuGraphNodeGetType`, `cuGraphKernelNodeGetParams_v2`,
`cuFuncGetName`) through ctypes: a walk over a few thousand nodes takes milliseconds, against
seconds for `CUDAGraph.debug_dump`'s DOT text and its parsing. The graph must be captured with
`keep_graph=True` (torch then instantiates it at `instantiate()` or the first replay).

The comparison is of multisets: the order in which the driver lists nodes is not specified, and a
frozen branch adds, drops or reshapes launches rather than reordering identical ones.
"""
from __future__ import annotations

import ctypes
import difflib
from collections import Counter
from dataclasses import dataclass

# CUgraphNodeType values (cuda.h).
NODE_KINDS = {0: "KERNEL", 1: "MEMCPY", 2: "MEMSET", 3: "HOST", 4: "GRAPH", 5: "EMPTY", 6: "WAIT_EVENT",
              7: "EVENT_RECORD", 8: "EXT_SEMAS_SIGNAL", 9: "EXT_SEMAS_WAIT", 10: "MEM_ALLOC", 11: "MEM_FREE",
              12: "BATCH_MEM_OP", 13: "CONDITIONAL"}


@dataclass(frozen=True, order=True)
class GraphNode:
    """One node: its kind, and for a kernel its name, grid, block and dynamic shared memory."""

    kind: str
    name: str = ""
    grid: tuple[int, int, int] = (0, 0, 0)
    block: tuple[int, int, int] = (0, 0, 0)
    shared_bytes: int = 0

    def __str__(self) -> str:
        if self.kind != "KERNEL":
            return self.kind
        return f"KERNEL {self.name} grid={self.grid} block={self.block} smem={self.shared_bytes}"


class _KernelParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (its first fields are the v1 struct's)."""

    _fields_ = [("func", ctypes.c_void_p),
                ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class GraphWalkError(RuntimeError):
    """The driver's graph API is not reachable or refused a call."""


class _Driver:
    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise GraphWalkError(f"libcuda.so.1 could not be loaded: {exc}") from exc
        lib = self.lib
        self.get_nodes = lib.cuGraphGetNodes
        self.get_nodes.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
        self.get_type = lib.cuGraphNodeGetType
        self.get_type.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        self.kernel_params = getattr(lib, "cuGraphKernelNodeGetParams_v2", None) or lib.cuGraphKernelNodeGetParams
        self.kernel_params.argtypes = [ctypes.c_void_p, ctypes.POINTER(_KernelParams)]
        self.func_name = getattr(lib, "cuFuncGetName", None)
        if self.func_name is not None:
            self.func_name.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p]
        self.kernel_name = getattr(lib, "cuKernelGetName", None)
        if self.kernel_name is not None:
            self.kernel_name.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p]
        self.names: dict[int, str] = {}

    def check(self, result: int, what: str) -> None:
        if result != 0:
            raise GraphWalkError(f"{what} returned CUresult {result}")

    def name_of(self, params: _KernelParams) -> str:
        key = params.func or params.kern or 0
        if key in self.names:
            return self.names[key]
        name = None
        out = ctypes.c_char_p()
        if params.func and self.func_name is not None and self.func_name(ctypes.byref(out), params.func) == 0:
            name = out.value
        elif params.kern and self.kernel_name is not None and self.kernel_name(ctypes.byref(out), params.kern) == 0:
            name = out.value
        # Without a name the handle still tells kernels apart within this process.
        self.names[key] = name.decode(errors="replace") if name else f"function@{key:#x}"
        return self.names[key]


_DRIVER: _Driver | None = None


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


def graph_nodes(graph) -> list[GraphNode]:
    """The nodes of a `torch.cuda.CUDAGraph` captured with keep_graph=True (before or after its
    instantiation). Raises GraphWalkError when the driver cannot be asked."""
    drv = _driver()
    raw = ctypes.c_void_p(int(graph.raw_cuda_graph()))
    count = ctypes.c_size_t(0)
    drv.check(drv.get_nodes(raw, None, ctypes.byref(count)), "cuGraphGetNodes")
    handles = (ctypes.c_void_p * max(count.value, 1))()
    drv.check(drv.get_nodes(raw, handles, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = []
    kind = ctypes.c_int()
    for i in range(count.value):
        drv.check(drv.get_type(handles[i], ctypes.byref(kind)), "cuGraphNodeGetType")
        label = NODE_KINDS.get(kind.value, f"NODE{kind.value}")
        if label != "KERNEL":
            nodes.append(GraphNode(label))
            continue
        params = _KernelParams()
        drv.check(drv.kernel_params(handles[i], ctypes.byref(params)), "cuGraphKernelNodeGetParams")
        nodes.append(GraphNode("KERNEL", drv.name_of(params), (params.gridDimX, params.gridDimY, params.gridDimZ),
                               (params.blockDimX, params.blockDimY, params.blockDimZ), params.sharedMemBytes))
    return nodes


def node_difference(first: list[GraphNode], second: list[GraphNode], first_label: str, second_label: str,
                    most: int = 40) -> str | None:
    """None when both captures hold the same nodes (as multisets); else a diff of the nodes that only
    one of them holds (at most `most` lines)."""
    a, b = Counter(first), Counter(second)
    if a == b:
        return None
    only_a = sorted((a - b).elements())
    only_b = sorted((b - a).elements())
    lines = list(difflib.unified_diff([str(n) for n in only_a], [str(n) for n in only_b], first_label, second_label,
                                      lineterm="", n=0))
    head = (f"{len(first)} vs {len(second)} nodes; {len(only_a)} only in the first capture, "
            f"{len(only_b)} only in the second")
    return "\n".join([head] + lines[:most] + ([f"... {len(lines) - most} more lines"] if len(lines) > most else []))
