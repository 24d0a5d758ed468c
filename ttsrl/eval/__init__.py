"""Evaluation (layer 5, stage 4): distributed inference of every merged step on the test
and dev sets (``evaluate``, ``dist``), CER by Seed-TTS eval's convention
(``seedtts_eval``), the table, plot and confidence intervals (``report``), and the
comparison of training runs at an equal time budget (``compare``).

May import: everything below it (``ttsrl.train`` for the step layout, ``ttsrl.reward`` for
scoring, ``ttsrl.data``, ``ttsrl.model``, the shared modules). Nothing imports it.
"""
