"""Moonshine's shipped model files -> the ONNX models voice.moonshine runs (done once, at pull).

`moonshine-cpp==0.1.4` ships Moonshine base English as two ORT-format files (the
flatbuffer format onnxruntime saves for mobile builds) whose int8 weights are turned back
into float by Cast -> Mul -> Add nodes on every call: run as shipped, that costs ~1.65 s a
3 s utterance on one core, ten times the model itself. So, once:

1. read the ORT flatbuffers into plain ONNX graphs (`ort_to_onnx`; onnxruntime ships the
   flatbuffer schema, the `onnx` package builds the graph);
2. fold the de-quantisation into float initializers (`fold_constant_nodes`);
3. split the merged decoder (an `If` on `use_cache_branch` over a first-step and a
   with-past branch) into two models (`split_merged_decoder`), so neither call pays for
   the branch and each has exact inputs;
4. quantise the MatMul weights to int8 again the ordinary way (onnxruntime's dynamic
   quantisation: int8 weights, activations quantised per call), which runs as integer GEMMs.

Only the ORT files' structure is trusted, never code: a flatbuffer is data.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np

# The folded, re-quantised models and the tokenizer, as voice.moonshine loads them.
ENCODER = "encoder.onnx"
DECODER_FIRST = "decoder_first.onnx"
DECODER_WITH_PAST = "decoder_with_past.onnx"
TOKENIZER = "tokenizer.bin"
CONVERTED_FILES = (ENCODER, DECODER_FIRST, DECODER_WITH_PAST)

# Ops folded when every input is a constant: the de-quantisation chain of the shipped files.
_FOLDABLE = {"Cast", "Mul", "Add", "Sub"}


def _fbs():
    from onnxruntime.tools.ort_format_model.ort_flatbuffers_py import fbs

    return fbs


# ---------------------------------------------------------------- ORT flatbuffer -> ONNX


def _tensor(t) -> "onnx.TensorProto":
    import onnx

    dims = [t.Dims(i) for i in range(t.DimsLength())]
    proto = onnx.TensorProto()
    proto.name = t.Name().decode()
    proto.dims.extend(dims)
    proto.data_type = t.DataType()
    if t.ExternalDataOffset() not in (0, -1):
        raise ValueError(f"tensor {proto.name} keeps its data outside the ORT file; not supported")
    if t.DataType() == onnx.TensorProto.STRING:
        proto.string_data.extend(t.StringData(i) for i in range(t.StringDataLength()))
    else:
        proto.raw_data = t.RawDataAsNumpy().tobytes() if t.RawDataLength() else b""
    return proto


def _attribute(a, graph_inits: dict | None = None) -> "onnx.AttributeProto":
    import onnx

    fbs = _fbs()
    kind = fbs.AttributeType.AttributeType
    name = a.Name().decode()
    t = a.Type()
    if t == kind.FLOAT:
        return onnx.helper.make_attribute(name, a.F())
    if t == kind.INT:
        return onnx.helper.make_attribute(name, a.I())
    if t == kind.STRING:
        return onnx.helper.make_attribute(name, a.S())
    if t == kind.TENSOR:
        return onnx.helper.make_attribute(name, _tensor(a.T()))
    if t == kind.GRAPH:
        return onnx.helper.make_attribute(name, _graph(a.G(), name))
    if t == kind.FLOATS:
        return onnx.helper.make_attribute(name, [a.Floats(i) for i in range(a.FloatsLength())], attr_type=onnx.AttributeProto.FLOATS)
    if t == kind.INTS:
        return onnx.helper.make_attribute(name, [a.Ints(i) for i in range(a.IntsLength())], attr_type=onnx.AttributeProto.INTS)
    if t == kind.STRINGS:
        return onnx.helper.make_attribute(name, [a.Strings(i) for i in range(a.StringsLength())],
                                          attr_type=onnx.AttributeProto.STRINGS)
    if t == kind.TENSORS:
        return onnx.helper.make_attribute(name, [_tensor(a.Tensors(i)) for i in range(a.TensorsLength())])
    raise ValueError(f"attribute {name}: type {t} is not supported")


def _value_info(v) -> "onnx.ValueInfoProto":
    import onnx

    fbs = _fbs()
    name = v.Name().decode()
    type_info = v.Type()
    if type_info is None or type_info.ValueType() != fbs.TypeInfoValue.TypeInfoValue.tensor_type:
        return onnx.helper.make_empty_tensor_value_info(name)
    tt = fbs.TensorTypeAndShape.TensorTypeAndShape()
    table = type_info.Value()
    tt.Init(table.Bytes, table.Pos)
    shape = tt.Shape()
    dims = None
    if shape is not None:
        dims = []
        for i in range(shape.DimLength()):
            value = shape.Dim(i).Value()
            if value is None:
                dims.append(None)
            elif value.DimType() == fbs.DimensionValueType.DimensionValueType.VALUE:
                dims.append(value.DimValue())
            elif value.DimType() == fbs.DimensionValueType.DimensionValueType.PARAM:
                dims.append(value.DimParam().decode())
            else:
                dims.append(None)
    return onnx.helper.make_tensor_value_info(name, tt.ElemType(), dims)


def _graph(g, name: str) -> "onnx.GraphProto":
    import onnx

    infos = {}
    for i in range(g.NodeArgsLength()):
        v = g.NodeArgs(i)
        infos[v.Name().decode()] = v
    nodes = []
    for i in range(g.NodesLength()):
        n = g.Nodes(i)
        if n.Type() != 0:
            raise ValueError(f"node {n.Name()!r} is a fused ORT node; only plain ONNX nodes can be converted")
        nodes.append(onnx.helper.make_node(
            n.OpType().decode(),
            [n.Inputs(j).decode() for j in range(n.InputsLength())],
            [n.Outputs(j).decode() for j in range(n.OutputsLength())],
            name=n.Name().decode() or None,
            domain=n.Domain().decode() or None,
        ))
        nodes[-1].attribute.extend(_attribute(n.Attributes(j)) for j in range(n.AttributesLength()))
    initializers = [_tensor(g.Initializers(i)) for i in range(g.InitializersLength())]
    if g.SparseInitializersLength():
        raise ValueError("sparse initializers are not supported")
    init_names = {t.name for t in initializers}
    inputs = [_value_info(infos[x]) for x in (g.Inputs(i).decode() for i in range(g.InputsLength()))
              if x not in init_names]
    outputs = [_value_info(infos[g.Outputs(i).decode()]) for i in range(g.OutputsLength())]
    return onnx.helper.make_graph(nodes, name, inputs, outputs, initializers)


def ort_to_onnx(path: str | Path) -> "onnx.ModelProto":
    """An ORT-format model file -> the same graph as an ONNX ModelProto (nothing folded yet)."""
    import onnx

    fbs = _fbs()
    data = Path(path).read_bytes()
    if not fbs.InferenceSession.InferenceSession.InferenceSessionBufferHasIdentifier(data, 0):
        raise ValueError(f"{path} is not an ORT-format model (no ORTM identifier)")
    session = fbs.InferenceSession.InferenceSession.GetRootAsInferenceSession(data, 0)
    m = session.Model()
    graph = _graph(m.Graph(), Path(path).stem)
    opsets = [onnx.helper.make_opsetid(m.OpsetImport(i).Domain().decode(), m.OpsetImport(i).Version())
              for i in range(m.OpsetImportLength())]
    model = onnx.helper.make_model(graph, opset_imports=opsets, producer_name="specvoice moonshine_convert")
    model.ir_version = m.IrVersion()
    return model


# ---------------------------------------------------------------- folding


def _eval_node(op: str, values: list[np.ndarray], node) -> np.ndarray:
    import onnx

    if op == "Cast":
        to = next(a.i for a in node.attribute if a.name == "to")
        return values[0].astype(onnx.helper.tensor_dtype_to_np_dtype(to))
    a, b = values
    return {"Mul": np.multiply, "Add": np.add, "Sub": np.subtract}[op](a, b).astype(np.result_type(a, b))


def fold_constant_nodes(model: "onnx.ModelProto") -> int:
    """Replace top-level Cast/Mul/Add/Sub nodes whose inputs are all initializers by their
    result (an initializer), in graph order, until none is left; drop initializers nothing
    reads any more. Returns the number of nodes folded."""
    import onnx
    from onnx import numpy_helper

    graph = model.graph
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    kept, folded = [], 0
    for node in graph.node:
        if node.op_type in _FOLDABLE and node.domain in ("", "ai.onnx") and all(x in consts for x in node.input):
            consts[node.output[0]] = _eval_node(node.op_type, [consts[x] for x in node.input], node)
            folded += 1
        else:
            kept.append(node)
    used = _names_read(kept) | {o.name for o in graph.output}
    del graph.node[:]
    graph.node.extend(kept)
    del graph.initializer[:]
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items() if k in used)
    return folded


def _names_read(nodes) -> set[str]:
    """Every value name the nodes read, subgraphs (If branches) included."""
    names: set[str] = set()
    for node in nodes:
        names.update(x for x in node.input if x)
        for a in node.attribute:
            if a.g.node:
                names.update(_names_read(a.g.node))
            for g in a.graphs:
                names.update(_names_read(g.node))
    return names


# ---------------------------------------------------------------- the merged decoder


def split_merged_decoder(model: "onnx.ModelProto") -> tuple["onnx.ModelProto", "onnx.ModelProto"]:
    """optimum's merged decoder (one `If` on `use_cache_branch`) -> (first step, with past).

    Each branch becomes a model of its own: the outer values it reads become initializers
    (the folded weights) or inputs (ids, encoder states, past keys/values); its outputs get
    the merged model's output names. An output that is one of the branch's own inputs,
    passed straight through, is left out (the caller has it).
    """
    import onnx

    graph = model.graph
    ifs = [n for n in graph.node if n.op_type == "If"]
    if len(ifs) != 1 or len(graph.node) != 1:
        raise ValueError(f"expected a merged decoder of one If node after folding, found "
                         f"{[n.op_type for n in graph.node][:8]}")
    node = ifs[0]
    if list(node.input) != ["use_cache_branch"]:
        raise ValueError(f"the If node reads {list(node.input)}, expected use_cache_branch")
    branches = {a.name: a.g for a in node.attribute}
    inits = {t.name: t for t in graph.initializer}
    inputs = {i.name: i for i in graph.input}
    out_infos = list(graph.output)

    def build(branch: "onnx.GraphProto", name: str) -> "onnx.ModelProto":
        produced = {o for n in branch.node for o in n.output} | {t.name for t in branch.initializer}
        read = _names_read(branch.node) | {o.name for o in branch.output}
        outer = sorted(x for x in read if x not in produced)
        g_inits = list(branch.initializer) + [inits[x] for x in outer if x in inits]
        missing = [x for x in outer if x not in inits and x not in inputs]
        if missing:
            raise ValueError(f"{name}: reads {missing[:4]}, neither a weight nor an input")
        g_inputs = [inputs[i.name] for i in graph.input if i.name in outer]
        nodes = list(branch.node)
        outputs = []
        input_names = {i.name for i in g_inputs}
        for info, out in zip(out_infos, branch.output):
            if out.name in input_names:  # passed straight through: the caller has it
                continue
            if out.name != info.name:
                nodes.append(onnx.helper.make_node("Identity", [out.name], [info.name]))
            outputs.append(info)
        g = onnx.helper.make_graph(nodes, name, g_inputs, outputs, g_inits)
        m = onnx.helper.make_model(g, opset_imports=model.opset_import, producer_name=model.producer_name)
        m.ir_version = model.ir_version
        return m

    return build(branches["else_branch"], "decoder_first"), build(branches["then_branch"], "decoder_with_past")


# ---------------------------------------------------------------- whole conversion


def quantize_int8(model: "onnx.ModelProto", out_path: Path) -> None:
    """MatMul weights to int8 (dynamic quantisation: onnxruntime's integer GEMMs)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    level = root.level
    with tempfile.TemporaryDirectory(dir=out_path.parent) as tmp:
        float_path = Path(tmp) / "float.onnx"
        onnx.save(model, float_path)
        # quantize_dynamic logs a warning to run its shape pre-processing, meant for
        # static (calibrated) quantisation; dynamic MatMul weights need none.
        root.setLevel(logging.ERROR)
        try:
            quantize_dynamic(float_path, out_path, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"])
        finally:
            root.setLevel(level)


def convert_moonshine(encoder_ort: Path, decoder_ort: Path, out_dir: Path, progress: bool = False) -> dict[str, float]:
    """The shipped encoder and merged decoder -> ENCODER, DECODER_FIRST and DECODER_WITH_PAST
    in `out_dir`. Returns seconds per step."""
    import time

    from tqdm import tqdm

    steps = tqdm(total=5, desc="moonshine: convert", unit="step", disable=not progress, leave=False)
    times: dict[str, float] = {}
    t = time.monotonic()
    encoder = ort_to_onnx(encoder_ort)
    fold_constant_nodes(encoder)
    steps.update()
    quantize_int8(encoder, out_dir / ENCODER)
    times["encoder"] = time.monotonic() - t
    steps.update()
    t = time.monotonic()
    decoder = ort_to_onnx(decoder_ort)
    fold_constant_nodes(decoder)
    first, with_past = split_merged_decoder(decoder)
    del decoder
    steps.update()
    quantize_int8(first, out_dir / DECODER_FIRST)
    steps.update()
    quantize_int8(with_past, out_dir / DECODER_WITH_PAST)
    steps.update()
    times["decoder"] = time.monotonic() - t
    steps.close()
    return times
