"""The launcher (layer 6, under ``run.sh``): the run's settings (``settings``: the preset, the
environment, what is derived, checked in one pass), the reward servers a run starts, adopts or
refuses (``server``), stage 2's runner (``train``) and the roles of a multi-node run (``roles``,
over ``nodes``: Ray's node table and the head's markers). ``run.sh`` keeps the stages, each a CLI
call; ``python -m ttsrl.launch`` holds the logic between them, tested in-process.

May import every other layer. Only ``settings`` must run on a bare Python (before stage -2).
"""
