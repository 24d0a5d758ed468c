"""The KServe v2 / Triton HTTP wire protocol of the reward server, in one place.

The server (``ttsrl.reward.server``), the client verl calls (``ttsrl.reward.client``), the health
check (``ttsrl.reward.health``) and the benchmarks all build and read requests here, so the sides
cannot drift. ``INPUT_SPECS``, ``OPTIONAL_INPUT_SPECS`` and ``OUTPUT_SPECS`` are the tensors of
``POST /v2/models/{name}/infer``; REWARDS comes first because the reference recipe's client reads
``outputs[0].data[0]``. A request without the optional inputs (PROMPT_ID, FINISHED) or the
by-name outputs (``TERM_OUTPUTS``) gets the reference recipe's answer, so a Triton client works
unchanged, with JSON data or Triton's binary tensor data (``ttsrl.reward.triton_binary``). Every bad
request is a :class:`RequestError` (a 4xx answer with ``{"error": message}``). The protocol as a
client writer reads it: docs/architecture.md, "The reward server's wire protocol".
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from ttsrl.data.prompt_pool import MAX_ID_BYTES, prompt_id_problem
from ttsrl.reward.triton_binary import BinaryDataError, attach_inputs, split_body

DEFAULT_MODEL_NAME = "token2wav_asr"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_URL = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
MODEL_VERSION = "1"
INPUT_SPECS = (("TOKENS", "INT32", [1, -1]), ("TOKEN_LENS", "INT32", [1, 1]), ("GT_TEXT", "BYTES", [1, 1]))
#: inputs a request may leave out (listed with ``"optional": true`` in the metadata and config)
OPTIONAL_INPUT_SPECS = (("PROMPT_ID", "BYTES", [1, 1]), ("FINISHED", "INT32", [1, 1]))
PROMPT_ID = "PROMPT_ID"
FINISHED = "FINISHED"
MAX_PROMPT_ID_BYTES = MAX_ID_BYTES  # a file name's limit on Linux: the ids are wav stems (the pool's rule)
OUTPUT_SPECS = (("REWARDS", "FP32", [1, 1]), ("TRANSCRIPTS", "BYTES", [1, 1]), ("ERROR_RATES", "FP32", [1, 1]),
                ("SIMS", "FP32", [1, 1]), ("CER_REWARDS", "FP32", [1, 1]), ("LENGTH_REWARDS", "FP32", [1, 1]))
#: the reward's terms: sent only when a request names them in ``outputs``
TERM_OUTPUTS = ("CER_REWARDS", "LENGTH_REWARDS")
#: what ttsrl's own client asks for: every output, the terms included
CLIENT_OUTPUTS = tuple(n for n, _, _ in OUTPUT_SPECS)
MAX_GT_CHARS = 2000
READY_PATH = "/v2/health/ready"


def split_urls(spec: str) -> tuple[str, ...]:
    """The base URLs of a comma-separated list (``TTSRL_REWARD_URL``, ``run.sh``'s ``REWARD_URLS``):
    each ``http(s)://host:port`` (a path prefix allowed), trailing ``/`` dropped; ValueError when one is malformed or repeated."""
    urls = tuple(u.strip().rstrip("/") for u in spec.split(",") if u.strip())
    if not urls:
        raise ValueError(f"no reward server URL in {spec!r}")
    bad = [u for u in urls if not re.fullmatch(r"https?://[^/\s,]+(/\S*)?", u)]
    if bad:
        raise ValueError(f"reward server URL(s) {bad} in {spec!r}: expected http://HOST:PORT, comma-separated")
    if len(set(urls)) != len(urls):
        raise ValueError(f"a reward server URL is listed twice in {spec!r}")
    return urls


def infer_path(model_name: str = DEFAULT_MODEL_NAME) -> str:
    return f"/v2/models/{model_name}/infer"


# ---------------------------------------------------------------------------
# client side


class ResponseError(ValueError):
    """An infer response that does not have the outputs this protocol promises."""


def build_payload(codes: list[int], text: str, prompt_id: str | None = None, finished: bool | None = None,
                  outputs: tuple[str, ...] | None = None) -> dict:
    """The KServe v2 body the reference recipe's client sends (nested [1,N] data); with
    ``prompt_id``, also the optional PROMPT_ID input; with ``finished``, FINISHED (1/0); with
    ``outputs``, the outputs asked for by name (all None: the reference body exactly)."""
    body = {"inputs": [
        {"name": "TOKENS", "shape": [1, len(codes)], "datatype": "INT32", "data": [list(codes)]},
        {"name": "TOKEN_LENS", "shape": [1, 1], "datatype": "INT32", "data": [[len(codes)]]},
        {"name": "GT_TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]},
    ]}
    if prompt_id is not None:
        body["inputs"].append({"name": PROMPT_ID, "shape": [1, 1], "datatype": "BYTES", "data": [prompt_id]})
    if finished is not None:
        body["inputs"].append({"name": FINISHED, "shape": [1, 1], "datatype": "INT32", "data": [[int(bool(finished))]]})
    if outputs is not None:
        body["outputs"] = [{"name": n} for n in outputs]
    return body


class Reply(NamedTuple):
    """What an infer response says about one utterance (NaN: an output not measured or not sent)."""

    reward: float
    error_rate: float
    transcript: str
    sim: float = math.nan
    cer_term: float = math.nan  # CER_REWARDS
    length_term: float = math.nan  # LENGTH_REWARDS


#: what every reward variant's error-rate term gives (ttsrl.reward.rewards; the length guard only
#: scales it down); a SIM weight w adds w x SIM, SIM in [-1, 1]
REWARD_TERM_RANGE = (0.0, 1.0)
SIM_SLACK = 1e-3  # a campplus cosine computed in float32 may pass 1 by rounding


def reward_range(sim_weight: float = 0.0) -> tuple[float, float]:
    """The rewards a server with SIM weight ``sim_weight`` can answer (it advertises them in its
    responses' ``parameters`` and its metadata as ``reward_range``)."""
    lo, hi = REWARD_TERM_RANGE
    return (lo - sim_weight, hi + sim_weight) if sim_weight > 0 else (lo, hi)


def _number(outs: dict, name: str, allow_nan: bool = False) -> float:
    """The one value of output ``name``: a JSON number (not a bool, not a string)."""
    v = outs[name][0]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ResponseError(f"output {name} is {v!r} ({type(v).__name__}), not a number")
    v = float(v)
    if not (math.isfinite(v) or (allow_nan and math.isnan(v))):
        raise ResponseError(f"output {name} is {v}, not a finite number")
    return v


def parse_response(body: Any, model: str | None = None, reward: str | None = None,
                   prompt_id: str | None = None, sim_weight: float | None = None) -> Reply:
    """The :class:`Reply` of an infer response; raises :class:`ResponseError` for an answer that
    is malformed, from another model than ``model`` (when given), scored by another reward
    variant than ``reward`` (when given: the answer must name it), voiced with another speaker
    prompt than ``prompt_id`` (when given: the answer must carry it back), combined with another SIM
    weight than ``sim_weight`` (when given: the ``reward_range`` it advertises must be that weight's),
    or impossible: a reward that is
    not a finite number within the ``reward_range`` the server advertises (a server that
    advertises none: that of SIM weight 0), an error rate that is not a finite number >= 0, a
    SIM outside [-1, 1], a transcript that is not a string."""
    if not isinstance(body, dict):
        raise ResponseError(f"the answer is not a JSON object: {str(body)[:200]}")
    if model is not None and body.get("model_name") != model:
        raise ResponseError(f"the answer is from model {body.get('model_name')!r}, not {model!r}")
    if reward is not None and (body.get("parameters") or {}).get("reward") != reward:
        raise ResponseError(f"the answer was scored with reward {(body.get('parameters') or {}).get('reward')!r}, "
                            f"not the {reward!r} this run trains on")
    if prompt_id is not None and (body.get("parameters") or {}).get("prompt_id") != prompt_id:
        raise ResponseError(f"the answer was voiced with prompt {(body.get('parameters') or {}).get('prompt_id')!r}, "
                            f"not the {prompt_id!r} asked for (a server that does not know PROMPT_ID?)")
    try:
        outs = {o["name"]: o["data"] for o in body["outputs"]}
        reward = _number(outs, "REWARDS")
        err = _number(outs, "ERROR_RATES") if "ERROR_RATES" in outs else math.nan
        sim = _number(outs, "SIMS", allow_nan=True) if "SIMS" in outs else math.nan
        terms = [_number(outs, n) if n in outs else math.nan for n in TERM_OUTPUTS]
        transcript = outs.get("TRANSCRIPTS", [""])[0]
    except (KeyError, IndexError, TypeError) as e:
        raise ResponseError(f"malformed response from reward server: {e!r}: {str(body)[:200]}") from None
    advertised = (body.get("parameters") or {}).get("reward_range", list(reward_range()))
    if not (isinstance(advertised, list) and len(advertised) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in advertised)
            and advertised[0] <= advertised[1]):
        raise ResponseError(f"the answer advertises reward_range {advertised!r}, not [low, high]")
    if sim_weight is not None and [float(x) for x in advertised] != [float(x) for x in reward_range(sim_weight)]:
        raise ResponseError(f"the answer advertises reward_range {advertised!r}, the range of another SIM weight than "
                            f"the {sim_weight:g} this run trains on ({list(reward_range(sim_weight))})")
    lo, hi = advertised
    if not lo <= reward <= hi:
        raise ResponseError(f"reward server returned a reward {reward} outside the range it advertises [{lo:g}, {hi:g}]")
    if not (math.isnan(err) or err >= 0):
        raise ResponseError(f"reward server returned an error rate {err} below 0")
    if not (math.isnan(sim) or -1.0 - SIM_SLACK <= sim <= 1.0 + SIM_SLACK):
        raise ResponseError(f"reward server returned a speaker similarity {sim} outside [-1, 1]")
    for name, v in zip(TERM_OUTPUTS, terms):
        if not (math.isnan(v) or 0.0 <= v <= 1.0):
            raise ResponseError(f"reward server returned {name} {v} outside [0, 1]")
    if not isinstance(transcript, str):
        raise ResponseError(f"output TRANSCRIPTS is {transcript!r}, not a string")
    return Reply(reward, err, transcript, sim, *terms)


# ---------------------------------------------------------------------------
# server side


def build_response(model_name: str, reward: float, transcript: str, error_rate: float,
                   rid: str | None = None, wanted: list[str] | None = None, sim: float | None = None,
                   sim_weight: float = 0.0, reward_name: str | None = None, prompt_id: str | None = None,
                   cer_term: float = math.nan, length_term: float = math.nan) -> dict:
    """The infer response. ``sim`` None: this server does not measure speaker similarity, and
    SIMS is left out unless the request names it (then NaN); a measuring server passes NaN
    where there was nothing to measure. So a server without SIM sends strict JSON, as before.
    ``reward_name``: the reward variant that scored it, in ``parameters.reward`` (a client that
    asks for one variant refuses an answer scored by another). ``prompt_id``: the speaker prompt
    the request named (PROMPT_ID), in ``parameters.prompt_id``; None (no PROMPT_ID): left out.
    ``cer_term``, ``length_term``: the reward's terms (CER_REWARDS, LENGTH_REWARDS), sent only
    when ``wanted`` names them."""
    values = {"REWARDS": reward, "TRANSCRIPTS": transcript, "ERROR_RATES": error_rate,
              "SIMS": math.nan if sim is None else float(sim), "CER_REWARDS": float(cer_term),
              "LENGTH_REWARDS": float(length_term)}
    default = [n for n, _, _ in OUTPUT_SPECS if n not in TERM_OUTPUTS and (n != "SIMS" or sim is not None)]
    outputs = [{"name": n, "datatype": d, "shape": s, "data": [values[n]]}
               for n, d, s in OUTPUT_SPECS if n in (default if wanted is None else wanted)]
    resp = {"model_name": model_name, "model_version": MODEL_VERSION, "outputs": outputs,
            "parameters": {"reward_range": list(reward_range(sim_weight))}}
    if reward_name is not None:
        resp["parameters"]["reward"] = reward_name
    if prompt_id is not None:
        resp["parameters"]["prompt_id"] = prompt_id
    if rid is not None:
        resp["id"] = rid
    return resp


def model_metadata(model_name: str) -> dict:
    """KServe v2 model metadata; an optional input carries ``"optional": true`` (Triton's
    config word; KServe's metadata has none, and its readers ignore keys they do not know)."""
    return {"name": model_name, "versions": [MODEL_VERSION],
            "inputs": [{"name": n, "datatype": d, "shape": s} for n, d, s in INPUT_SPECS]
            + [{"name": n, "datatype": d, "shape": s, "optional": True} for n, d, s in OPTIONAL_INPUT_SPECS],
            "outputs": [{"name": n, "datatype": d, "shape": s} for n, d, s in OUTPUT_SPECS]}


class RequestError(Exception):
    """A client error: answered with ``status`` and ``{"error": message}``."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------------
# request parsing


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
