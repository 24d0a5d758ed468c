"""ttsrl.eval.compare: GRPO variants judged at an equal training-time budget.

The run folders are written here in the formats stage 2 and stage 4 leave (verl's console
metric lines behind Ray's prefix; summary.json rows and results.jsonl per step and set);
the real runs are scripts/compare_algorithms.sh's (README "Which recipe when")."""

import json

import pytest

from ttsrl.eval import compare

IDS = [f"u{i}" for i in range(40)]


def _run(root, name, step_s, saved, test_rate, dev_rate, length=20.0, sim=None, flat=False):
    """A run folder: ``step_s`` seconds per step; ``saved`` steps scored (0 = start model) with a
    test rate ``test_rate[step]`` on every utterance and a dev rate ``dev_rate[step]``; with
    ``sim`` (step -> value) every test utterance has that speaker similarity, and the row its mean; with
    ``flat`` step s logs a share 0.1 s of flat groups."""
    run = root / name
    (run / "logs").mkdir(parents=True)
    lines = ["[train_grpo] python -m verl.trainer.main_ppo ...", "some Ray noise"]
    for step, t in enumerate(step_s, start=1):
        lines.append(f"\x1b[36m(TaskRunnerV1 pid=7)\x1b[0m step:{step} - critic/score/mean:0.1 - "
                     f"response_length/mean:{length + step} - timing_s/step:{t}"
                     + (f" - reward/groups_flat/share:{0.1 * step}" if flat else ""))
    (run / "logs" / "train_grpo.log").write_text("\n".join(lines) + "\n")
    rows = []
    for step in [0, *saved]:
        for name_, role, rate in (("dev", "dev", dev_rate[step]), ("embedded_test", "test", test_rate[step])):
            sim_v = sim[step] if sim and role == "test" else None
            rows.append({"step": step, "test_set": name_, "role": role, "headline": "cer_utt_mean",
                         "cer_utt_mean": rate, "ci": {"cer_utt_mean": [rate - 0.02, rate + 0.02]},
                         "length_ratio_mean": 1.0, "sim_mean": sim_v})
            where = run / "eval" / f"step_{step}" / name_
            where.mkdir(parents=True)
            with open(where / "results.jsonl", "w") as f:
                for k, u in enumerate(IDS):  # SIM varies by utterance around its mean
                    f.write(json.dumps({"id": u, "utt_rate": rate, "cer_errors": rate * 10, "ref_len": 10,
                                        "sim": None if sim_v is None else sim_v + (k % 5 - 2) * 0.01 * (step > 0)})
                            + "\n")
    (run / "eval" / "summary.json").write_text(json.dumps(rows))
    return run


def _near(root):
    """A run 4% slower than grpo-seed1 of the test below."""
    return compare.read_run(_run(root, "near-seed1", [10.4] * 6, [2, 4, 6], {0: 0.5, 2: 0.45, 4: 0.40, 6: 0.36},
                                 {0: 0.5, 2: 0.45, 4: 0.41, 6: 0.40}))


def test_runs_are_judged_at_the_fastest_runs_time(tmp_path):
    start = {0: 0.5}
    # grpo: 10 s a step, 6 steps (60 s), saved at 2, 4, 6; slow: 15 s a step, so 4 steps in 60 s
    _run(tmp_path, "grpo-seed1", [10] * 6, [2, 4, 6], {**start, 2: 0.45, 4: 0.40, 6: 0.35},
         {0: 0.5, 2: 0.45, 4: 0.41, 6: 0.42})
    _run(tmp_path, "slow-seed1", [15] * 6, [2, 4, 6], {**start, 2: 0.44, 4: 0.42, 6: 0.30},
         {0: 0.5, 2: 0.44, 4: 0.43, 6: 0.31}, length=30.0, flat=True)
    result = compare.compare(compare.read_runs(tmp_path), tolerance=0)
    assert result["budget_s"] == 60 and result["start_cer"] == 0.5
    # the default tolerance: an algorithm 4% slower than the fastest counts as equally fast
    near = compare.compare([compare.read_run(tmp_path / "grpo-seed1"), _near(tmp_path)])
    assert near["budget_s"] == pytest.approx(66) and near["budget_rule"] == "grpo's 60 s + 10%"
    assert [e["runs"][0]["step_at_budget"] for e in near["algorithms"]] == [6, 6]
    by = {e["algorithm"]: e for e in result["algorithms"]}
    g, s = by["grpo"]["runs"][0], by["slow"]["runs"][0]
    assert (g["steps_done"], g["step_at_budget"], g["cer_at_budget"]) == (6, 6, 0.35)
    assert (s["steps_done"], s["step_at_budget"], s["cer_at_budget"]) == (4, 4, 0.42)
    # best: the step the dev set chooses (as stage 5 does), over every saved step
    assert (g["best_step"], g["cer_best"]) == (4, 0.40) and (s["best_step"], s["cer_best"]) == (6, 0.30)
    assert s["response_length"] == pytest.approx(30 + 2.5)  # steps 1-4 only
    # the share of groups that teach nothing, over the steps in budget: mean, first and last
    assert (s["flat_groups"], s["flat_first"], s["flat_last"]) == (pytest.approx(0.25), 0.1, 0.4)
    assert g["flat_groups"] is None  # a log without the metric
    assert [e["algorithm"] for e in result["algorithms"]] == ["grpo", "slow"]  # lower CER at equal time first
    v = by["slow"]["vs_reference"]
    assert v["diff"] == pytest.approx(0.07) and v["p_better"] == 0.0
    # a budget given by hand: at 45 s grpo has done 4 steps, slow 3 (last saved: 2)
    later = {e["algorithm"]: e["runs"][0] for e in compare.compare(compare.read_runs(tmp_path), 45)["algorithms"]}
    assert (later["grpo"]["step_at_budget"], later["slow"]["steps_done"], later["slow"]["step_at_budget"]) == (4, 3, 2)
    table = compare.format_table(result)
    assert ("| slow | 42.00 (42.00) (step 4) | +7.00 [+7.00, +7.00], 0.00 | 30.00 (30.00) | -5.00 [-5.00, -5.00], "
            "1.00 | 90 | 30.00 (30.00; step 6) | 4 | 15.0 | 32.5 | 25 (10 -> 40) |") in table, table
    assert "| 6 | 10.0 | 23.5 | n/a |" in table, table


def test_seeds_are_averaged_and_pooled_per_utterance(tmp_path):
    for seed, rate in ((1, 0.40), (2, 0.30)):
        _run(tmp_path, f"grpo-seed{seed}", [10] * 2, [2], {0: 0.5, 2: rate}, {0: 0.5, 2: rate})
        _run(tmp_path, f"dapo-seed{seed}", [10] * 2, [2], {0: 0.5, 2: rate - 0.1}, {0: 0.5, 2: rate})
    result = compare.compare(compare.read_runs(tmp_path))
    dapo = next(e for e in result["algorithms"] if e["algorithm"] == "dapo")
    assert dapo["seeds"] == [1, 2] and dapo["cer_at_budget"] == pytest.approx(0.25)
    assert result["timing_spread"] == 0 and "differ by" not in compare.format_table(result)
    assert dapo["vs_reference"]["diff"] == pytest.approx(-0.10) and dapo["vs_reference"]["p_better"] == 1.0
    assert "(30.00 / 20.00)" in compare.format_table(result)


def test_unreadable_folders_are_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        compare.main([str(tmp_path)])
    assert exc.value.code == 2 and "no scored ALGORITHM-seedS run folders" in capsys.readouterr().err
    (tmp_path / "grpo-seed1" / "logs").mkdir(parents=True)
    (tmp_path / "grpo-seed1" / "logs" / "train_grpo.log").write_text("step:1 - timing_s/step:3.0\n")
    with pytest.raises(SystemExit):
        compare.main([str(tmp_path)])
    assert "eval/summary.json not found: stage 4 has not scored this run" in capsys.readouterr().err
    # a run still training is left out, said on stderr, and the scored ones are compared
    _run(tmp_path, "rloo-seed1", [10] * 2, [2], {0: 0.5, 2: 0.4}, {0: 0.5, 2: 0.4})
    compare.main([str(tmp_path), "--reference", "rloo"])
    out = capsys.readouterr()
    assert "| rloo | 40.00 (40.00) (step 2) | (reference) |" in out.out and "left out: " in out.err
    assert "grpo-seed1/eval/summary.json not found" in out.err
    assert json.loads((tmp_path / "compare.json").read_text())["left_out"][0].endswith("has not scored this run")
    with pytest.raises(ValueError, match="named ALGORITHM-seedS"):
        compare.read_run(tmp_path / "logs")


def test_both_seeds_of_an_algorithm_are_judged_after_the_same_steps(tmp_path):
    """One run's step time is noisy; an algorithm's cost is its mean over seeds: a seed that ran
    slow is not judged earlier than its twin, and the spread between them is reported."""
    for seed, t in ((1, 9.0), (2, 11.0)):  # grpo: 10 s a step on average
        _run(tmp_path, f"grpo-seed{seed}", [t] * 6, [2, 4, 6], {0: 0.5, 2: 0.45, 4: 0.4, 6: 0.35},
             {0: 0.5, 2: 0.45, 4: 0.4, 6: 0.35})
    for seed, t in ((1, 13.0), (2, 15.0)):  # gspo: 14 s a step, 40% dearer
        _run(tmp_path, f"gspo-seed{seed}", [t] * 6, [2, 4, 6], {0: 0.5, 2: 0.45, 4: 0.4, 6: 0.3},
             {0: 0.5, 2: 0.45, 4: 0.4, 6: 0.3})
    result = compare.compare(compare.read_runs(tmp_path))
    by = {e["algorithm"]: e for e in result["algorithms"]}
    assert result["budget_s"] == pytest.approx(66)  # grpo's 60 s + 10%
    assert [j["step_at_budget"] for j in by["grpo"]["runs"]] == [6, 6]  # the 11 s/step seed too (66 s)
    assert [j["steps_done"] for j in by["gspo"]["runs"]] == [4, 4]  # 66 / 14
    assert result["timing_spread"] == pytest.approx(11 / 9 - 1)  # grpo 99 s vs 81 s
    assert "runs differ by up to 22% in training time" in compare.format_table(result)


def test_reward_weightings_are_variants_with_sim_beside_cer(tmp_path):
    """CER-only GRPO, GRPO on CER + 0.1 SIM (folder grpo+glm_tts-seedS) and gdpo are
    compared at equal steps; stage 4's SIM gets its columns and a paired difference to the reference."""
    for seed in (1, 2):
        _run(tmp_path, f"grpo-seed{seed}", [10] * 4, [2, 4], {0: 0.8, 2: 0.6, 4: 0.5}, {0: 0.8, 2: 0.6, 4: 0.5},
             sim={0: 0.9, 2: 0.8, 4: 0.7})
        _run(tmp_path, f"grpo+glm_tts-seed{seed}", [10] * 4, [2, 4], {0: 0.8, 2: 0.62, 4: 0.52},
             {0: 0.8, 2: 0.62, 4: 0.52}, sim={0: 0.9, 2: 0.88, 4: 0.9 - 0.02 * seed})
        _run(tmp_path, f"gdpo-seed{seed}", [10] * 4, [2, 4], {0: 0.8, 2: 0.65, 4: 0.55}, {0: 0.8, 2: 0.65, 4: 0.55},
             sim={0: 0.9, 2: 0.9, 4: 0.91})
    runs = compare.read_runs(tmp_path)
    assert {r.algorithm for r in runs} == {"grpo", "grpo+glm_tts", "gdpo"}
    result = compare.compare(runs)
    by = {e["algorithm"]: e for e in result["algorithms"]}
    assert result["with_sim"] and result["start_sim"] == pytest.approx(0.9)
    w = by["grpo+glm_tts"]
    assert w["sim_final"] == pytest.approx(0.87) and [j["sim_final"] for j in w["runs"]] == pytest.approx([0.88, 0.86])
    d = w["sim_vs_reference_final"]
    assert d["diff"] == pytest.approx(0.17) and d["lo"] <= 0.17 <= d["hi"] and d["n"] == len(IDS)
    assert by["gdpo"]["sim_vs_reference_final"]["diff"] == pytest.approx(0.21)
    assert w["vs_reference_final"]["diff"] == pytest.approx(0.02)  # CER pays for it
    assert "sim_vs_reference" not in by["grpo"]
    table = compare.format_table(result)
    assert "SIM after all steps | Δ SIM vs grpo after all steps |" in table and "SIM 0.900" in table
    line = next(x for x in table.splitlines() if x.startswith("| grpo+glm_tts |"))
    assert line.endswith("| 0.870 (0.880 / 0.860) | +0.170 [+0.170, +0.170] |"), line
    # without SIM (a text-only sweep) the table has no SIM columns
    plain = tmp_path / "plain"
    _run(plain, "grpo-seed1", [10] * 2, [2], {0: 0.5, 2: 0.4}, {0: 0.5, 2: 0.4})
    assert "SIM" not in compare.format_table(compare.compare(compare.read_runs(plain)))
    # a SIM weight of one's own names a variant too (REWARD_WEIGHTS=0.2), as run.sh takes it
    _run(tmp_path, "grpo+0.2-seed1", [10] * 2, [2], {0: 0.8, 2: 0.6}, {0: 0.8, 2: 0.6}, sim={0: 0.9, 2: 0.9})
    assert "grpo+0.2" in {r.algorithm for r in compare.read_runs(tmp_path)}
    # a weighting that does not exist is named
    _run(tmp_path, "grpo+magic-seed1", [10] * 2, [2], {0: 0.5, 2: 0.4}, {0: 0.5, 2: 0.4})
    with pytest.raises(ValueError, match=r"unknown reward weights 'magic'"):
        compare.read_run(tmp_path / "grpo+magic-seed1")
