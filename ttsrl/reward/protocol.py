"""The KServe v2 / Triton HTTP wire protocol of the reward server, in one place.

The server (``ttsrl.reward.server``), the client verl calls (``ttsrl.reward.client``), the health
check (``ttsrl.reward.health``) and the benchmarks all build requests and read answers here, so the
sides cannot drift; the server reads requests with ``ttsrl.reward.infer_request``, against these specs. ``INPUT_SPECS``, ``OPTIONAL_INPUT_SPECS`` and ``OUTPUT_SPECS`` are the tensors of
``POST /v2/models/{name}/infer``; REWARDS comes first because the reference recipe's client reads
``outputs[0].data[0]``. A request without the optional inputs (PROMPT_ID, FINISHED) or the
by-name outputs (``BY_NAME_OUTPUTS``) gets the reference recipe's answer, so a Triton client works
unchanged, with JSON data or Triton's binary tensor data (``ttsrl.reward.triton_binary``). Every bad
request is an ``infer_request.RequestError`` (a 4xx answer with ``{"error": message}``). The protocol
as a client writer reads it: docs/architecture.md, "The reward server's wire protocol".
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

from ttsrl.data.prompt_pool import MAX_ID_BYTES

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
                ("SIMS", "FP32", [1, 1]), ("CER_REWARDS", "FP32", [1, 1]), ("LENGTH_REWARDS", "FP32", [1, 1]),
                ("MOS_OVRLS", "FP32", [1, 1]))
#: the reward's terms in [0, 1]
TERM_OUTPUTS = ("CER_REWARDS", "LENGTH_REWARDS")
#: DNSMOS OVRL (1..5) of what was heard, NaN where not measured (the server measures it with a MOS weight)
MOS_OUTPUT = "MOS_OVRLS"
#: sent only when a request names them in ``outputs``, so a reference client's answer stays as it was
BY_NAME_OUTPUTS = TERM_OUTPUTS + (MOS_OUTPUT,)
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
    mos: float = math.nan  # MOS_OVRLS: DNSMOS OVRL, 1..5


#: what every reward variant's error-rate term gives (ttsrl.reward.rewards; the length guard only
#: scales it down); a SIM weight w adds w x SIM, SIM in [-1, 1]; a MOS weight m adds m x q, q in [0, 1]
REWARD_TERM_RANGE = (0.0, 1.0)
SIM_SLACK = 1e-3  # a campplus cosine computed in float32 may pass 1 by rounding
WEIGHT_TOLERANCE = 1e-9  # a weight read back from a range: lo - w and hi + w + m round in the last bits


def reward_range(sim_weight: float = 0.0, mos_weight: float = 0.0) -> tuple[float, float]:
    """The rewards a server with SIM weight ``sim_weight`` and MOS weight ``mos_weight`` can answer
    (it advertises them in its responses' ``parameters`` and its metadata as ``reward_range``)."""
    lo, hi = REWARD_TERM_RANGE
    return lo - sim_weight, hi + sim_weight + mos_weight


def range_weights(advertised: list[float]) -> tuple[float, float]:
    """The (SIM weight, MOS weight) whose :func:`reward_range` is ``advertised``: SIM's widens both
    ends, MOS's the top only, so each can be read back."""
    lo, hi = REWARD_TERM_RANGE
    sim = lo - advertised[0]
    return sim, advertised[1] - hi - sim


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
                   prompt_id: str | None = None, sim_weight: float | None = None,
                   mos_weight: float | None = None) -> Reply:
    """The :class:`Reply` of an infer response; raises :class:`ResponseError` for an answer that
    is malformed, from another model than ``model`` (when given), scored by another reward
    variant than ``reward`` (when given: the answer must name it), voiced with another speaker
    prompt than ``prompt_id`` (when given: the answer must carry it back), combined with another SIM
    weight than ``sim_weight`` or another MOS weight than ``mos_weight`` (when given: the
    ``reward_range`` it advertises must be that of the weight, :func:`range_weights`),
    or impossible: a reward that is
    not a finite number within the ``reward_range`` the server advertises (a server that
    advertises none: that of weights 0), an error rate that is not a finite number >= 0, a
    SIM outside [-1, 1], a MOS that is not a number, a transcript that is not a string."""
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
        mos = _number(outs, MOS_OUTPUT, allow_nan=True) if MOS_OUTPUT in outs else math.nan
        transcript = outs.get("TRANSCRIPTS", [""])[0]
    except (KeyError, IndexError, TypeError) as e:
        raise ResponseError(f"malformed response from reward server: {e!r}: {str(body)[:200]}") from None
    advertised = (body.get("parameters") or {}).get("reward_range", list(reward_range()))
    if not (isinstance(advertised, list) and len(advertised) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in advertised)
            and advertised[0] <= advertised[1]):
        raise ResponseError(f"the answer advertises reward_range {advertised!r}, not [low, high]")
    served = dict(zip(("SIM", "MOS"), range_weights(advertised)))
    for name, asked in (("SIM", sim_weight), ("MOS", mos_weight)):
        if asked is not None and abs(served[name] - asked) > WEIGHT_TOLERANCE:
            raise ResponseError(f"the answer advertises reward_range {advertised!r}, the range of another {name} weight "
                                f"than the {asked:g} this run trains on ({name} weight {served[name]:g})")
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
    return Reply(reward, err, transcript, sim, *terms, mos)


# ---------------------------------------------------------------------------
# server side


def build_response(model_name: str, reward: float, transcript: str, error_rate: float,
                   rid: str | None = None, wanted: list[str] | None = None, sim: float | None = None,
                   sim_weight: float = 0.0, reward_name: str | None = None, prompt_id: str | None = None,
                   cer_term: float = math.nan, length_term: float = math.nan, mos: float | None = None,
                   mos_weight: float = 0.0) -> dict:
    """The infer response. ``sim`` None: this server does not measure speaker similarity, and
    SIMS is left out unless the request names it (then NaN); a measuring server passes NaN
    where there was nothing to measure. So a server without SIM sends strict JSON, as before.
    ``reward_name``: the reward variant that scored it, in ``parameters.reward`` (a client that
    asks for one variant refuses an answer scored by another). ``prompt_id``: the speaker prompt
    the request named (PROMPT_ID), in ``parameters.prompt_id``; None (no PROMPT_ID): left out.
    ``cer_term``, ``length_term``: the reward's terms (CER_REWARDS, LENGTH_REWARDS), and ``mos``
    (DNSMOS OVRL, MOS_OVRLS; None or NaN: not measured), sent only when ``wanted`` names them.
    ``sim_weight``, ``mos_weight``: the weights the reward was combined with (its ``reward_range``)."""
    values = {"REWARDS": reward, "TRANSCRIPTS": transcript, "ERROR_RATES": error_rate,
              "SIMS": math.nan if sim is None else float(sim), "CER_REWARDS": float(cer_term),
              "LENGTH_REWARDS": float(length_term), MOS_OUTPUT: math.nan if mos is None else float(mos)}
    default = [n for n, _, _ in OUTPUT_SPECS if n not in BY_NAME_OUTPUTS and (n != "SIMS" or sim is not None)]
    outputs = [{"name": n, "datatype": d, "shape": s, "data": [values[n]]}
               for n, d, s in OUTPUT_SPECS if n in (default if wanted is None else wanted)]
    resp = {"model_name": model_name, "model_version": MODEL_VERSION, "outputs": outputs,
            "parameters": {"reward_range": list(reward_range(sim_weight, mos_weight))}}
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
