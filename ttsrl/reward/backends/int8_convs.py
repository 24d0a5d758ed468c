"""An int8 ONNX graph's convolutions as integer matrix products: the same sums, a faster kernel.

Kokoro-82M's int8 export quantizes its convolutions dynamically with *unsigned* weights, because
ONNX Runtime's ``ConvInteger`` takes no signed ones; ORT then runs them through its u8 x u8
integer GEMM, the slow one (65% of Kokoro's time on one thread here). :func:`convs_as_matmuls`
writes each stride-1 ``ConvInteger`` as the product it is:

* the quantized input, time-major, padded with its own zero point (the value that stands for 0.0,
  as ConvInteger pads), its k dilated taps side by side: columns [1, T, k*C];
* times the weights moved to int8, ``w - 128`` with the zero point ``zp - 128`` (the same
  ``w - zp``), laid out [k*C, O];
* a ``MatMulInteger`` (u8 x s8), transposed back to ConvInteger's [1, O, T].

Integer sums are exact, so the int32 output equals ConvInteger's and everything downstream,
the waveform included, is the same to the bit; :func:`exact_u8s8_gemm` says where that holds.
ORT's u8 x s8 kernel is exact on x86-64 CPUs with VNNI (AVX-VNNI or AVX512-VNNI, whose ``vpdpbusd``
sums in 32 bits); on those without it, it sums pairs of products in 16 bits and saturates for
weights outside [-64, 63] (onnxruntime commit 040c2f4, "x86/64 U8S8 Gemm Precision Fix"), so
there the original graph must run. Strided or grouped convolutions are left as they are (Kokoro's
three strided ones, of 1 and 22 input channels, are 3 of its 87).
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np

#: bump when the rewrite changes: a cached rewritten graph records the version it was made by
VERSION = 1


def exact_u8s8_gemm(cpuinfo: str | None = None) -> bool:
    """Whether ONNX Runtime's u8 x s8 integer GEMM is exact on this CPU: x86-64 with VNNI.

    Elsewhere (x86 without VNNI, or a CPU whose kernels were not checked here: ARM) False, and the
    original graph runs. ``cpuinfo``: the text of /proc/cpuinfo (read when None; absent off Linux)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return bool(flags & {"avx512_vnni", "avx_vnni"})


def convs_as_matmuls(model) -> int:
    """Rewrite, in place, each stride-1, ungrouped ``ConvInteger`` of ``model`` (an
    ``onnx.ModelProto`` with constant uint8 weights and a scalar weight zero point) as padded,
    time-major input columns times int8 weights (module docstring). Returns how many were rewritten."""
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    added: list = []

    def const(name: str, value) -> str:
        added.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def axis_slice(x: str, start: int, stop_from_end: int, axis: int, out: str):
        # stop_from_end <= 0: that many elements short of the end (0: to the end)
        stop = stop_from_end if stop_from_end < 0 else np.iinfo(np.int64).max
        return helper.make_node("Slice", [x, const(out + "/starts", [start]), const(out + "/ends", [stop]),
                                          const(out + "/axes", [axis])], [out])

    nodes, done = [], 0
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        pads = list(attrs.get("pads", [0, 0]))
        if (node.op_type != "ConvInteger" or len(attrs.get("kernel_shape", ())) != 1
                or list(attrs.get("strides", [1])) != [1] or attrs.get("group", 1) != 1 or pads[0] != pads[1]
                or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET") or len(node.input) < 4
                or node.input[1] not in inits or node.input[3] not in inits):
            nodes.append(node)
            continue
        w = numpy_helper.to_array(inits[node.input[1]])
        w_zero = numpy_helper.to_array(inits[node.input[3]])
        if w.dtype != np.uint8 or w_zero.size != 1:
            nodes.append(node)
            continue
        (k,), (d,), p = attrs["kernel_shape"], attrs.get("dilations", [1]), pads[0]
        out_ch, in_ch, _ = w.shape
        name, x, x_zero = node.name or node.output[0], node.input[0], node.input[2]
        nodes.append(helper.make_node("Transpose", [x], [name + "/time_major"], perm=[0, 2, 1]))
        cols = name + "/time_major"
        if p:
            nodes.append(helper.make_node("Pad", [cols, const(name + "/pads", np.array([0, p, 0, 0, p, 0], np.int64)),
                                                  x_zero], [name + "/padded"], mode="constant"))
            cols = name + "/padded"
        if k > 1:  # tap j reads input step t + j*d for output step t
            taps = [f"{name}/tap{j}" for j in range(k)]
            nodes += [axis_slice(cols, j * d, j * d - d * (k - 1), 1, tap) for j, tap in enumerate(taps)]
            nodes.append(helper.make_node("Concat", taps, [name + "/columns"], axis=2))
            cols = name + "/columns"
        # row j*C + c of the matrix is tap j of input channel c
        w_s8 = (w.astype(np.int16) - 128).astype(np.int8).transpose(2, 1, 0).reshape(k * in_ch, out_ch)
        zero_s8 = np.int8(int(w_zero.reshape(())) - 128)
        nodes.append(helper.make_node("MatMulInteger", [cols, const(name + "/w_s8", np.ascontiguousarray(w_s8)), x_zero,
                                                        const(name + "/w_zero_s8", zero_s8)], [name + "/product"]))
        nodes.append(helper.make_node("Transpose", [name + "/product"], [node.output[0]], perm=[0, 2, 1]))
        done += 1
    used = {i for n in nodes for i in n.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + added)
    return done
