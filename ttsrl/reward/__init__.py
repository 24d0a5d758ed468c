"""The reward service and its client (layer 3, stage 1).

Speech tokens -> waveform -> ASR -> pinyin error rate -> reward: the reward formula
(``rewards``), one utterance's score (``scoring``), the speech backends behind two small
interfaces (``backends``), the KServe-v2 / Triton wire protocol (``protocol``,
``triton_binary``), the HTTP server with its batching, guard and metrics, and the client
that verl's reward function and pair mining call (``client``, its pool of servers ``pool``,
``health``).

May import: ``ttsrl.model``, ``ttsrl.embedded`` (the ``sim`` backend decodes the simulated
codec) and the shared top-level modules. Never training or evaluation.
"""
