"""Text data (layer 2): stage 0's JSONL -> verl Parquet (``prepare``, with its first pass
over each file ``scan`` and its row checks ``rowchecks``), the test sets of stage 4 (``testsets``) and the dev split that stage 5
chooses on (``devsplit``). Every file is read through ``ttsrl.jsonl``.

May import: ``ttsrl.model`` (token ids) and the shared top-level modules.
"""
