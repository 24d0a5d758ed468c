"""Triton's binary tensor data extension of the KServe v2 HTTP protocol: the codec.

What NVIDIA's ``tritonclient.http`` sends by default (``InferInput.set_data_from_numpy``
with ``binary_data=True``, and ``binary_data_output`` when no outputs are named), as
specified in triton-inference-server/server ``docs/protocol/extension_binary_data.md``:

* the body is a JSON object followed by raw tensor bytes; the header
  ``Inference-Header-Content-Length`` gives the length of the JSON part in bytes
  (without it the whole body is JSON);
* an input (or response output) whose ``parameters`` hold ``binary_data_size`` has
  no ``data``: its bytes follow the JSON, in the order the tensors are listed;
* fixed-size types are little-endian, row-major, no padding; a BYTES element is a
  4-byte little-endian unsigned length followed by that many bytes;
* ``parameters.binary_data`` on a requested output (or ``binary_data_output`` on the
  request) asks for that output in binary.

This module knows nothing of the reward model: ``ttsrl.reward.infer_request`` validates what it
decodes with the same checks as JSON data. Every malformed body raises
:class:`BinaryDataError` with a message for the client.
"""

from __future__ import annotations

import json
import re
import struct
from typing import Any, Iterable

HEADER = "Inference-Header-Content-Length"
EXTENSION = "binary_tensor_data"  # the name servers list in their metadata's "extensions"
_DIGITS = re.compile(r"\d{1,20}", re.ASCII)
_FIXED = {"INT32": "i", "FP32": "f"}  # datatypes this model sends or receives as fixed-size binary
MAX_BYTES_ELEMENTS = 1 << 16  # BYTES elements in one tensor (this model's inputs have one)


class BinaryDataError(ValueError):
    """A body that does not follow the binary tensor data extension (a 400)."""


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """(JSON part, binary part) of a request body, given the header's value (or None)."""
    if header_length is None:
        return body, b""
    value = header_length.strip()
    if not _DIGITS.fullmatch(value):
        raise BinaryDataError(f"{HEADER} must be a non-negative decimal byte count, got {header_length[:40]!r}")
    n = int(value)
    if n > len(body):
        raise BinaryDataError(f"{HEADER} is {n} but the body has only {len(body)} bytes")
    if n == 0:
        raise BinaryDataError(f"{HEADER} is 0: the body must start with the JSON request")
    return body[:n], body[n:]


def _declared_size(spec: dict, name: str) -> int | None:
    params = spec.get("parameters")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise BinaryDataError(f"input {name}: 'parameters' must be an object")
    for key in ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"):
        if key in params:
            raise BinaryDataError(f"input {name}: shared memory is not supported by this server")
    if "binary_data_size" not in params:
        return None
    size = params["binary_data_size"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BinaryDataError(f"input {name}: binary_data_size must be a non-negative integer, got {size!r}")
    if "data" in spec:
        raise BinaryDataError(f"input {name}: has both 'data' and binary_data_size")
    return size


def _decode_bytes(raw: bytes, name: str) -> list[str]:
    """BYTES elements (4-byte little-endian length + bytes each) as UTF-8 strings."""
    out: list[str] = []
    pos = 0
    while pos < len(raw):
        if len(out) >= MAX_BYTES_ELEMENTS:
            raise BinaryDataError(f"input {name}: more than {MAX_BYTES_ELEMENTS} BYTES elements")
        if pos + 4 > len(raw):
            raise BinaryDataError(f"input {name}: BYTES element {len(out)} has a truncated 4-byte length "
                                  f"({len(raw) - pos} bytes left)")
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if n > len(raw) - pos:
            raise BinaryDataError(f"input {name}: BYTES element {len(out)} claims {n} bytes but only "
                                  f"{len(raw) - pos} remain in its binary_data_size")
        try:
            out.append(raw[pos:pos + n].decode("utf-8"))
        except UnicodeDecodeError as e:
            raise BinaryDataError(f"input {name}: BYTES element {len(out)} is not valid UTF-8 "
                                  f"({e.reason} at byte {e.start})") from None
        pos += n
    return out


def _decode(raw: bytes, datatype: Any, name: str) -> list:
    if datatype == "BYTES":
        return _decode_bytes(raw, name)
    code = _FIXED.get(datatype) if isinstance(datatype, str) else None
    if code is None:
        raise BinaryDataError(f"input {name}: binary data of datatype {datatype!r} is not accepted "
                              f"(this model's inputs are INT32 and BYTES)")
    if len(raw) % 4:
        raise BinaryDataError(f"input {name}: binary_data_size {len(raw)} is not a multiple of "
                              f"4 bytes ({datatype} elements)")
    return list(struct.unpack(f"<{len(raw) // 4}{code}", raw))


def attach_inputs(inputs: Iterable[dict], binary: bytes) -> None:
    """Give each input that declares ``binary_data_size`` its decoded values as ``data``
    (a flat, row-major list), taking the binary part in order; the sizes must add up to
    exactly the binary part."""
    pos = 0
    for spec in inputs:
        name = spec.get("name")
        size = _declared_size(spec, name)
        if size is None:
            continue
        if size > len(binary) - pos:
            hint = "" if binary else f" (no binary part: was the {HEADER} header sent?)"
            raise BinaryDataError(f"input {name}: binary_data_size {size} runs past the end of the body: "
                                  f"{len(binary) - pos} bytes of binary data left{hint}")
        spec["data"] = _decode(binary[pos:pos + size], spec.get("datatype"), name)
        pos += size
    if pos != len(binary):
        raise BinaryDataError(f"the body has {len(binary)} bytes after the JSON header but the inputs' "
                              f"binary_data_size add up to {pos}")


def _encode(values: list, datatype: str) -> bytes:
    if datatype == "BYTES":
        parts = []
        for v in values:
            b = v.encode("utf-8") if isinstance(v, str) else bytes(v)
            parts += [struct.pack("<I", len(b)), b]
        return b"".join(parts)
    return struct.pack(f"<{len(values)}{_FIXED[datatype]}", *values)


def encode_response(resp: dict, binary_outputs: Iterable[str]) -> tuple[bytes, int | None]:
    """(body, JSON length) of an infer response dict; the outputs named in
    ``binary_outputs`` move from ``data`` to the binary part (JSON length None: no
    binary part, the body is plain JSON)."""
    binary_outputs = set(binary_outputs)
    chunks: list[bytes] = []
    outputs = []
    for out in resp.get("outputs", []):
        if out["name"] in binary_outputs:
            raw = _encode(out["data"], out["datatype"])
            out = {k: v for k, v in out.items() if k != "data"}
            out["parameters"] = {**out.get("parameters", {}), "binary_data_size": len(raw)}
            chunks.append(raw)
        outputs.append(out)
    header = json.dumps({**resp, "outputs": outputs}, ensure_ascii=False).encode("utf-8")
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)
