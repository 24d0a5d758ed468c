"""What a model family is: its speech vocabulary's layout, sampling rules and token2wav, as data.

A family is one :class:`Family`, defined in its own folder (``ttsrl/families/<name>/``) and
named in the registry (``ttsrl/families/__init__.py``). Everything else in ttsrl reads a
family's numbers from it: conversion, the HF and vLLM classes, the sampling rule, stage 0,
the reward protocol, test sets, pairs, token2wav and the input checks.

Standard library only: ``scripts/check_inputs.py`` reads families without the venv.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

PAD_MULTIPLE = 128  # embedding rows are padded to a multiple of this

# Qwen's own special tokens; CosyVoice-BlankEN (any Qwen2 tokenizer) already has them.
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: the two ways a family's LM keeps its input-only vectors (sos, task_id) in ``llm.pt``:
#: a 2-row ``llm_embedding`` (CosyVoice2), or rows of ``speech_embedding`` (CosyVoice3)
INPUT_EMBEDDINGS = ("llm_embedding", "speech_embedding")
#: the kinds of sampling rule the engine knows (``ttsrl.model.cosyvoice_lm.pick_token``)
RULE_KINDS = ("2026", "2024")


def speech_name(code: int) -> str:
    """The token name of speech code ``code`` (every family spells them so)."""
    return f"<|s_{code}|>"


@dataclass(frozen=True)
class Token2WavSpec:
    """A family's token2wav as CosyVoice's code reads it: the model folder's files, the model class
    of CosyVoice's code that runs them, where that code first has them, and ttsrl's backend class."""

    name: str  # "CosyVoice2"
    yaml: str  # the model folder's hyperpyyaml
    speech_tokenizer: str  # the model folder's speech tokenizer (ONNX)
    model_class: str  # in cosyvoice.cli.model
    release: str  # the released model folder
    #: what CosyVoice's code must have (a path under the checkout, a class it defines), and since when
    needs_code: tuple[tuple[str, str], ...] = ()
    since: str = ""
    batch_flow: bool = False  # the backend can run its flow over a padded batch
    #: the speaker model SIM is measured with: (column label, what the figure is)
    sim_model: tuple[str, str] = ("campplus", "mean over utterances of the cosine of the model folder's campplus "
                                              "speaker embeddings of the generated speech and its prompt")
    #: where the released folder is published (``python -m ttsrl.fetch`` downloads it): its Hugging Face
    #: model repository, its ModelScope id, and files of the release the recipe may use beside
    #: :attr:`model_dir_entries` (CosyVoice3's ``llm.rl.pt``: ``LLM_FILE=llm.rl.pt``)
    hub_repo: str = ""
    modelscope_repo: str = ""
    release_extras: tuple[str, ...] = ()
    #: "module:Class" of ttsrl's token2wav backend (a ttsrl.reward.backends.base.Token2Wav) and of its
    #: config, which is built with ``family=`` the family's name. The family declares data and the
    #: reward layer's engine reads it (as torchtune's model folders build on torchtune.modules): this
    #: layer may not import the reward layer, and every CosyVoice family shares one engine.
    backend: str = "ttsrl.reward.backends.cosyvoice:CosyVoiceToken2Wav"
    config: str = "ttsrl.reward.backends.cosyvoice:CosyVoiceConfig"

    @property
    def token2wav_files(self) -> tuple[str, ...]:
        """What token2wav loads from the model folder (the LLM's llm.pt and CosyVoice-BlankEN/ are not)."""
        return (self.yaml, "flow.pt", "hift.pt", "campplus.onnx", self.speech_tokenizer)

    @property
    def model_dir_entries(self) -> tuple[str, ...]:
        """What a released folder holds that the whole recipe (stage -1 included) needs."""
        return ("llm.pt",) + self.token2wav_files + ("CosyVoice-BlankEN/",)


@dataclass(frozen=True)
class Family:
    """Everything that differs between model families, as data.

    ``output_names`` names the LLM's non-speech output classes (index ``speech_token_size``
    on); ``input_names`` the input-only vectors appended after them in the HF vocabulary.
    ``sos_name``/``task_id_name`` are among the two. ``min_len_held``: output indices a rule
    of kind "2026" sets to -inf before the minimum length; ``stop_indices``: indices that end
    an utterance when drawn. ``rules``: the family's sampling rules, (name, kind), the first
    the default."""

    name: str
    speech_token_size: int
    num_outputs: int
    eos_index: int
    output_names: tuple[str, ...]
    input_names: tuple[str, ...]
    sos_name: str
    task_id_name: str
    head_bias: bool
    specials: tuple[str, ...]
    min_len_held: tuple[int, ...]
    rules: tuple[tuple[str, str], ...]
    system_prefix: str = ""  # text every LLM input starts with (CosyVoice3's instruction)
    token_rate_hz: float = 25.0  # speech tokens per second of audio
    sample_rate: int = 24000  # token2wav's output rate
    input_embedding: str = "llm_embedding"  # llm.pt tensor holding sos/task_id (INPUT_EMBEDDINGS)
    upstream_class: str = "Qwen2LM"  # the LM class of CosyVoice's code (cosyvoice/llm/llm.py)
    release: str = ""
    token2wav: Token2WavSpec | None = None
    stop_indices: tuple[int, ...] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "stop_indices", tuple(range(self.speech_token_size, self.num_outputs)))
        problems = []
        if len(self.output_names) != self.num_outputs - self.speech_token_size:
            problems.append(f"{len(self.output_names)} output names for {self.num_outputs - self.speech_token_size} "
                            "non-speech outputs")
        if self.input_embedding not in INPUT_EMBEDDINGS:
            problems.append(f"input_embedding {self.input_embedding!r} is not one of {INPUT_EMBEDDINGS}")
        if self.input_embedding == "llm_embedding" and len(self.input_names) != 2:
            problems.append("an llm_embedding family appends its two input vectors as input_names")
        if not self.rules or any(kind not in RULE_KINDS for _, kind in self.rules):
            problems.append(f"rules {self.rules!r}: one or more (name, kind), kind in {RULE_KINDS}")
        if not set(self.min_len_held) <= set(self.stop_indices) or self.eos_index not in self.stop_indices:
            problems.append("eos_index and min_len_held must be stop indices")
        if problems:
            raise ValueError(f"family {self.name}: " + "; ".join(problems))

    def __repr__(self) -> str:
        return f"Family({self.name!r})"

    @property
    def default_rule(self) -> str:
        return self.rules[0][0]

    @property
    def added_names(self) -> tuple[str, ...]:
        """The tokens appended after the text vocabulary, in id order."""
        return tuple(speech_name(i) for i in range(self.speech_token_size)) + self.output_names + self.input_names

    @property
    def eos_name(self) -> str:
        return self.output_names[self.eos_index - self.speech_token_size]

    def added_index(self, name: str) -> int:
        """Position of ``name`` among :attr:`added_names` (= HF id - speech offset)."""
        if name in self.output_names:
            return self.speech_token_size + self.output_names.index(name)
        return self.num_outputs + self.input_names.index(name)

    @property
    def sos_index(self) -> int:
        return self.added_index(self.sos_name)

    @property
    def task_id_index(self) -> int:
        return self.added_index(self.task_id_name)

    def input_rows(self) -> tuple[str, tuple[int, int]]:
        """Where ``llm.pt`` keeps (sos, task_id): the tensor and its two rows."""
        if self.input_embedding == "llm_embedding":
            return "llm_embedding.weight", (0, 1)
        return "speech_embedding.weight", (self.sos_index, self.task_id_index)

    def owns_state(self, state: Mapping[str, Any]) -> bool:
        """Whether an ``llm.pt`` state dict has this family's key signature: its input-vector
        tensor and a ``speech_embedding`` of its number of outputs."""
        rows = state.get("speech_embedding.weight")
        return (("llm_embedding.weight" in state) == (self.input_embedding == "llm_embedding")
                and rows is not None and int(rows.shape[0]) == self.num_outputs)

    def check_codes(self, codes, where: str = "") -> None:
        """Raise ValueError naming ``where`` unless every code is a speech code of this family."""
        n = self.speech_token_size
        bad = next((c for c in codes if not 0 <= int(c) < n), None)
        if bad is not None:
            raise ValueError(f"{where + ': ' if where else ''}speech code {bad} outside 0..{n - 1} ({self.name})")

    @property
    def chat_template(self) -> str:
        """User turn: sos + system prefix + text + task_id; assistant turn: its content
        verbatim (speech tokens). System turns carry nothing the model was trained on and
        are dropped."""
        return ("{%- for message in messages -%}"
                "{%- if message['role'] == 'user' -%}"
                "{{ '" + self.sos_name + self.system_prefix + "' + message['content'] + '" + self.task_id_name + "' }}"
                "{%- elif message['role'] == 'assistant' -%}"
                "{{ message['content'] }}"
                "{%- endif -%}"
                "{%- endfor -%}")
