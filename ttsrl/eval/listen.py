"""Stage 4's listening page: ``OUT/listen.html``, the start model and the chosen step side by side.

For the first few utterances of a test set, each row holds the text, then for each of the two
models its audio (an ``<audio>`` player on the wav stage 4 wrote), its transcript, its error rate,
and SIM and DNSMOS OVRL where measured. The page is one static file with relative links into
``OUT/step_N/<set>/wavs/``: it works offline, from the folder, in any browser, and needs no script.
Written only where a backend made audio (none for the simulated codec).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Sequence

from ttsrl.atomic import atomic_write_text
from ttsrl.eval.report import RESULTS_FILE, read_jsonl

LISTEN_FILE = "listen.html"
WAVS = "wavs"


def safe_name(s: str) -> str:
    """An utterance id as the file name stage 4 writes its wav under."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in s) or "utt"


def _first_seed(path: Path) -> dict[str, dict]:
    """Utterance id -> its result row of the first sampling seed (the one stage 4 keeps audio of), in
    file order."""
    if not path.is_file():
        return {}
    rows = read_jsonl(path)
    first = min((r.get("seed", 0) for r in rows), default=0)
    return {r["id"]: r for r in rows if r.get("seed", 0) == first}


def _cell(out_dir: Path, step: int, test_set: str, row: dict | None) -> str:
    if row is None:
        return "<td>not scored</td>"
    wav = Path(f"step_{step}") / test_set / WAVS / f"{safe_name(row['id'])}.wav"
    player = (f'<audio controls preload="none" src="{html.escape(wav.as_posix())}"></audio>'
              if (out_dir / wav).is_file() else "<i>no audio</i>")
    scores = [f"error {100 * row['utt_rate']:.1f}%"] if row.get("utt_rate") is not None else []
    if row.get("sim") is not None:
        scores.append(f"SIM {row['sim']:.3f}")
    if row.get("mos_ovrl") is not None:
        scores.append(f"DNSMOS {row['mos_ovrl']:.2f}")
    heard = html.escape(row.get("transcript") or "") or "<i>(nothing)</i>"
    return f"<td>{player}<br>{heard}<br><small>{' · '.join(scores)}</small></td>"


def write_listening_page(out_dir: Path, test_sets: Sequence[str], chosen: int | None, last_step: int,
                         n: int = 8) -> Path | None:
    """The page for the first test set with start-model audio: its first ``n`` utterances, the start
    model against ``chosen`` (the step chosen on dev; without one, ``last_step``). None (and no file)
    where no start-model audio exists."""
    step = chosen if chosen else last_step
    for name in test_sets:
        if not (out_dir / "step_0" / name / WAVS).is_dir():
            continue
        start = _first_seed(out_dir / "step_0" / name / RESULTS_FILE)
        other = _first_seed(out_dir / f"step_{step}" / name / RESULTS_FILE) if step else {}
        ids = list(start)[:n]
        label = f"step {step}" + (" (chosen on dev)" if chosen else " (the last)") if step else None
        head = "<tr><th>text</th><th>start model (step 0)</th>" + (f"<th>{label}</th>" if label else "") + "</tr>"
        body = "".join(
            f"<tr><td>{html.escape(start[u].get('text', ''))}</td>{_cell(out_dir, 0, name, start[u])}"
            + (_cell(out_dir, step, name, other.get(u)) if label else "") + "</tr>" for u in ids)
        page = (
            "<!doctype html><html><head><meta charset='utf-8'><title>ttsrl: listen</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:.5em;"
            "vertical-align:top}table{border-collapse:collapse}audio{width:16em}</style></head><body>"
            f"<h1>Listen: {html.escape(name)}</h1><p>The first {len(ids)} utterances of test set "
            f"<b>{html.escape(name)}</b>, first sampling seed. Under each player: what the ASR heard, the "
            "utterance's error rate, and SIM and DNSMOS OVRL where the backend measures them "
            "(report.md says what each is).</p>"
            f"<table>{head}{body}</table></body></html>\n")
        path = out_dir / LISTEN_FILE
        atomic_write_text(path, page)
        return path
    return None
