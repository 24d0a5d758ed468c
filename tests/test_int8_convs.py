"""Int8 convolutions as integer matrix products (ttsrl.reward.backends.int8_convs): the same int32 sums
as ONNX Runtime's ConvInteger, so the same output to the bit."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from ttsrl.reward.backends.int8_convs import convs_as_matmuls, exact_u8s8_gemm  # noqa: E402

# (kernel, dilation, pad, stride): stride 1 is rewritten, whatever its kernel, dilation and padding
SHAPES = [(3, 1, 1, 1), (11, 5, 25, 1), (7, 3, 9, 1), (1, 1, 0, 1), (3, 1, 0, 1), (5, 1, 1, 2)]


def quantized_convs(rng, in_ch=6, out_ch=5):
    """x (float) -> DynamicQuantizeLinear -> one ConvInteger per shape, each an int32 output. The
    weights are uint8 in [64, 191], so w - 128 lies in [-64, 63]: a u8 x s8 pair sum fits 16 bits
    and ORT's product is exact on every x86 CPU, VNNI or not (where this test's equality holds)."""
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"])]
    inits, outputs = [], []
    for i, (k, d, p, s) in enumerate(SHAPES):
        w = rng.integers(64, 192, size=(out_ch, in_ch, k), dtype=np.uint8)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(np.uint8(rng.integers(100, 156)), f"wz{i}")]
        nodes.append(helper.make_node("ConvInteger", ["xq", f"w{i}", "xz", f"wz{i}"], [f"y{i}"], name=f"conv{i}",
                                      kernel_shape=[k], dilations=[d], pads=[p, p], strides=[s]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.INT32, [1, out_ch, None]))
    graph = helper.make_graph(nodes, "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, in_ch, None])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def run(model, x):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), sess_options=opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def test_rewritten_convs_give_convintegers_int32_sums_exactly():
    rng = np.random.default_rng(0)
    model = quantized_convs(rng)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    assert convs_as_matmuls(rewritten) == len(SHAPES) - 1  # the strided one is left as it is
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops.count("ConvInteger") == 1 and ops.count("MatMulInteger") == len(SHAPES) - 1
    onnx.checker.check_model(rewritten)
    for length in (40, 97):  # padding and the taps' slices depend on the length only at run time
        x = (rng.standard_normal((1, 6, length)) * 3).astype(np.float32)
        x[0, :, :5] = 0.0  # the zero point itself among the values
        want, got = run(model, x), run(rewritten, x)
        for (k, d, p, s), a, b in zip(SHAPES, want, got):
            assert a.dtype == b.dtype == np.int32 and a.shape == b.shape, (k, d, p, s)
            assert np.array_equal(a, b), (k, d, p, s)


def test_a_graph_without_uint8_constant_weights_is_left_alone():
    rng = np.random.default_rng(1)
    model = quantized_convs(rng)
    model.graph.node[1].input[1] = "x"  # weights from a graph input: not a constant to move to int8
    assert convs_as_matmuls(model) == len(SHAPES) - 2


@pytest.mark.parametrize("flags, exact", [
    ("fpu sse4_1 avx2 avx512f avx512_vnni avx512_bf16", True),
    ("fpu sse4_1 avx2 avx_vnni", True),
    ("fpu sse4_1 avx2 avx512f avx512bw", False),  # Skylake: 16-bit pair sums, saturating
    ("fpu sse4_1 avx2", False),
])
def test_the_product_is_trusted_only_where_vnni_sums_in_32_bits(flags, exact, monkeypatch):
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert exact_u8s8_gemm(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n") is exact
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert exact_u8s8_gemm(f"flags\t\t: {flags}\n") is False
