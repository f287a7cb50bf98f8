"""KServe v2 tensors: the TEXT input decoded, the outputs encoded.

Stock Triton clients (``tritonclient.grpc``) call every berth model with one
tensor contract:

- input ``TEXT``: BYTES, shape [N], one UTF-8 text per element;
- embed models output ``EMBEDDING``: FP32 [N, D];
- classify models output ``PROBABILITIES``: FP32 [N, C] and ``LABEL``:
  BYTES [N], the best label per text;
- rerank models take a second input, ``QUERY``: BYTES [1], and output
  ``SCORE``: FP32 [N], each text's score against the query in the texts'
  order (the request parameter ``raw_scores`` leaves out the model's
  activation, as berth.v1's Rerank does).

Inputs may come as ``raw_input_contents`` or typed ``bytes_contents``.
Outputs go out as ``raw_output_contents`` (what Triton does and what
tritonclient reads), or typed contents when the request sets the parameter
``binary_data_output`` (or every requested output's ``binary_data``) to
false. Request parameters ``truncate``, ``normalize``, ``prompt_name``,
``prompt`` and ``dimensions`` map onto berth's options of the same names;
with ``dimensions`` D, EMBEDDING is [N, D] (ModelMetadata gives the width a
call gets without it: the model's default, a truncate_dim, else the full
width). Triton's reserved ``triton_enable_empty_final_response`` must be a
bool_param; ModelStreamInfer answers it (gateway.kserve), ModelInfer
ignores it.

The classification extension works as in Triton: a requested FP32 output
with the parameter ``classification`` = k (tritonclient's ``class_count``)
comes back as BYTES [N, min(k, width)], each row's k highest entries as
"score:index:label" (no label part for EMBEDDING, which has none).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from gateway.berth import activated, packed_floats
from gateway.echo import quoted, shown
from gateway.options import check_dimensions
from gateway.pipeline import Model
from services.errors import InvalidInput
from services.proto.berth.v1 import berth_pb2
from services.proto.inference import grpc_service_pb2 as pb

VERSION = "1"  # every berth model has exactly one version
TEXT, EMBEDDING, PROBABILITIES, LABEL = "TEXT", "EMBEDDING", "PROBABILITIES", "LABEL"
QUERY, SCORE = "QUERY", "SCORE"  # a rerank model's
# Request parameters tritonclient may set that change nothing here.
IGNORED_PARAMETERS = {"priority"}
# Triton's reserved request parameter (bool_param) asking ModelStreamInfer to
# mark each request's last response with the response parameter
# FINAL_RESPONSE; tritonclient's C++ library (perf_analyzer) sets it on every
# request, unary ones included, where Triton checks its type and ignores it.
ENABLE_FINAL_RESPONSE = "triton_enable_empty_final_response"
FINAL_RESPONSE = "triton_final_response"
CONTRACT = "exactly one input, TEXT (BYTES, shape [N], one text per element)"
PAIR_CONTRACT = (
    "two inputs, QUERY (BYTES, shape [1], the query) and TEXT (BYTES, shape "
    "[N], one text per element)"
)
# InferTensorContents.fp32_contents: its field number.
FP32_CONTENTS = pb.InferTensorContents.DESCRIPTOR.fields_by_name["fp32_contents"].number


def outputs_of(model: Model) -> list[tuple[str, str, list[int]]]:
    """(name, datatype, shape) of each output; -1 is the number of texts."""
    if model.entry.task == "embed":
        return [(EMBEDDING, "FP32", [-1, model.dimension])]
    if model.entry.task == "rerank":
        return [(SCORE, "FP32", [-1])]
    return [(PROBABILITIES, "FP32", [-1, len(model.labels)]), (LABEL, "BYTES", [-1])]


def inputs_of(model: Model) -> list[tuple[str, list[int]]]:
    """(name, shape) of each BYTES input; -1 is the number of texts."""
    if model.entry.task == "rerank":
        return [(QUERY, [1]), (TEXT, [-1])]
    return [(TEXT, [-1])]


def decode_inputs(request: pb.ModelInferRequest, model: Model) -> dict[str, list[str]]:
    """Each input's texts by name, raw or typed; raises InvalidInput."""
    wanted = [name for name, _ in inputs_of(model)]
    names = [i.name for i in request.inputs]
    if sorted(names) != sorted(wanted):
        shown_names = ", ".join(quoted(n) for n in names[:8]) or "none"
        if len(names) > 8:
            shown_names += f" and {len(names) - 8} more"
        contract = CONTRACT if wanted == [TEXT] else PAIR_CONTRACT
        raise InvalidInput(
            f"model {quoted(request.model_name)} takes {contract}; got inputs "
            f"{shown_names}",
            field="inputs",
        )
    if request.raw_input_contents and (
        len(request.raw_input_contents) != len(request.inputs)
        or any(tensor.HasField("contents") for tensor in request.inputs)
    ):
        raise InvalidInput(
            "send every input either as raw_input_contents (one entry per "
            "input) or as contents.bytes_contents, not both",
            field="raw_input_contents",
        )
    decoded = {t.name: _decode(request, i) for i, t in enumerate(request.inputs)}
    if QUERY in decoded and len(decoded[QUERY]) != 1:
        raise InvalidInput(
            f"input QUERY holds {len(decoded[QUERY])} texts: send one query",
            field=f"inputs[{names.index(QUERY)}].shape",
        )
    return decoded


def _decode(request: pb.ModelInferRequest, index: int) -> list[str]:
    """The texts of input ``index``, raw or typed."""
    tensor = request.inputs[index]
    name = tensor.name
    if tensor.datatype != "BYTES":
        raise InvalidInput(
            f"input {name} has datatype {quoted(tensor.datatype)}: use BYTES",
            field=f"inputs[{index}].datatype",
        )
    if len(tensor.shape) != 1:
        dims = ", ".join(map(str, tensor.shape[:8]))
        dims += ", ..." if len(tensor.shape) > 8 else ""
        raise InvalidInput(
            f"input {name} has shape [{dims}]: use [N], one text per element",
            field=f"inputs[{index}].shape",
        )
    n = tensor.shape[0]
    if request.raw_input_contents:
        items = split_bytes(request.raw_input_contents[index], name, index)
    else:
        items = list(tensor.contents.bytes_contents)
    if len(items) != n:
        raise InvalidInput(
            f"input {name} has shape [{n}] but holds {len(items)} texts",
            field=f"inputs[{index}].shape",
        )
    texts = []
    for i, item in enumerate(items):
        try:
            texts.append(item.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InvalidInput(
                f"{name}[{i}] is not UTF-8: {exc.reason}",
                field=element_field(request, index, i),
            ) from None
    return texts


def element_field(request: pb.ModelInferRequest, index: int, i: int) -> str:
    """The request field that holds element i of input ``index``: its raw
    contents (all elements in one entry) or its typed contents."""
    if request.raw_input_contents:
        return f"raw_input_contents[{index}]"
    return f"inputs[{index}].contents.bytes_contents[{i}]"


def field_of(request: pb.ModelInferRequest, field: str | None) -> str | None:
    """A field that berth's shared request path names (as berth.v1's request
    has it: texts, texts[i], options.<name>, model) as it is in a
    ModelInferRequest."""
    if field is None:
        return None
    names = [tensor.name for tensor in request.inputs]
    texts = names.index(TEXT) if TEXT in names else 0
    if field == "texts":
        return f"inputs[{texts}]"
    if field.startswith("texts[") and field.endswith("]"):
        return element_field(request, texts, int(field[len("texts[") : -1]))
    if field == "query" and QUERY in names:
        return element_field(request, names.index(QUERY), 0)
    if field.startswith("options."):
        return "parameters." + field[len("options.") :]
    if field == "model":
        return "model_name"
    return field


def split_bytes(raw: bytes, name: str = TEXT, index: int = 0) -> list[bytes]:
    """A raw BYTES tensor (input ``name``, raw_input_contents[index]): each
    element a 4-byte little-endian length, then it."""
    items: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidInput(
                f"raw {name} contents end inside a length prefix at byte {offset}",
                field=f"raw_input_contents[{index}]",
            )
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise InvalidInput(
                f"raw {name} element {len(items)} claims {size} bytes, only "
                f"{len(raw) - offset} remain",
                field=f"raw_input_contents[{index}]",
            )
        items.append(raw[offset : offset + size])
        offset += size
    return items


def join_bytes(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def class_count(output: str, datatype: str, value: pb.InferParameter) -> int:
    """The k of an output's ``classification`` parameter, refused where Triton
    refuses it (src/grpc/grpc_utils.cc, src/classification.cc); raises
    InvalidInput."""
    kind = value.WhichOneof("parameter_choice")
    if kind != "int64_param":
        shown = getattr(value, kind) if kind else None
        if isinstance(shown, str | bytes):
            got = f"{kind} {quoted(shown)}"
        else:
            got = f"{kind} {shown!r}" if kind else "nothing"
        raise InvalidInput(
            f"output {output!r}: parameter 'classification' must be an "
            f"int64_param class count, got {got}"
        )
    if value.int64_param <= 0:
        raise InvalidInput(
            f"output {output!r}: classification {value.int64_param} asks for no "
            "classes; give a class count of at least 1"
        )
    if datatype == "BYTES":
        raise InvalidInput(
            f"output {output!r}: class result not available for output due to "
            f"unsupported type 'BYTES'; ask for classification on {PROBABILITIES}"
        )
    return value.int64_param


def top_classes(values: np.ndarray, k: int, labels: list[str]) -> list[bytes]:
    """Each row's k highest entries, best first, as Triton writes them
    (server src/classification.cc): "score:index:label", the score as C's
    ``%f`` (std::to_string), no label part where the index has none. Ties go
    by index, where Triton's std::sort leaves them in no set order."""
    order = np.argsort(-values, axis=1, kind="stable")[:, :k]
    items = []
    for row, indices in zip(values, order, strict=True):
        for i in indices:
            item = f"{float(row[i]):f}:{i}"
            label = labels[i] if i < len(labels) else ""
            items.append((f"{item}:{label}" if label else item).encode())
    return items


def final_response_wanted(request: pb.ModelInferRequest) -> bool:
    """Whether a ModelStreamInfer request sets ENABLE_FINAL_RESPONSE true."""
    value = request.parameters.get(ENABLE_FINAL_RESPONSE)
    return (
        value is not None
        and value.WhichOneof("parameter_choice") == "bool_param"
        and value.bool_param
    )


def flag(name: str, value: pb.InferParameter) -> bool:
    """A boolean parameter: bool_param, or the strings 'true'/'false'."""
    kind = value.WhichOneof("parameter_choice")
    if kind == "bool_param":
        return value.bool_param
    if kind == "string_param" and value.string_param.lower() in ("true", "false"):
        return value.string_param.lower() == "true"
    raise InvalidInput(f"parameter {name!r} must be a bool, got {kind or 'nothing'}")


def text(name: str, value: pb.InferParameter) -> str:
    """A string parameter: string_param."""
    kind = value.WhichOneof("parameter_choice")
    if kind != "string_param":
        raise InvalidInput(
            f"parameter {name!r} must be a string, got {kind or 'nothing'}"
        )
    return value.string_param


def dimensions(model: Model, value: pb.InferParameter) -> int:
    """The ``dimensions`` parameter: int64_param or uint64_param (or a
    string of digits), 0 for the full width; raises InvalidInput."""
    kind = value.WhichOneof("parameter_choice")
    if kind in ("int64_param", "uint64_param"):
        n = int(getattr(value, kind))
    elif kind == "string_param" and value.string_param.strip().isdigit():
        n = int(value.string_param)
    else:
        raise InvalidInput(
            f"parameter 'dimensions' must be an integer, got {kind or 'nothing'}"
        )
    check_dimensions(model.entry, model.width, n)
    return n


@dataclass
class Call:
    """What one ModelInfer request asks for, validated."""

    options: berth_pb2.Options
    outputs: list[tuple[str, str, list[int]]]
    binary: bool
    timeout_s: float | None
    classes: dict[str, int]  # output name -> k of its top-k classification
    raw_scores: bool = False  # a rerank model's SCORE without its activation


def parse_call(
    request: pb.ModelInferRequest, model: Model, timeout_s: float | None
) -> Call:
    """Parameters and requested outputs of a request; raises InvalidInput
    naming the field at fault (``parameters.<name>``, ``outputs[i]...``)."""
    options = berth_pb2.Options()
    binary, raw_scores = True, False
    for name, value in request.parameters.items():
        try:
            if name == "binary_data_output":
                binary = flag(name, value)
            elif name == "raw_scores" and model.entry.task == "rerank":
                raw_scores = flag(name, value)
            else:
                timeout_s = parameter(name, value, model, options, timeout_s)
        except InvalidInput as error:
            error.field = error.field or f"parameters.{shown(name)}"
            raise
    outputs, per_output, classes = requested_outputs(request, model)
    if len(per_output) > 1:
        raise InvalidInput(
            "set binary_data the same on every requested output: raw and typed "
            "outputs cannot be mixed in one response",
            field="outputs",
        )
    binary = per_output.pop() if per_output else binary
    outputs = outputs or outputs_of(model)
    return Call(options, outputs, binary, timeout_s, classes, raw_scores)


def parameter(
    name: str,
    value: pb.InferParameter,
    model: Model,
    options: berth_pb2.Options,
    timeout_s: float | None,
) -> float | None:
    """One request parameter set on ``options``; the call's timeout, which
    ``timeout`` may shorten."""
    if name == "truncate":
        options.truncate = flag(name, value)
    elif name == "normalize" and model.entry.task == "embed":
        options.normalize = flag(name, value)
    elif name == "dimensions" and model.entry.task == "embed":
        options.dimensions = dimensions(model, value)
    elif name == "prompt_name":
        options.prompt_name = text(name, value)
    elif name == "prompt":
        options.prompt = text(name, value)
    elif name == ENABLE_FINAL_RESPONSE:
        if value.WhichOneof("parameter_choice") != "bool_param":
            raise InvalidInput(
                f"invalid value type for {name!r} parameter, expected bool_param"
            )
    elif name == "timeout":  # tritonclient's, in microseconds
        if value.WhichOneof("parameter_choice") != "int64_param":
            raise InvalidInput("parameter 'timeout' must be int64 microseconds")
        if value.int64_param > 0:  # 0 is Triton's "no timeout"
            limit_s = value.int64_param / 1e6
            timeout_s = limit_s if timeout_s is None else min(timeout_s, limit_s)
    elif name not in IGNORED_PARAMETERS:
        takes = {
            "embed": "truncate, normalize, dimensions, prompt_name, prompt",
            "classify": "truncate, prompt_name, prompt",
            "rerank": "truncate, raw_scores",
        }[model.entry.task]
        raise InvalidInput(
            f"parameter {quoted(name)} is not understood by {model.entry.task} "
            f"model {model.entry.name!r}; it takes {takes}, binary_data_output"
        )
    return timeout_s


def requested_outputs(
    request: pb.ModelInferRequest, model: Model
) -> tuple[list[tuple[str, str, list[int]]], set[bool], dict[str, int]]:
    """The outputs a request names (none: all), the binary_data values they
    set, and the k of each one's classification; raises InvalidInput."""
    available = {o[0]: o for o in outputs_of(model)}
    outputs, per_output, classes = [], set(), {}
    for i, wanted in enumerate(request.outputs):
        if wanted.name not in available:
            raise InvalidInput(
                f"model {model.entry.name!r} has no output {quoted(wanted.name)}; "
                f"its outputs are {', '.join(available)}",
                field=f"outputs[{i}].name",
            )
        output = available[wanted.name]
        for key, value in wanted.parameters.items():
            field = f"outputs[{i}].parameters.{shown(key)}"
            try:
                if key == "binary_data":
                    per_output.add(flag(key, value))
                elif key == "classification" and wanted.name == SCORE:
                    raise InvalidInput(
                        f"output {wanted.name!r} holds one score per text: no "
                        "classes to rank (set sort in berth.v1's Rerank instead)"
                    )
                elif key == "classification":
                    classes[wanted.name] = class_count(wanted.name, output[1], value)
                else:
                    raise InvalidInput(
                        f"output parameter {quoted(key)} is not supported; use "
                        "binary_data or classification"
                    )
            except InvalidInput as error:
                error.field = error.field or field
                raise
        outputs.append(output)
    return outputs, per_output, classes


def shape_outputs(
    request: pb.ModelInferRequest, model: Model, rows: np.ndarray, call: Call
) -> pb.ModelInferResponse:
    """The response tensors of one call, raw or typed as the call asked."""
    response = pb.ModelInferResponse(
        model_name=model.entry.name, model_version=VERSION, id=request.id
    )
    n = len(rows)
    for name, datatype, _ in call.outputs:
        if name == LABEL:
            labels = [model.labels[i].encode() for i in np.argmax(rows, axis=1)]
            add_bytes(response, name, [n], labels, call.binary)
            continue
        if name == EMBEDDING:
            values = model.embeddings(rows, call.options)
        elif name == SCORE:  # [N]: one per text, the model's activation applied
            scores = rows[:, 0]
            values = scores if call.raw_scores else activated(scores, model.activation)
        else:
            values = rows
        values = np.ascontiguousarray(values, dtype="<f4")
        if name in call.classes:  # ranks the FP32 values the output would carry
            k = min(call.classes[name], values.shape[1])
            labels = model.labels if name == PROBABILITIES else []
            items = top_classes(values, k, labels)
            add_bytes(response, name, [n, k], items, call.binary)
            continue
        # EMBEDDING's width is the call's dimensions where it sets them.
        tensor = response.outputs.add(name=name, datatype=datatype, shape=values.shape)
        if call.binary:
            response.raw_output_contents.append(values.tobytes())
        else:
            tensor.contents.MergeFromString(packed_floats(FP32_CONTENTS, values))
    return response


def add_bytes(
    response: pb.ModelInferResponse,
    name: str,
    shape: list[int],
    items: list[bytes],
    binary: bool,
) -> None:
    """A BYTES output: length-prefixed in raw_output_contents, or typed."""
    tensor = response.outputs.add(name=name, datatype="BYTES", shape=shape)
    if binary:
        response.raw_output_contents.append(join_bytes(items))
    else:
        tensor.contents.bytes_contents.extend(items)
