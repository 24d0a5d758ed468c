"""Stage 4's files and report: per-pair results and summaries, the sweep table and plot.

    OUT/step_N/<set>/results.jsonl   one row per utterance (and sampling seed)
    OUT/step_N/<set>/summary.json    both error-rate conventions with 95% intervals, ...
    OUT/report.md, OUT/summary.json (one row per step and set) and OUT/terms.png
    OUT/listen.html                  start model and chosen step side by side, to listen to (ttsrl.eval.listen)

Two conventions, named (``ttsrl.eval.seedtts_eval`` owns the first):

* ``cer_utt_mean``: Seed-TTS eval, the MEAN of per-utterance rates (CER for zh sets, WER
  for en sets), with ``above_50`` the share of utterances above 50% (what papers report);
* ``cer_pooled``: total errors / total reference characters over the set, on
  ``ttsrl.text``'s normalised text (what the CosyVoice GRPO recipe reports); ``cer`` is
  the same number under its old name.

Where the token2wav backend has a speaker model (CosyVoice2), ``sim_mean`` is the mean
over utterances of the cosine of its campplus embeddings of the generated speech and the
prompt (``Token2Wav.speaker_similarity``), NOT the Seed-TTS eval SIM (WavLM-large).

Where the audio has a waveform (every backend but sim), ``mos_ovrl_mean`` (and ``mos_sig_mean``,
``mos_bak_mean``) is the mean over utterances of DNSMOS P.835's predicted opinion score: a
model's prediction of a listening test, not one.

Every figure has a bootstrap 95% interval over utterances (``ttsrl.stats``); each step
is also compared with the start model on the same utterances (paired bootstrap).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from ttsrl.atomic import atomic_path, atomic_write_text
from ttsrl.eval.seedtts_eval import share_above
from ttsrl.families import family, token2wav_families
from ttsrl.reward.backends.naturalness import FIGURES as MOS_FIGURES
from ttsrl.stats import (
    DEFAULT_RESAMPLES,
    METRICS,
    UttTable,
    bootstrap,
    bootstrap_mean,
    figure,
    paired,
    paired_mean,
    seed_spread,
)

RESULTS_FILE = "results.jsonl"
SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.md"
PLOT_FILE = "terms.png"
HEADLINES = {"utt_mean": "cer_utt_mean", "pooled": "cer_pooled"}
NAMES = {"cer_utt_mean": "mean of per-utterance rates (Seed-TTS eval)",
         "cer_pooled": "pooled: total errors / total reference characters"}


def pair_dir(out_dir: Path, step: int, test_set: str) -> Path:
    return out_dir / f"step_{step}" / test_set


def _rate(e: float, n: float) -> float:
    return e / n if n else (0.0 if e == 0 else 1.0)


def mean_present(xs: Iterable[float | None]) -> float | None:
    """Mean of the values that are not None; None when there are none."""
    got = [x for x in xs if x is not None]
    return sum(got) / len(got) if got else None


def summarize(rows: Sequence[dict], *, resamples: int = DEFAULT_RESAMPLES) -> dict:
    """Both conventions, their intervals and (several seeds) their spread across seeds.
    ``n`` counts utterances; with K seeds there are K rows (decodes) per utterance."""
    ce, cn = sum(r["cer_errors"] for r in rows), sum(r["ref_len"] for r in rows)
    pe, pn = sum(r["pinyin_errors"] for r in rows), sum(r["pinyin_ref_len"] for r in rows)
    failed = [r["id"] for r in rows if r["failure"]]
    d = len(rows)
    t = UttTable.from_rows(rows)
    out = {"n": len(t.ids), "decodes": d, "failures": len(failed), "failed_ids": failed,
           "cer_utt_mean": float(figure(t, "cer_utt_mean")) if d else 0.0,
           "above_50": share_above([r["utt_rate"] for r in rows]),
           "utt_unit": sorted({r["utt_unit"] for r in rows}),
           "cer_pooled": _rate(ce, cn), "cer": _rate(ce, cn), "cer_errors": ce, "cer_ref_len": cn,
           "pinyin_error": _rate(pe, pn), "pinyin_errors": pe, "pinyin_ref_len": pn,
           "reward": sum(r["reward"] for r in rows) / d if d else 0.0,
           "mean_codes": sum(r["n_codes"] for r in rows) / d if d else 0.0,
           "length_ratio_mean": mean_present(r.get("length_ratio") for r in rows),
           "length_ratio_ci": _mean_ci([r.get("length_ratio") for r in rows], resamples),
           "stopped": sum(1 for r in rows if r["stopped"])}
    if d:
        out["ci"] = {m: list(bootstrap(t, m, resamples=resamples)) for m in METRICS}
        out["resamples"] = resamples
    out.update(sim_summary(rows, resamples=resamples))
    for k in MOS_FIGURES:
        out.update(term_summary(rows, f"mos_{k}", resamples=resamples))
    out.update(term_summary(rows, "reading_error", resamples=resamples))
    seeds = sorted({r.get("seed", 0) for r in rows})
    out["seeds"] = seeds
    if len(seeds) > 1:
        per = [UttTable.from_rows([r for r in rows if r.get("seed", 0) == s]) for s in seeds]
        out["seed_spread"] = {m: seed_spread([float(figure(p, m)) for p in per]) for m in METRICS}
    return out


def _mean_ci(xs: Sequence[float | None], resamples: int) -> list[float] | None:
    """Bootstrap 95% interval of the mean of the values that are not None (None: there are none)."""
    got = [float(x) for x in xs if x is not None]
    return list(bootstrap_mean(got, resamples=resamples)) if got else None


def term_summary(rows: Sequence[dict], key: str, *, resamples: int = DEFAULT_RESAMPLES) -> dict:
    """``<key>_mean``: mean over the utterances with a value of the per-utterance term ``key`` (each
    the mean of its seeds' values), ``<key>_n`` of them, ``<key>_ci`` its bootstrap 95% interval;
    None (and 0) when no utterance has one (not measured by the backend, or every decode failed)."""
    v = list(by_utt(rows, key).values())
    if not v:
        return {f"{key}_mean": None, f"{key}_n": 0, f"{key}_ci": None}
    return {f"{key}_mean": sum(v) / len(v), f"{key}_n": len(v),
            f"{key}_ci": list(bootstrap_mean(v, resamples=resamples))}


def sim_summary(rows: Sequence[dict], *, resamples: int = DEFAULT_RESAMPLES) -> dict:
    """:func:`term_summary` of the speaker similarity: ``sim_mean``, ``sim_n``, ``sim_ci``."""
    return term_summary(rows, "sim", resamples=resamples)


def by_utt(rows: Sequence[dict], key: str) -> dict[str, float]:
    """Utterance id -> the mean of its decodes' values of ``key`` (those not None)."""
    per: dict[str, list[float]] = {}
    for r in rows:
        if r.get(key) is not None:
            per.setdefault(r["id"], []).append(float(r[key]))
    return {u: sum(x) / len(x) for u, x in per.items()}


def sim_by_utt(rows: Sequence[dict]) -> dict[str, float]:
    """Utterance id -> the mean of its decodes' speaker similarities (those not None)."""
    return by_utt(rows, "sim")


def write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, ensure_ascii=False, indent=2) + "\n")


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


SWEEP_KEYS = ("step", "model", "test_set", "cer", "cer_pooled", "cer_utt_mean", "above_50", "ci", "lang",
              "utt_unit", "seeds", "seed_spread", "pinyin_error", "reward", "length_ratio_mean", "length_ratio_ci", "n", "failures",
              "sim_mean", "sim_n", "sim_ci",
              *(f"mos_{k}_{x}" for k in MOS_FIGURES for x in ("mean", "n", "ci")),
              "reading_error_mean", "reading_error_n", "reading_error_ci")


#: per-utterance terms whose change from the start model each row reports (``<key>_vs_start``)
PAIRED_TERMS = ("sim", "mos_ovrl", "reading_error")


def write_sweep(out_dir: Path, models: dict[int, Path], names: Sequence[str], *, roles: dict[str, str] | None = None,
                headline: str = "cer_utt_mean", resamples: int = DEFAULT_RESAMPLES) -> list[dict]:
    """report.md, summary.json and terms.png from the per-model summaries on disk.
    ``roles``: set name -> "dev" (chooses the step for stage 5) or "test" (reported only)."""
    from ttsrl.eval.listen import write_listening_page
    from ttsrl.train.steps import choose_step

    roles = roles or {}
    rows, tables, settings, terms = [], {}, {}, {}
    for step in sorted(models):
        for name in names:
            where = pair_dir(out_dir, step, name)
            if not (where / SUMMARY_FILE).is_file():
                continue
            s = json.loads((where / SUMMARY_FILE).read_text())
            row = {**{k: s.get(k) for k in SWEEP_KEYS}, **sampling_of(s), "role": roles.get(name, "test"),
                   "headline": headline, "backend": (s.get("settings") or {}).get("backend")}
            results = read_jsonl(where / RESULTS_FILE) if (where / RESULTS_FILE).is_file() else []
            if results and all("utt_rate" in x for x in results):  # older schemas lack per-utterance rates
                tables[(step, name)] = UttTable.from_rows(results)
            terms[(step, name)] = {k: by_utt(results, k) for k in PAIRED_TERMS}
            settings[(step, name)] = s.get("settings")
            base = tables.get((0, name))
            if step != 0 and base is not None and (step, name) in tables:
                if settings[(step, name)] == settings.get((0, name)):
                    row["vs_start"] = {m: paired(tables[(step, name)], base, m, resamples=resamples)
                                       for m in METRICS}
                    start = terms.get((0, name), {})
                    for k in PAIRED_TERMS:
                        row[f"{k}_vs_start"] = paired_mean(terms[(step, name)][k], start.get(k, {}),
                                                           resamples=resamples)
                else:  # a difference of decoding settings is no difference of models
                    row["vs_start_note"] = "not compared: the start model was scored with other settings"
            rows.append(row)
    write_json(out_dir / SUMMARY_FILE, rows)
    choice = choose_step(rows)
    atomic_write_text(out_dir / REPORT_FILE, "# CER sweep (stage 4)\n\n" + format_table(rows, choice) + "\n")
    plot_terms(rows, out_dir / PLOT_FILE, chosen=choice.get("step"))
    write_listening_page(out_dir, [n for n in names if roles.get(n, "test") == "test"], choice.get("step"),
                         max(models, default=0))
    return rows


def sampling_of(summary: dict) -> dict:
    """How a pair was decoded: sampling rule (or greedy) and min/max token-text ratios.
    Summaries written before the rule was recorded used the cosyvoice2-2024 rule."""
    st = summary.get("settings") or {}
    sp = st.get("sampling") or {}
    return {"rule": "greedy" if st.get("greedy") else sp.get("rule", "cosyvoice2-2024"),
            "min_ratio": sp.get("min_token_text_ratio"), "max_ratio": sp.get("max_token_text_ratio")}


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def _with_ci(r: dict, m: str) -> str:
    ci = (r.get("ci") or {}).get(m)
    spread = (r.get("seed_spread") or {}).get(m)
    s = _pct(r.get(m)) + (f" [{100 * ci[0]:.2f}, {100 * ci[1]:.2f}]" if ci else "")
    return s + (f" ±{100 * spread['std']:.2f} sd/seed" if spread else "")


def _ratio(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _term(r: dict, key: str, digits: int = 3) -> str:
    """A per-utterance term's mean, interval, count and paired change from the start model."""
    if r.get(f"{key}_mean") is None:
        return "n/a"
    ci = r.get(f"{key}_ci")
    d = r.get(f"{key}_vs_start")
    f = f"{{:.{digits}f}}".format
    sf = f"{{:+.{digits}f}}".format
    return (f(r[f"{key}_mean"]) + (f" [{f(ci[0])}, {f(ci[1])}]" if ci else "") + f" (n {r.get(f'{key}_n')})"
            + (f", Δ vs start {sf(d['diff'])} [{sf(d['lo'])}, {sf(d['hi'])}]" if d else ""))


def _sim(r: dict) -> str:
    return _term(r, "sim")


#: what SIM is, by the scoring backend: (column label, note)
SIM_MODELS = {
    **{name: family(name).token2wav.sim_model for name in token2wav_families()},
    "sim": ("simulated", "mean over utterances of the share of the generated codes in the prompt speaker's code book "
                         "(the embedded world's speaker model, ttsrl.embedded.speakers.similarity: 1 wholly in the "
                         "prompt's voice, 0 wholly in another; its scale is not campplus's)"),
}


def sim_model(rows: Sequence[dict]) -> tuple[str, str]:
    """The SIM column's label and note for the backends the rows were scored with."""
    known = {SIM_MODELS.get(r.get("backend")) for r in rows if r.get("sim_mean") is not None}
    if len(known) == 1 and None not in known:
        return next(iter(known))
    return "speaker model", "mean over utterances of the scoring backend's speaker similarity to each prompt"


NO_SIM_NOTE = ("No SIM column: no utterance has a speaker similarity. The token2wav backend of this sweep has no "
               f"speaker model (sim, whisper: {' and '.join(token2wav_families())} have one, their model folder's campplus), or "
               "nothing was voiced.")


MOS_NOTE = ("DNSMOS OVRL: mean over utterances of DNSMOS P.835's predicted overall opinion score (1-5; Microsoft's "
            "model as speechmos 0.0.1.1 ships it, ttsrl.reward.backends.naturalness), n utterances with a value, Δ vs "
            "start: paired bootstrap. A model's prediction of a listening test, not a listening test; it does not "
            "know what was said. SIG and BAK are in summary.json.")


READING_NOTE = ("Reading error: mean over utterances of the edit distance between the generated phoneme codes (voice "
                "tokens dropped) and misaki's phonemes of the text, over the latter's length (the reading the LM was "
                "taught; no voice, no ASR), Δ vs start: paired bootstrap. It shows what the LM wrote; the CER adds "
                "what the voice and Whisper make of it.")


def _delta(r: dict, m: str) -> tuple[str, str]:
    v = (r.get("vs_start") or {}).get(m)
    if not v:
        return "", ""
    return (f"{100 * v['diff']:+.2f} [{100 * v['lo']:+.2f}, {100 * v['hi']:+.2f}]", f"{v['p_better']:.3f}")


def format_table(rows: Sequence[dict], choice: dict | None = None) -> str:
    h = rows[0]["headline"] if rows and rows[0].get("headline") else "cer_utt_mean"
    other = "cer_pooled" if h == "cer_utt_mean" else "cer_utt_mean"
    short = {"cer_utt_mean": "utt-mean CER/WER", "cer_pooled": "pooled CER"}
    head = (f"| step | test set | role | {short[h]} [95% CI] | {short[other]} [95% CI] | >50% "
            f"| Δ {short[h]} vs start [95% CI] | P(better) | pinyin error | mean reward | length ratio | n "
            "| failures | sampling | min/max ratio |")
    rule = "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"
    with_sim = any(r.get("sim_mean") is not None for r in rows)
    with_mos = any(r.get("mos_ovrl_mean") is not None for r in rows)
    with_reading = any(r.get("reading_error_mean") is not None for r in rows)
    sim_label, sim_note = sim_model(rows)
    if with_sim:
        head, rule = head + f" SIM ({sim_label}) [95% CI] |", rule + "---:|"
    if with_mos:
        head, rule = head + " DNSMOS OVRL [95% CI] |", rule + "---:|"
    if with_reading:
        head, rule = head + " reading error (0-1) [95% CI] |", rule + "---:|"
    head += "\n" + rule
    lines = [head]
    chosen = choice["step"] if choice and choice.get("step") is not None else None
    for r in rows:
        label = "0 (start)" if r["step"] == 0 else str(r["step"])
        mark = " *" if r["step"] == chosen and r.get("role") == "dev" else ""
        d, p = _delta(r, h)
        lines.append(f"| {label} | {r['test_set']} | {r.get('role', 'test')} | {_with_ci(r, h)}{mark} "
                     f"| {_with_ci(r, other)} | {_pct(r.get('above_50'))} | {d} | {p} | {_pct(r['pinyin_error'])} "
                     f"| {r['reward']:.3f} | {_ratio(r.get('length_ratio_mean'))} | {r['n']} | {r['failures']} "
                     f"| {r.get('rule', '?')} "
                     f"| {r.get('min_ratio', '?')}/{r.get('max_ratio', '?')} |"
                     + (f" {_sim(r)} |" if with_sim else "") + (f" {_term(r, 'mos_ovrl', 2)} |" if with_mos else "")
                     + (f" {_term(r, 'reading_error')} |" if with_reading else ""))
    notes = [f"Headline: `{h}`, {NAMES[h]}; also `{other}`, {NAMES[other]}. Error rates are CER on "
             "Chinese sets, WER on English ones (syllables under the simulated ASR). Brackets: bootstrap "
             "95% interval over utterances; Δ: this step minus the start model on the same utterances "
             "(paired bootstrap), P(better): share of resamples in which this step's error is lower. "
             "Length ratio: mean of speech codes generated / codes expected for the text (about 1 at a "
             "normal speaking rate; above 1 slow, below 1 fast or clipped), failures left out."]
    if with_sim:
        notes.append(f"SIM ({sim_label}): {sim_note}, n utterances with a value, Δ vs start: "
                     "paired bootstrap on the same utterances (higher is closer to the prompt); not the "
                     "Seed-TTS eval SIM (WavLM-large), so not comparable to papers' SIM.")
    elif rows:
        notes.append(NO_SIM_NOTE)
    if with_mos:
        notes.append(MOS_NOTE)
    if with_reading:
        notes.append(READING_NOTE)
    if choice:
        notes.append(choice["reason"] + (" `*` marks it." if chosen is not None else ""))
    return "\n".join(lines) + "\n\n" + "\n\n".join(notes)


#: the terms the plot draws, each in its own panel where a row has it: (value key, interval key or None, axis
#: label, scale). The error rate is the rows' headline (its interval in ``ci``); a term a backend does not
#: measure (SIM without a speaker model) has no panel.
PLOT_TERMS = (("sim_mean", "sim_ci", "SIM (speaker similarity to the prompt)", 1.0),
              ("mos_ovrl_mean", "mos_ovrl_ci", "DNSMOS OVRL (predicted MOS)", 1.0),
              ("reading_error_mean", "reading_error_ci", "reading error (% phonemes)", 100.0),
              ("length_ratio_mean", "length_ratio_ci", "length ratio (codes / expected)", 1.0))


def _series(mine: Sequence[dict], key: str, ci_key: str | None, scale: float):
    """x, y and asymmetric error bars of one set's rows for one term (rows without the term left out)."""
    got = [r for r in mine if r.get(key) is not None]
    ys = [scale * r[key] for r in got]
    cis = [((r.get("ci") or {}).get(key) if ci_key == "ci" else r.get(ci_key) if ci_key else None) for r in got]
    err = [[max(0.0, y - scale * c[0]) if c else 0.0 for y, c in zip(ys, cis)],
           [max(0.0, scale * c[1] - y) if c else 0.0 for y, c in zip(ys, cis)]]
    return [r["step"] for r in got], ys, err


def plot_terms(rows: Sequence[dict], path: Path, chosen: int | None = None) -> list[str]:
    """Every measured term of every set by step, one panel a term, each with its 95% interval: the
    headline error rate, SIM (where the backend has a speaker model), the length ratio; dev sets dashed,
    the step chosen on the dev set (``chosen``) a vertical line in every panel. Returns the terms drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = rows[0]["headline"] if rows and rows[0].get("headline") else "cer_utt_mean"
    terms = [(h, "ci", f"{h} (%)", 100.0)] + [t for t in PLOT_TERMS if any(r.get(t[0]) is not None for r in rows)]
    fig, axes = plt.subplots(len(terms), 1, figsize=(7, 2.8 * len(terms) + 0.6), sharex=True, squeeze=False)
    sets = list(dict.fromkeys(r["test_set"] for r in rows))
    for ax, (key, ci_key, label, scale) in zip(axes[:, 0], terms):
        for name in sets:
            mine = sorted((r for r in rows if r["test_set"] == name), key=lambda r: r["step"])
            xs, ys, err = _series(mine, key, ci_key, scale)
            if xs:
                role = mine[0].get("role", "test")
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, linestyle="--" if role == "dev" else "-",
                            label=f"{name} ({role})")
        if chosen is not None:
            ax.axvline(chosen, color="grey", linestyle=":", label=f"chosen on dev: step {chosen}")
        ax.set_ylabel(label + ", 95% CI" if ci_key else label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0, 0].set_title("held-out terms by step")
    axes[-1, 0].set_xlabel("training step (0 = start model)")
    if rows:
        axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return [t[0] for t in terms]
