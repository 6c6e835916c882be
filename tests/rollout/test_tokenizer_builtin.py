"""The built-in character tokenizer and the ``build_tokenizer`` factory."""

import string

import pytest

from megatron_cascade.config import ModelConfig
from megatron_cascade.tokenizers import CharTokenizer, Tokenizer, build_tokenizer


def test_round_trip_and_sizes():
    tok = build_tokenizer("builtin:char")
    assert isinstance(tok, CharTokenizer) and isinstance(tok, Tokenizer)
    text = string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", "")
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size < 128
    assert ModelConfig(vocab_size=tok.vocab_size).padded_vocab_size == 128
    assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
    assert all(0 <= i < tok.vocab_size for i in tok.encode(text))


def test_special_strings_are_plain_text_and_unknown_characters_raise():
    tok = CharTokenizer()
    assert tok.encode("<eos>") == tok.encode("<") + tok.encode("eos") + tok.encode(">")
    with pytest.raises(ValueError, match="not in the builtin:char vocabulary"):
        tok.encode("café")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([tok.vocab_size])


def test_chat_template():
    tok = CharTokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    expected = ([tok.bos_id, tok.role_id("system")] + tok.encode("Be brief.") + [tok.eos_id, tok.role_id("user")]
                + tok.encode("Hi") + [tok.eos_id, tok.role_id("assistant")])
    assert ids == expected
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected[:-1]
    assert tok.decode(ids) == "Be brief.Hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos><|system|>Be brief.<eos><|user|>Hi<eos><|assistant|>"
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_fingerprint_and_factory_errors():
    assert CharTokenizer().fingerprint() == build_tokenizer("builtin:char").fingerprint()
    assert len(CharTokenizer().fingerprint()) == 64
    with pytest.raises(ValueError, match="unknown builtin"):
        build_tokenizer("builtin:bpe")
    with pytest.raises(FileNotFoundError):
        build_tokenizer("/nonexistent/tokenizer/dir")
