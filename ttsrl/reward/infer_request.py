"""The reward server's reader of infer requests: every check a body passes before it is queued.

A body (JSON, or JSON + Triton's binary tensor data: ``ttsrl.reward.triton_binary``) becomes an
:class:`InferRequest` or a :class:`RequestError` (a 4xx answer with ``{"error": message}``): its JSON
shape is bounded before ``json.loads`` sees it, each input is checked against the tensors of
``ttsrl.reward.protocol`` (the wire format both sides share), and every speech code against the
server's family. Only the server reads requests; the client, the health check and the benchmarks
build them with ``protocol.build_payload``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from ttsrl.data.prompt_pool import prompt_id_problem
from ttsrl.reward.protocol import (
    FINISHED,
    INPUT_SPECS,
    MAX_GT_CHARS,
    MAX_PROMPT_ID_BYTES,
    OPTIONAL_INPUT_SPECS,
    OUTPUT_SPECS,
    PROMPT_ID,
)
from ttsrl.reward.triton_binary import BinaryDataError, attach_inputs, split_body


class RequestError(Exception):
    """A client error: answered with ``status`` and ``{"error": message}``."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# Caps applied before Python's own limits are reached (recursion, int digits).
MAX_JSON_DEPTH = 16  # a valid request nests 4 deep ({"inputs": [{"data": [[...]]}]})
MAX_JSON_CONTAINERS = 256  # arrays + objects in one body (a valid one has about 12)
MAX_JSON_SPECIALS = 50_000  # quotes + backslashes + brackets scanned before giving up
MAX_INT_DIGITS = 20  # INT32 needs 11; 20 keeps int64 readable for a clear range message
_LONG_DIGITS = re.compile(rb"\d{%d}" % (MAX_INT_DIGITS + 1))
_SPECIALS = re.compile(rb'["\\\[\]{}]')


def check_json_shape(body: bytes) -> None:
    """Refuse a body nested deeper than MAX_JSON_DEPTH (or with too many containers)
    before ``json.loads`` sees it: one pass over the structural characters only."""
    depth = containers = 0
    in_string = False
    skip_at = -1
    for i, m in enumerate(_SPECIALS.finditer(body)):
        if i > MAX_JSON_SPECIALS:
            raise RequestError(f"body has more than {MAX_JSON_SPECIALS} quotes/brackets; not a request of this model")
        pos = m.start()
        if pos == skip_at:  # the character after a backslash
            continue
        c = body[pos]
        if in_string:
            if c == 0x5C:  # backslash: the next character is escaped
                skip_at = pos + 1
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in (0x5B, 0x7B):  # [ {
            depth += 1
            containers += 1
            if depth > MAX_JSON_DEPTH:
                raise RequestError(f"body is JSON nested deeper than {MAX_JSON_DEPTH} levels")
            if containers > MAX_JSON_CONTAINERS:
                raise RequestError(f"body has more than {MAX_JSON_CONTAINERS} JSON arrays/objects")
        elif c in (0x5D, 0x7D):
            depth -= 1


def _bounded_int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise RequestError(f"integer of {len(s.lstrip('-'))} digits in the body (at most {MAX_INT_DIGITS})")
    return int(s)


def _values(data: Any, shape: list[int], name: str) -> list:
    """The values of ``data`` in row-major order. KServe allows flat data or lists nested
    exactly like ``shape``; anything else (ragged rows, extra nesting) is refused."""
    if not isinstance(data, list):
        raise RequestError(f"input {name}: 'data' must be a list, got {type(data).__name__}")
    count = math.prod(shape)
    if not any(isinstance(x, list) for x in data):  # flat, row-major
        if len(data) != count:
            raise RequestError(f"input {name}: shape {shape} needs {count} values, data has {len(data)}")
        return data
    level = [data]
    for dim, size in enumerate(shape):
        for row in level:
            if not isinstance(row, list) or len(row) != size:
                got = f"a list of {len(row)}" if isinstance(row, list) else type(row).__name__
                raise RequestError(f"input {name}: 'data' is not nested like shape {shape} "
                                   f"(dimension {dim} needs lists of {size}, got {got})")
        level = [x for row in level for x in row]
    if any(isinstance(x, list) for x in level):
        raise RequestError(f"input {name}: 'data' is nested deeper than shape {shape}")
    return level


def _shape(spec: dict, name: str) -> list[int]:
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise RequestError(f"input {name}: 'shape' must be a list of integers, got {shape!r}")
    if any(d < 0 for d in shape):
        raise RequestError(f"input {name}: negative dimension in shape {shape}")
    return shape


def _ints(spec: dict, name: str, max_count: int, fixed: list[int] | None = None) -> tuple[list[int], list[int]]:
    if spec.get("datatype") != "INT32":
        raise RequestError(f"input {name}: datatype must be INT32, got {spec.get('datatype')!r}")
    shape = _shape(spec, name)
    if "data" not in spec:
        raise RequestError(f"input {name}: missing 'data' (or binary_data_size in 'parameters')")
    if fixed is not None and shape != fixed:
        raise RequestError(f"input {name}: shape must be {fixed}, got {shape}")
    if len(shape) != 2 or shape[0] != 1:
        raise RequestError(f"input {name}: shape must be [1, N], got {shape}")
    if shape[1] > max_count:
        raise RequestError(f"input {name}: {shape[1]} elements exceed the limit of {max_count}", 413)
    values = _values(spec["data"], shape, name)
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool):
            raise RequestError(f"input {name}: INT32 data must be integers, got {v!r}")
        if not -(2 ** 31) <= v < 2 ** 31:
            raise RequestError(f"input {name}: {v} does not fit INT32")
    return values, shape


def _string(spec: dict, name: str) -> str:
    """The one string of a BYTES [1, 1] input (JSON string, base64 or binary data), valid UTF-8."""
    if spec.get("datatype") != "BYTES":
        raise RequestError(f"input {name}: datatype must be BYTES, got {spec.get('datatype')!r}")
    shape = _shape(spec, name)
    if shape not in ([1, 1], [1]):
        raise RequestError(f"input {name}: shape must be [1, 1], got {shape}")
    if "data" not in spec:
        raise RequestError(f"input {name}: missing 'data'")
    values = _values(spec["data"], shape, name)
    if len(values) != 1:
        raise RequestError(f"input {name}: expected exactly one string, got {len(values)} values")
    v = values[0]
    if isinstance(v, dict) and set(v) == {"b64"}:  # binary string sent as base64
        try:
            raw = base64.b64decode(v["b64"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise RequestError(f"input {name}: invalid base64") from None
        try:
            v = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"input {name}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not isinstance(v, str):
        raise RequestError(f"input {name}: expected a string, got {type(v).__name__}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"input {name}: not valid UTF-8 (lone surrogate)") from None
    return v


def _text(spec: dict) -> str:
    name = "GT_TEXT"
    v = _string(spec, name)
    if not v.strip():
        raise RequestError(f"input {name}: text is empty")
    if len(v) > MAX_GT_CHARS:
        raise RequestError(f"input {name}: text longer than {MAX_GT_CHARS} characters", 413)
    return v


def _prompt_id(spec: dict) -> str:
    v = _string(spec, PROMPT_ID)
    why = prompt_id_problem(v)
    if why:
        too_long = len(v.encode("utf-8")) > MAX_PROMPT_ID_BYTES
        raise RequestError(f"input {PROMPT_ID}: {v[:80]!r} {why}", 413 if too_long else 400)
    return v


@dataclass
class InferRequest:
    codes: list[int]
    text: str
    rid: str | None = None
    wanted: list[str] | None = None  # outputs asked for, in order; None = all
    binary_outputs: frozenset[str] = frozenset()  # outputs to answer as binary tensor data
    prompt_id: str | None = None  # the speaker prompt asked for (PROMPT_ID); None: chosen from the text
    finished: bool | None = None  # FINISHED: ended with end of speech (None: not said)


def _flag(params: Any, key: str, where: str, refused: tuple[str, ...] = ()) -> bool | None:
    """A boolean parameter of the binary data extension (None when not given)."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise RequestError(f"{where}: 'parameters' must be an object")
    for bad in refused:
        if bad in params:
            raise RequestError(f"{where}: parameter {bad!r} is not supported by this server")
    v = params.get(key)
    if v is not None and not isinstance(v, bool):
        raise RequestError(f"{where}: parameter {key!r} must be true or false, got {v!r}")
    return v


def parse_infer(body: bytes, max_tokens: int, header_length: str | None = None, *,
                speech_token_size: int) -> InferRequest:
    """Validate an infer body (JSON, or JSON + binary tensor data when ``header_length``,
    the ``Inference-Header-Content-Length`` header, is given: ``ttsrl.reward.triton_binary``);
    every code must be below ``speech_token_size``, the speech vocabulary of the server's family."""
    try:
        body, binary = split_body(body, header_length)
    except BinaryDataError as e:
        raise RequestError(str(e)) from None
    check_json_shape(body)
    try:  # the int hook costs ~1 ms per 4,096 codes: only when a long digit run is there at all
        req = json.loads(body, parse_int=_bounded_int) if _LONG_DIGITS.search(body) else json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        hint = (" (binary tensor data needs the Inference-Header-Content-Length header)"
                if header_length is None and b"binary_data_size" in body else "")
        raise RequestError(f"body is not valid JSON: {e}{hint}") from None
    except RecursionError:  # not reached after check_json_shape; kept as a backstop
        raise RequestError("body is JSON nested too deeply") from None
    if not isinstance(req, dict):
        raise RequestError("body must be a JSON object with an 'inputs' list")
    inputs = req.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise RequestError("body must have a non-empty 'inputs' list")
    by_name: dict[str, dict] = {}
    for spec in inputs:
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise RequestError("every input must be an object with a 'name'")
        name = spec["name"]
        if name not in {n for n, _, _ in INPUT_SPECS + OPTIONAL_INPUT_SPECS}:
            raise RequestError(f"unknown input {name!r}; expected TOKENS, TOKEN_LENS, GT_TEXT (and optionally "
                               f"{', '.join(n for n, _, _ in OPTIONAL_INPUT_SPECS)})")
        if name in by_name:
            raise RequestError(f"input {name} given twice")
        by_name[name] = spec
    missing = [n for n, _, _ in INPUT_SPECS if n not in by_name]
    if missing:
        raise RequestError(f"missing input(s) {', '.join(missing)}")
    try:
        attach_inputs(inputs, binary)
    except BinaryDataError as e:
        raise RequestError(str(e)) from None

    tokens, tshape = _ints(by_name["TOKENS"], "TOKENS", max_tokens)
    lens, _ = _ints(by_name["TOKEN_LENS"], "TOKEN_LENS", 1, fixed=[1, 1])
    n = lens[0]
    if not 0 <= n <= tshape[1]:
        raise RequestError(f"input TOKEN_LENS: {n} is not in 0..{tshape[1]} (the length of TOKENS)")
    codes = tokens[:n]
    for c in codes:
        if not 0 <= c < speech_token_size:
            raise RequestError(f"input TOKENS: speech code {c} outside 0..{speech_token_size - 1}")
    text = _text(by_name["GT_TEXT"])
    prompt_id = _prompt_id(by_name[PROMPT_ID]) if PROMPT_ID in by_name else None
    finished = None
    if FINISHED in by_name:
        flag, _ = _ints(by_name[FINISHED], FINISHED, 1, fixed=[1, 1])
        if flag[0] not in (0, 1):
            raise RequestError(f"input {FINISHED}: {flag[0]} is not 0 (hit the response limit) or 1 (ended)")
        finished = bool(flag[0])

    all_binary = bool(_flag(req.get("parameters"), "binary_data_output", "request"))
    wanted = None
    binary = {n for n, _, _ in OUTPUT_SPECS} if all_binary else set()
    if "outputs" in req:
        outs = req["outputs"]
        known = {n for n, _, _ in OUTPUT_SPECS}
        if not isinstance(outs, list) or not all(isinstance(o, dict) and o.get("name") in known for o in outs):
            raise RequestError(f"'outputs' must list objects named among {sorted(known)}")
        wanted = [o["name"] for o in outs]
        binary = set()
        for o in outs:
            flag = _flag(o.get("parameters"), "binary_data", f"output {o['name']}",
                         refused=("classification", "shared_memory_region"))
            if flag or (flag is None and all_binary):
                binary.add(o["name"])
    rid = req.get("id")
    if rid is not None and not isinstance(rid, str):
        raise RequestError("'id' must be a string")
    return InferRequest(codes, text, rid, wanted, frozenset(binary), prompt_id, finished)
