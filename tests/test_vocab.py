"""Speech-token vocabulary: exact ids on a tokenizer of the real Qwen2 size, and the
chat template on a tiny one."""

import pytest
from tokenizers import Tokenizer, models

from ttsrl.model import vocab as V


@pytest.fixture(scope="module")
def qwen_sized_tokenizer():
    """Exactly Qwen2's size: 151643 regular entries + its 3 specials (synthetic entries)."""
    from ttsrl.embedded.tiny_tokenizer import qwen_sized_tokenizer

    return qwen_sized_tokenizer()


def test_real_ids(qwen_sized_tokenizer):
    sv = V.extend_tokenizer(qwen_sized_tokenizer, "cosyvoice2")
    tok = qwen_sized_tokenizer
    assert tok.convert_tokens_to_ids("<|endofprompt|>") == 151646
    assert tok.convert_tokens_to_ids("[mn]") == 151662
    assert sv.speech_offset == 151663
    assert tok.convert_tokens_to_ids("<|s_0|>") == 151663
    assert tok.convert_tokens_to_ids("<|s_6560|>") == 158223
    assert [sv.eos_id] + sv.stop_ids == [158224, 158224, 158225, 158226]
    assert tok.convert_tokens_to_ids(["<|eos1|>", "<|eos2|>", "<|eos3|>"]) == [158224, 158225, 158226]
    assert (sv.sos_id, sv.task_id) == (158227, 158228)
    assert tok.convert_tokens_to_ids(["<|sos|>", "<|task_id|>"]) == [158227, 158228]
    assert len(tok) == sv.tokenizer_size == 158229
    assert sv.padded_vocab_size == 158336
    assert sv.output_range == (151663, 158227)
    # idempotent: a second pass keeps every id
    assert V.extend_tokenizer(tok, "cosyvoice2") == sv


def test_index_maps():
    sv = V.SpeechVocab(1000, V.family("cosyvoice2"))
    assert sv.to_hf(0) == 1000 and sv.to_index(1000 + 6563) == 6563
    with pytest.raises(ValueError):
        sv.to_hf(V.family("cosyvoice2").num_outputs)
    with pytest.raises(ValueError):
        sv.to_index(999)
    ids = sv.codes_to_ids([0, 5, 6560]) + [sv.eos_id, sv.to_hf(7)]
    assert sv.speech_ids_to_codes(ids) == [0, 5, 6560]
    with pytest.raises(ValueError):
        sv.speech_ids_to_codes([sv.sos_id])
    assert V.parse_speech_text("<|s_12|>x<|s_7|><|eos1|>") == [12, 7]
    with pytest.raises(ValueError):
        V.parse_speech_text("<|s_6561|>")
    assert V.SpeechVocab.codes_to_text([3, 4]) == "<|s_3|><|s_4|>"


def test_chat_template_renders_cosyvoice_layout(tiny_hf):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_hf)
    sv = V.vocab_of(tok)
    text = "今天天气很好"
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                     tokenize=False)
    assert prompt == "<|sos|>今天天气很好<|task_id|>"
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids == [sv.sos_id] + tok.encode(text, add_special_tokens=False) + [sv.task_id]
    convo = [{"role": "system", "content": "ignored"}, {"role": "user", "content": text},
             {"role": "assistant", "content": V.SpeechVocab.codes_to_text([1, 6560]) + "<|eos1|>"}]
    ids = tok(tok.apply_chat_template(convo, tokenize=False), add_special_tokens=False)["input_ids"]
    assert ids[-3:] == [sv.to_hf(1), sv.to_hf(6560), sv.eos_id]
    assert "\n" not in prompt and len(tok.encode("\n", add_special_tokens=False)) == 1


def test_partial_specials_rejected(qwen_sized_tokenizer):
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    with pytest.raises(ValueError, match="Qwen special token"):
        V.extend_tokenizer(fast, "cosyvoice2")
