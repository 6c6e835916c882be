"""A Hugging Face tokenizer built and saved by the test itself, loaded offline through the factory."""

import pytest

from megatron_cascade.tokenizers import CharTokenizer, HFTokenizer, Tokenizer, build_tokenizer

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = ["hello", "world", "what", "is", "two", "plus", "?", "!"]


def _save_tokenizer(path, words, chat_template=CHAT_TEMPLATE):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    raw = RawTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", additional_special_tokens=specials[4:])
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _save_tokenizer(tmp_path_factory.mktemp("hf_tok"), WORDS)


def test_loads_offline_with_interface(hf_dir):
    tok = build_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.vocab_size == 7 + len(WORDS)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    ids = tok.encode("hello world!")
    assert ids == [7, 8, 14]
    # WordLevel has no decoder: tokens come back joined by spaces.
    assert tok.decode(ids) == "hello world !"
    assert tok.decode([tok.bos_id] + ids, skip_special_tokens=False) == "<s> hello world !"


def test_chat_template(hf_dir):
    tok = build_tokenizer(hf_dir)
    messages = [{"role": "user", "content": "what is two plus two ?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    user, assistant = tok.encode("<|user|>"), tok.encode("<|assistant|>")
    assert len(user) == 1 and len(assistant) == 1
    assert ids == user + tok.encode("what is two plus two ?") + [tok.eos_id] + assistant
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == ids[:-1]


def test_fingerprint_differs_between_vocabularies(hf_dir, tmp_path):
    same = _save_tokenizer(tmp_path / "same", WORDS)
    other = _save_tokenizer(tmp_path / "other", WORDS[:-1] + ["?!"])
    fp = build_tokenizer(hf_dir).fingerprint()
    assert fp == build_tokenizer(same).fingerprint()
    assert fp != build_tokenizer(other).fingerprint()
    assert fp != CharTokenizer().fingerprint()


def test_missing_chat_template(tmp_path):
    tok = build_tokenizer(_save_tokenizer(tmp_path / "plain", WORDS, chat_template=None))
    with pytest.raises(ValueError, match="chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hello"}])
