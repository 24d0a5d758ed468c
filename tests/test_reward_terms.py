"""The reward's terms of their own: cer, sim, the length/finish term and the MOS weight.

Real pieces throughout: the ``sim`` backend's reward server on a loopback port (JSON, Triton's
binary extension through NVIDIA's own ``tritonclient.http``), verl's own ``compute_data_metrics``
and console format, ``compute_score`` as verl calls it. No fakes.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as http
from verl.utils.logger.aggregate_logger import concat_dict_to_str

from ttsrl.console import StepConsole
from ttsrl.embedded import codec
from ttsrl.reward.backends import BackendConfig
from ttsrl.reward.client import TERM_KEYS, RewardClientConfig, compute_score, is_finished
from ttsrl.reward.health import identity_mismatches
from ttsrl.reward.protocol import (
    DEFAULT_MODEL_NAME,
    MOS_OUTPUT,
    ResponseError,
    build_payload,
    build_response,
    infer_path,
    parse_response,
    range_weights,
    reward_range,
)
from ttsrl.reward.rewards import (
    LENGTH_BAND,
    WEIGHTS,
    expected_tokens,
    length_factor,
    length_term,
    naturalness_term,
    sim_weight_of,
)
from ttsrl.reward.scoring import Scored, combined_reward, finish
from ttsrl.reward.server import BackgroundServer, ServerConfig
from ttsrl.train.grpo import GRPOConfig
from ttsrl.verl_plugin.reward_metrics import LOGGED_KEYS, _patch_legacy, term_metrics

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # train_grpo.py

TEXTS = ["今天天气很好，我们去公园散步。", "我想喝一杯热茶。"]


# ---------------------------------------------------------------------------
# the length/finish term


def test_length_term_edge_cases():
    exp = 40.0
    lo, hi = LENGTH_BAND
    assert length_term(40, exp) == 1.0 and length_term(40, exp, finished=True) == 1.0  # inside the band
    assert length_term(int(lo * exp), exp) == 1.0 and length_term(int(hi * exp), exp) == 1.0  # its edges
    assert length_term(120, exp) == pytest.approx((2 / 3) ** 2)  # 3x too long: the guard's factor
    assert length_term(120, exp) == length_factor(120, exp)[0]
    assert length_term(10, exp) == pytest.approx((10 / 40 / lo) ** 2)  # too short
    assert length_term(40, exp, finished=False) == 0.0  # never ended: 0 whatever its length
    assert length_term(0, exp) == 0.0 and length_term(0, exp, finished=True) == 0.0  # empty: nothing said
    assert length_term(5, 0.0) == 1.0  # a text with no expected length: not judged
    # unknown (None) is judged by length alone, like a finished rollout
    assert [length_term(n, exp, None) for n in (3, 40, 200)] == [length_term(n, exp, True) for n in (3, 40, 200)]


def test_finish_rule_and_the_verl_budget():
    s = Scored("t", 0.7, 0.1, cer_term=0.8, length_term=0.875, sim=0.3)
    assert finish(s, None) is s and finish(s, True).reward == 0.7 and finish(s, True).finished is True
    cut = finish(s, False)
    assert cut.reward == 0.0 and cut.length_term == 0.0 and cut.cer_term == 0.8 and cut.sim == 0.3
    assert finish(s, False, length_guard=False).reward == 0.7  # the reference recipe exactly: no finish rule
    # verl cuts a response to the budget and a stop token takes one place: a full budget never ended
    assert is_finished(63, 64) is True and is_finished(64, 64) is False and is_finished(0, 64) is True
    assert is_finished(64, None) is None


# ---------------------------------------------------------------------------
# weights


def test_named_weights_and_bad_ones():
    assert WEIGHTS["cer"].sim_weight == 0.0 and WEIGHTS["glm_tts"].sim_weight == 0.1
    assert sim_weight_of("glm_tts", None) == 0.1 and sim_weight_of("glm_tts", 0.1) == 0.1
    assert sim_weight_of(None, 0.5) == 0.5 and sim_weight_of(None, None) is None
    with pytest.raises(ValueError, match="unknown reward weights 'glm'.*cer.*glm_tts"):
        sim_weight_of("glm", None)
    with pytest.raises(ValueError, match="'glm_tts' mean SIM weight 0.1, but SIM weight 0.5"):
        sim_weight_of("glm_tts", 0.5)
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="sim_weight must be a finite number >= 0"):
            sim_weight_of(None, bad)
    cfg = ServerConfig(backend=BackendConfig(backend="sim"), weights="glm_tts")
    cfg.validate()
    assert cfg.sim_weight == 0.1
    with pytest.raises(ValueError, match="give one of them"):
        ServerConfig(backend=BackendConfig(backend="sim"), weights="cer", sim_weight=0.1).validate()
    # the run asks for its weight and budget through verl's reward_kwargs
    g = GRPOConfig(model_path="m", train_files="t", val_files="v", reward_weights="glm_tts", max_response_length=77)
    kw = [o for o in g.to_overrides({}) if ".reward_kwargs." in o]
    assert "+reward.custom_reward_function.reward_kwargs.expect_sim_weight=0.1" in kw
    assert "+reward.custom_reward_function.reward_kwargs.max_response_length=77" in kw
    plain = GRPOConfig(model_path="m", train_files="t", val_files="v")
    assert not any("expect_sim_weight" in o for o in plain.to_overrides({}))  # not asked: any server's
    with pytest.raises(ValueError, match="give one of them"):
        GRPOConfig(model_path="m", train_files="t", val_files="v", reward_weights="cer", sim_weight=0.1)


def test_an_answer_of_another_sim_weight_is_refused():
    ok = build_response("m", 0.5, "t", 0.1, sim=0.2, sim_weight=0.1)
    assert parse_response(ok, sim_weight=0.1).reward == 0.5
    with pytest.raises(ResponseError, match="another SIM weight than the 0.1"):
        parse_response(build_response("m", 0.5, "t", 0.1), sim_weight=0.1)  # a CER-only server
    with pytest.raises(ResponseError, match="another SIM weight than the 0"):
        parse_response(ok, sim_weight=0.0)
    for bad in (1.5, -0.1):
        with pytest.raises(ResponseError, match="CER_REWARDS"):
            parse_response(build_response("m", 0.5, "t", 0.1, wanted=["REWARDS", "CER_REWARDS"], cer_term=bad))


def test_the_mos_term_and_its_weight():
    """q = (OVRL - 1) / 4 clipped to [0, 1]; the reward adds m x q; no OVRL (nothing heard) or m 0:
    nothing added, the reward as it was bit for bit."""
    assert [naturalness_term(x) for x in (1.0, 2.0, 3.0, 5.0)] == [0.0, 0.25, 0.5, 1.0]
    assert naturalness_term(0.7) == 0.0 and naturalness_term(5.2) == 1.0  # DNSMOS may stray past its scale
    assert combined_reward(0.5, 0.2, 0.1, 3.0, 0.2) == pytest.approx(0.5 + 0.1 * 0.2 + 0.2 * 0.5)
    assert combined_reward(0.5, None, 0.1, 4.6, 0.3) == pytest.approx(0.5 + 0.3 * 0.9)
    for r, sim in ((0.73, 0.41), (0.2, -0.3), (1.0, None)):
        assert combined_reward(r, sim, 0.1, None, 0.5) == combined_reward(r, sim, 0.1)  # not measured
        assert combined_reward(r, sim, 0.1, 4.0, 0.0) == combined_reward(r, sim, 0.1)  # weight 0
    # unfinished: no MOS term either
    assert finish(Scored("t", 0.9, 0.1, cer_term=0.8, length_term=1.0), False).reward == 0.0


def test_the_range_of_a_mos_weight():
    """The MOS term is in [0, 1]: its weight raises the top of the range only; weight 0 advertises
    what a server advertised before; both weights can be read back from a range."""
    assert reward_range() == reward_range(0.0, 0.0) == (0.0, 1.0)
    assert reward_range(0.1) == (-0.1, 1.1) and reward_range(0.0, 0.3) == (0.0, 1.3)
    assert reward_range(0.1, 0.2) == pytest.approx((-0.1, 1.3))
    for sim, mos in ((0.0, 0.0), (0.1, 0.0), (0.0, 0.3), (0.1, 0.2)):
        assert range_weights(list(reward_range(sim, mos))) == pytest.approx((sim, mos), abs=1e-12)
    # a reward of 1.25 (CER 1 + 0.25 x q) is within a MOS-0.3 server's range, not a plain one's
    assert parse_response(build_response("m", 1.25, "t", 0.0, mos_weight=0.3), mos_weight=0.3).reward == 1.25
    with pytest.raises(ResponseError, match="outside the range"):
        parse_response(build_response("m", 1.25, "t", 0.0))


def test_an_answer_of_another_mos_weight_is_refused():
    both = build_response("m", 1.1, "t", 0.1, sim=0.2, sim_weight=0.1, mos=4.2, mos_weight=0.2)
    assert parse_response(both, sim_weight=0.1, mos_weight=0.2).reward == 1.1
    assert parse_response(both, sim_weight=0.1).reward == 1.1  # MOS weight not asked for: any
    assert parse_response(both, mos_weight=0.2).reward == 1.1  # SIM weight not asked for: any
    with pytest.raises(ResponseError, match="another MOS weight than the 0.3 .*MOS weight 0.2"):
        parse_response(both, sim_weight=0.1, mos_weight=0.3)
    with pytest.raises(ResponseError, match="another SIM weight than the 0 "):
        parse_response(both, sim_weight=0.0, mos_weight=0.2)
    with pytest.raises(ResponseError, match="another MOS weight than the 0.2"):
        parse_response(build_response("m", 0.5, "t", 0.1), mos_weight=0.2)  # a server without the term
    with pytest.raises(ResponseError, match="another MOS weight than the 0 "):
        parse_response(both, mos_weight=0.0)
    # OVRL travels only when asked for by name (an old client's answer is unchanged), NaN where not measured
    assert MOS_OUTPUT not in [o["name"] for o in both["outputs"]] and math.isnan(parse_response(both).mos)
    asked = build_response("m", 1.1, "t", 0.1, mos=4.2, mos_weight=0.2, wanted=["REWARDS", MOS_OUTPUT])
    assert parse_response(asked).mos == 4.2
    unmeasured = build_response("m", 0.5, "t", 0.1, wanted=["REWARDS", MOS_OUTPUT])
    assert math.isnan(unmeasured["outputs"][1]["data"][0]) and math.isnan(parse_response(unmeasured).mos)


def test_a_bad_mos_weight_is_refused_naming_the_option():
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="mos_weight must be a finite number >= 0"):
            ServerConfig(backend=BackendConfig(backend="sim"), mos_weight=bad).validate()
        with pytest.raises(ValueError, match="mos_weight must be a finite number >= 0"):
            GRPOConfig(model_path="m", train_files="t", val_files="v", mos_weight=bad)
        with pytest.raises(ValueError, match="expect_mos_weight must be a finite number >= 0"):
            RewardClientConfig.from_env("http://127.0.0.1:1", mos_weight=bad)
    # the run asks for its MOS weight through verl's reward_kwargs; not set: any server's
    g = GRPOConfig(model_path="m", train_files="t", val_files="v", mos_weight=0.2)
    assert "+reward.custom_reward_function.reward_kwargs.expect_mos_weight=0.2" in g.to_overrides({})
    plain = GRPOConfig(model_path="m", train_files="t", val_files="v")
    assert not any("expect_mos_weight" in o for o in plain.to_overrides({}))
    with pytest.raises(ValueError, match="GRPOConfig.mos_weight owns: give it as --mos-weight"):
        GRPOConfig(model_path="m", train_files="t", val_files="v",
                   extra=("+reward.custom_reward_function.reward_kwargs.expect_mos_weight=0.5",))


def test_a_sim_backend_refuses_a_mos_weight_at_start():
    """The simulated codec's audio has no waveform for DNSMOS to hear: the server does not start."""
    with pytest.raises(ValueError, match="--mos-weight 0.1 needs audio with a waveform, and backend sim makes none"):
        with BackgroundServer(ServerConfig(backend=BackendConfig(backend="sim"), port=0, mos_weight=0.1)):
            pass


# ---------------------------------------------------------------------------
# the wire, on a real loopback server


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(ServerConfig(backend=BackendConfig(backend="sim"), port=0, max_batch=4)) as srv:
        yield srv


def _post(url: str, body: dict) -> dict:
    r = requests.post(url + infer_path(), json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_terms_over_json_and_the_old_request_unchanged(server):
    text = TEXTS[0]
    good = codec.encode(text)
    long = good * 3  # 3x the expected length: the guard's factor, well below 1
    old = requests.post(server.url + infer_path(), json=build_payload(good, text), timeout=60)
    assert [o["name"] for o in old.json()["outputs"]] == ["REWARDS", "TRANSCRIPTS", "ERROR_RATES"]
    outs = ("REWARDS", "CER_REWARDS", "LENGTH_REWARDS", "ERROR_RATES")
    seen = []
    for codes in (good, long):
        done = {o["name"]: o["data"][0] for o in _post(server.url, build_payload(codes, text, outputs=outs))["outputs"]}
        said = {o["name"]: o["data"][0] for o in _post(server.url, build_payload(codes, text, finished=True,
                                                                                  outputs=outs))["outputs"]}
        cut = {o["name"]: o["data"][0] for o in _post(server.url, build_payload(codes, text, finished=False,
                                                                                 outputs=outs))["outputs"]}
        want_len = length_factor(len(codes), expected_tokens(text, server.server.pipelines[0].token_rate))[0]
        assert done == said  # FINISHED 1 is what an old request was judged as
        assert done["LENGTH_REWARDS"] == pytest.approx(want_len, abs=1e-6)
        assert done["REWARDS"] == pytest.approx(done["LENGTH_REWARDS"] * done["CER_REWARDS"], abs=1e-6)
        assert cut["REWARDS"] == 0.0 and cut["LENGTH_REWARDS"] == 0.0 and cut["CER_REWARDS"] == done["CER_REWARDS"]
        seen.append(done)
    assert seen[0]["LENGTH_REWARDS"] == 1.0 and seen[0]["CER_REWARDS"] > 0.5  # the text's own codes
    assert seen[1]["LENGTH_REWARDS"] < 0.5  # three times as long: implausible
    # the old request's answer, byte for byte, after all this
    again = requests.post(server.url + infer_path(), json=build_payload(good, text), timeout=60)
    assert again.content == old.content
    # FINISHED is validated like the other inputs
    for value, why in ((2, "is not 0"), ("1", "INT32 data must be integers")):
        body = build_payload(good, text)
        body["inputs"].append({"name": "FINISHED", "shape": [1, 1], "datatype": "INT32", "data": [[value]]})
        r = requests.post(server.url + infer_path(), json=body, timeout=60)
        assert r.status_code == 400 and "FINISHED" in r.json()["error"] and why in r.json()["error"], r.text
    # an empty response: every term 0
    empty = _post(server.url, build_payload([], text, finished=True, outputs=outs))
    assert {o["name"]: o["data"][0] for o in empty["outputs"]} == {"REWARDS": 0.0, "CER_REWARDS": 0.0,
                                                                   "LENGTH_REWARDS": 0.0, "ERROR_RATES": 1.0}


def test_terms_over_tritonclient_binary(server):
    text = TEXTS[1]
    codes = codec.encode(text) * 3
    client = http.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        def infer(finished: int, binary: bool) -> dict:
            ins = [http.InferInput("TOKENS", [1, len(codes)], "INT32"), http.InferInput("TOKEN_LENS", [1, 1], "INT32"),
                   http.InferInput("GT_TEXT", [1, 1], "BYTES"), http.InferInput("FINISHED", [1, 1], "INT32")]
            ins[0].set_data_from_numpy(np.array(codes, dtype=np.int32).reshape(1, -1), binary_data=binary)
            ins[1].set_data_from_numpy(np.array([[len(codes)]], dtype=np.int32), binary_data=binary)
            ins[2].set_data_from_numpy(np.array([[text.encode("utf-8")]], dtype=np.object_), binary_data=binary)
            ins[3].set_data_from_numpy(np.array([[finished]], dtype=np.int32), binary_data=binary)
            names = ("REWARDS", "CER_REWARDS", "LENGTH_REWARDS")
            res = client.infer(DEFAULT_MODEL_NAME, ins,
                               outputs=[http.InferRequestedOutput(n, binary_data=binary) for n in names])
            return {n: float(res.as_numpy(n)[0, 0]) for n in names}

        json_said, bin_said, bin_cut = infer(1, False), infer(1, True), infer(0, True)
        assert bin_said == pytest.approx(json_said, abs=1e-6)
        assert 0.0 < bin_said["LENGTH_REWARDS"] < 1.0 and bin_cut == {**bin_said, "REWARDS": 0.0, "LENGTH_REWARDS": 0.0}
    finally:
        client.close()


def test_compute_score_keys_and_the_budget(server):
    text = TEXTS[0]
    codes = codec.encode(text)
    solution = "".join(f"<|s_{c}|>" for c in codes)
    cfg = dict(urls=server.url, expect_reward="tanh", expect_sim_weight=0.0, expect_mos_weight=0.0)

    async def score(budget, sol=solution):
        return await compute_score("d", sol, text, {}, max_response_length=budget, **cfg)

    ended = asyncio.run(score(len(codes) + 1))
    cut = asyncio.run(score(len(codes)))  # the response filled the budget: never ended
    unknown = asyncio.run(score(None))
    empty = asyncio.run(score(64, ""))
    results = (ended, cut, unknown, empty)
    assert len({frozenset(r) for r in results}) == 1 and set(TERM_KEYS) <= set(ended)
    assert all(math.isfinite(v) for r in results for k, v in r.items() if k != "transcript")
    assert ended["unfinished"] == 0.0 and cut["unfinished"] == 1.0 and unknown["unfinished"] == 0.0
    assert cut["score"] == 0.0 and cut["length"] == 0.0 and cut["cer"] == ended["cer"] > 0.5
    assert ended["score"] == pytest.approx(ended["cer"] * ended["length"], abs=1e-6) and ended == unknown
    assert empty["score"] == empty["cer"] == empty["length"] == 0.0
    assert ended["mos"] == 0.0 and ended["mos_measured"] == 0.0  # the sim backend measures no MOS
    # a run that asked for another SIM or MOS weight never trains on this server's answers
    for sim_weight, mos_weight in ((0.1, None), (None, 0.2), (0.0, 0.2)):
        wrong = RewardClientConfig.from_env(server.url, "tanh", sim_weight, 64, mos_weight)
        wrong.max_fail_fraction, wrong.retries = 1.0, 0
        r = asyncio.run(compute_score("d", solution, text, {}, config=wrong))
        assert r["reward_failed"] == 1.0 and r["score"] == 0.0, (sim_weight, mos_weight)


def test_a_run_asking_for_another_mos_weight_is_told_before_verl_starts(server):
    """train_grpo.py's check of the servers' identity: the MOS weight is one of its fields, and a
    server that predates it (no mos_weight in its metadata) serves weight 0."""
    import train_grpo

    meta = requests.get(f"{server.url}/v2/models/{DEFAULT_MODEL_NAME}", timeout=30).json()
    assert meta["mos_weight"] == 0.0 and meta["measures_mos"] is False and meta["reward_range"] == [0.0, 1.0]
    base = dict(model_path="m", train_files="t", val_files="v", reward_urls=server.url)
    record, problems = train_grpo.reward_record(GRPOConfig(**base, mos_weight=0.2), {})
    assert record["mos_weight"] == 0.2 and len(problems) == 1
    assert "serves mos_weight 0.0 (this run asks for '0.2')" in problems[0] and "--mos-weight" in problems[0]
    assert train_grpo.reward_record(GRPOConfig(**base, mos_weight=0.0), {})[1] == []
    assert train_grpo.reward_record(GRPOConfig(**base), {})[1] == []  # not asked: any
    old = {k: v for k, v in meta.items() if k != "mos_weight"}
    assert identity_mismatches(old, {"mos_weight": "0"}) == [] and identity_mismatches(old, {"mos_weight": "0.2"})


# ---------------------------------------------------------------------------
# logged per step: the verl plugin's metrics and the console line


def test_term_metrics_from_our_keys():
    rows = [{"cer": 0.5, "sim": 0.2, "length": 1.0, "unfinished": 0.0, "transcript": "x"},
            {"cer": 0.7, "sim": 0.4, "length": 0.0, "unfinished": 1.0, "transcript": "y"}]
    m = term_metrics(rows)
    assert m == pytest.approx({"reward/cer/mean": 0.6, "reward/sim/mean": 0.3, "reward/length/mean": 0.5,
                               "reward/unfinished/mean": 0.5})
    assert term_metrics([]) == {} and "reward/sim/mean" not in term_metrics([{"sim": 0.1}, {"sim": math.nan}])
    assert set(TERM_KEYS) <= set(LOGGED_KEYS)


def test_the_legacy_trainers_metrics_carry_the_terms():
    """verl's own compute_data_metrics on a batch as the legacy trainer holds it (extra info in the
    non-tensor batch), wrapped by the plugin's patch."""
    import types

    from test_gdpo import _batch
    from verl.trainer.ppo import metric_utils

    from ttsrl.reward.client import _result

    results = [_result(0.5, 0.1, "t", False, 0.3, cer=0.6, length=1.0, finished=True),
               _result(0.0, 0.1, "t", False, 0.5, cer=0.8, length=0.0, finished=False)]
    module = types.SimpleNamespace(compute_data_metrics=metric_utils.compute_data_metrics)
    _patch_legacy(module)
    _patch_legacy(module)  # idempotent
    batch = _batch(results, 2)
    t = batch.batch
    t["token_level_scores"] = t["token_level_rewards"]
    t["advantages"] = t["returns"] = t["token_level_rewards"].clone()
    t["responses"] = t["response_mask"].clone()
    m = module.compute_data_metrics(batch=batch, use_critic=False)
    assert m["critic/score/mean"] == pytest.approx(0.25)  # verl's own metrics still there
    assert m["reward/cer/mean"] == pytest.approx(0.7) and m["reward/sim/mean"] == pytest.approx(0.4)
    assert m["reward/length/mean"] == 0.5 and m["reward/unfinished/mean"] == 0.5


def test_console_line_shows_the_terms():
    console = StepConsole(total_steps=80)
    base = {"critic/score/mean": 0.4, "response_length/mean": 50.0, "timing_s/step": 5.0}
    terms = {"reward/cer/mean": 0.612, "reward/sim/mean": 0.284, "reward/length/mean": 0.973,
             "reward/unfinished/mean": 0.03, "reward/sim_measured/mean": 1.0}
    line = console.feed(concat_dict_to_str({**base, **terms}, step=10))
    assert line == ("step 10/80  reward 0.400  cer 0.612  sim 0.284  length 0.973  unfinished 3%  len  50.0"
                    "    5.0 s/step  ETA 5m50s"), line
    # SIM not measured by any rollout: left out, not shown as 0
    unmeasured = console.feed(concat_dict_to_str({**base, **terms, "reward/sim_measured/mean": 0.0}, step=11))
    assert "sim" not in unmeasured and "cer 0.612" in unmeasured
    # --algorithm gdpo without the plugin's metrics: verl's own gdpo/<key>/mean
    gdpo = console.feed(concat_dict_to_str({**base, "gdpo/cer/mean": 0.5, "gdpo/sim/mean": 0.25,
                                            "gdpo/length/mean": 1.0}, step=12))
    assert "cer 0.500  sim 0.250  length 1.000" in gdpo
    assert "cer" not in console.feed(concat_dict_to_str(base, step=13))  # none logged: none shown


@pytest.mark.slow  # ~6 s: imports verl's trainers in a fresh process
def test_the_plugin_patches_verls_trainers_when_verl_imports_them():
    """In a fresh process with the plugin selected as verl selects it (VERL_USE_EXTERNAL_MODULES):
    both trainers' metric code is wrapped once verl imports it (the v1 trainer's method included)."""
    import os
    import subprocess

    from ttsrl.verl_plugin import PLUGIN_MODULE

    code = ("import verl.trainer.ppo.v1.trainer_base as tb, verl.trainer.ppo.ray_trainer as rt\n"
            "print(getattr(tb.PPOTrainer._compute_metrics, '_ttsrl_reward_metrics', False),"
            " getattr(rt.compute_data_metrics, '_ttsrl_reward_metrics', False))")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": PLUGIN_MODULE, "PYTHONPATH": str(root)}
    p = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.split()[-2:] == ["True", "True"], p.stderr[-2000:]


def _fake_v1(tmp_path, infos_by_key, n=4):
    """verl's v1 trainer as the plugin's patch sees it: a replay buffer whose sample returns the
    keys of the trajectories that came back, the TransferQueue holding their reward extra info."""
    import types

    from omegaconf import OmegaConf

    from ttsrl.verl_plugin.reward_metrics import _patch_v1

    class Batch:
        def __init__(self, keys):
            self.keys, self.tags, self.partition_id = list(keys), [{} for _ in keys], "train"

    class Buffer:
        def sample(self, global_steps, partition_id, batch_size):
            return Batch(infos_by_key), {"off_policy/x": 1.0}

    class Column:
        def __init__(self, rows):
            self.rows = rows

        def tolist(self):
            return self.rows

    class PPOTrainer:
        config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": n}},
                                   "trainer": {"default_local_dir": str(tmp_path)}})

        def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
            return None

        def _build_replay_buffer(self):
            return Buffer()

    tq = types.SimpleNamespace(kv_batch_get=lambda keys, partition_id, select_fields: {
        "extra_fields": Column([{"reward_extra_info": infos_by_key[k]} for k in keys])})
    module = types.SimpleNamespace(PPOTrainer=PPOTrainer, tq=tq)
    _patch_v1(module)
    return PPOTrainer()


def test_a_step_that_lost_a_quarter_of_its_rewards_stops_the_run_naming_it(tmp_path, monkeypatch):
    """The run that trained on a fraction of its rewards and exited 0: 4 groups of n=4 were asked
    for; one group came back with none (verl dropped it: the reward function raised) and one
    rollout was scored 0 after a failed request. Before, the step trained on what was left and
    its metrics said reward_failed 0.06; now the step stops before its update, naming the step,
    the counts and the knob, and the run record says so."""
    from ttsrl.verl_plugin.reward_metrics import GROUPS_DROPPED, NO_REWARD, RewardHealthError

    monkeypatch.delenv("TTSRL_REWARD_MAX_FAIL_FRACTION", raising=False)
    (tmp_path / "ttsrl_run.json").write_text(json.dumps({"preset": "embedded"}))
    ok = {"reward_failed": 0.0, "cer": 0.5}
    infos = {f"g{g}_{s}_0": dict(ok) for g in range(3) for s in range(4)}
    infos["g0_1_0"] = {"reward_failed": 1.0, "cer": 0.0}
    trainer = _fake_v1(tmp_path, infos)
    buffer = trainer._build_replay_buffer()
    with pytest.raises(RewardHealthError) as e:
        buffer.sample(global_steps=1, partition_id="train", batch_size=4)
    why = str(e.value)
    assert "step 1: 5 of 16 rollouts have no reward (31%: 1 scored 0" in why and "4 lost by verl" in why
    assert "1 of 4 groups short" in why and "TTSRL_REWARD_MAX_FAIL_FRACTION=0.1" in why
    health = json.loads((tmp_path / "ttsrl_run.json").read_text())["reward_health"]
    assert health["stopped"]["step"] == 1 and health["steps_with_loss"]["1"]["missing"] == 4
    assert health["limit"] == 0.1 and health["worst_share"] == pytest.approx(5 / 16)

    # within the share: the step trains, its metrics say what it lacked, the record keeps the step
    monkeypatch.setenv("TTSRL_REWARD_MAX_FAIL_FRACTION", "0.5")
    batch, metrics = trainer._build_replay_buffer().sample(global_steps=2, partition_id="train", batch_size=4)
    assert metrics[NO_REWARD] == pytest.approx(5 / 16) and metrics[GROUPS_DROPPED] == pytest.approx(0.25)
    assert metrics["off_policy/x"] == 1.0 and len(batch.keys) == 12
    assert "2" in json.loads((tmp_path / "ttsrl_run.json").read_text())["reward_health"]["steps_with_loss"]
    # validation is not a training step: never stopped
    trainer._build_replay_buffer().sample(global_steps=3, partition_id="val", batch_size=8)


def test_groups_whose_rollouts_all_scored_the_same_are_counted_as_flat():
    """A group of n rollouts with one score has zero variance, so zero advantage: it teaches nothing.
    The step's share of such groups is a metric; failed rollouts (scored 0 by the client) and a group
    of one rollout count for nothing; a spread below verl's 1e-6 is flat."""
    from ttsrl.verl_plugin.reward_metrics import GROUPS_FLAT, health_metrics, step_health

    keys, infos = [], []
    for g, scores in enumerate(([1.0] * 4, [1.0, 1.0, 0.5, 1.0], [0.3, 0.3 + 1e-7, 0.3, 0.3], [0.9])):
        for s, score in enumerate(scores):
            keys.append(f"u{g}_{s}_0")
            infos.append({"score": score, "reward_failed": 0.0})
    keys += ["u4_0_0", "u4_1_0"]
    infos += [{"score": 0.0, "reward_failed": 1.0}, {"score": 0.7, "reward_failed": 0.0}]
    h = step_health(keys, [{} for _ in keys], infos, prompts=5, n=4)
    assert h["groups_flat"] == 2  # u0 (all 1.0) and u2 (within 1e-6); not u1, nor u3/u4 (one scored rollout)
    assert health_metrics(h)[GROUPS_FLAT] == pytest.approx(2 / 5)


def test_console_line_shows_the_rewards_a_step_lacked():
    console = StepConsole(total_steps=10)
    line = console.feed(concat_dict_to_str({"critic/score/mean": 0.4, "reward/no_reward/share": 0.004,
                                            "reward/groups_dropped/share": 0.25}, step=1))
    assert "no reward 0.4%" in line and "groups dropped 25%" in line, line
    line = console.feed(concat_dict_to_str({"critic/score/mean": 0.4, "reward/no_reward/share": 0.0,
                                            "reward/groups_dropped/share": 0.0}, step=2))
    assert "no reward 0%  groups dropped 0%" in line, line
    line = console.feed(concat_dict_to_str({"critic/score/mean": 0.9, "reward/groups_flat/share": 0.75}, step=3))
    assert "flat groups 75%" in line, line
