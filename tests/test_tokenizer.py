"""Tokenizer agrees with transformers; the incremental detokenizer streams exact text."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.text.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "",
    " ",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "Café naïve résumé Straße",
    "你好，世界！機械学習 한국어",
    "Emoji 😀👍🏽 🧑‍🚀 🦩 ❤️",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ＡＢＣ ﬁ Ω ∑∫√",
    "def f(x):\n    return {'a': x * 2}  # comment",
    "<|im_start|>user\nhi<|im_end|>",
    "1234567890 3.14159 -42",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Tell me more\n  please."},
    ],
    [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "sunny"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city – ünïcode",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_tok(tiny_model_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def test_module_does_not_import_torch() -> None:
    code = "import sys, kvrelay.text.tokenizer; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_special_ids_and_vocab(tok: Tokenizer, hf_tok) -> None:
    assert tok.vocab_size == len(hf_tok) == 2048
    assert tok.bos_token_id == hf_tok.bos_token_id == 0
    assert tok.pad_token_id == hf_tok.pad_token_id == 1
    assert tok.eos_token_ids == frozenset({1, 3})
    assert tok.all_special_ids == frozenset({0, 1, 2, 3})
    assert tok.convert_ids_to_tokens([2, 3]) == ["<|im_start|>", "<|im_end|>"]
    assert tok.convert_ids_to_tokens(0) == "<|begin_of_text|>"
    assert tok.token_to_id("<|im_end|>") == 3
    with pytest.raises(TokenizerError, match="4096"):
        tok.convert_ids_to_tokens([4096])


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(
        text, add_special_tokens=False
    )
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)
    if "<|" not in text:
        assert tok.decode(ids) == text


def test_encode_without_offsets_gives_encodes_ids(tok: Tokenizer) -> None:
    """The router's tokenizer process encodes without offsets: the same ids, every text and a
    long one (past the 256k characters that go to that process), with and without specials."""
    long_text = " ".join(TEXTS) * (300_000 // len(" ".join(TEXTS)) + 1)
    for text in [*TEXTS, long_text]:
        for special in (True, False):
            want = tok.encode(text, add_special_tokens=special)
            assert tok.encode_without_offsets(text, add_special_tokens=special) == want


def test_every_byte_is_encodable(tok: Tokenizer) -> None:
    text = bytes(range(1, 128)).decode() + "".join(chr(c) for c in range(0x80, 0x800, 7))
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok, messages: list[dict], add_generation_prompt: bool
) -> None:
    for tools in (None, TOOLS):
        ours = tok.apply_chat_template(messages, add_generation_prompt, tools=tools)
        theirs = hf_tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == theirs
    ids = hf_tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )["input_ids"]
    assert tok.encode_chat(messages, add_generation_prompt) == ids
    assert ids.count(tok.bos_token_id) == 1  # the template's bos, none added on top


def test_chat_generation_prompt_and_list_content(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    rendered = tok.apply_chat_template([{"role": "user", "content": parts}])
    assert rendered == (
        "<|begin_of_text|><|im_start|>user\nfirst\nsecond<|im_end|>\n<|im_start|>assistant\n"
    )
    joined = tok.apply_chat_template([{"role": "user", "content": "first\nsecond"}])
    assert rendered == joined


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], "come first"),
        ([{"role": "wizard", "content": "x"}], "unknown role: wizard"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url"),
        ([{"role": "user", "content": 7}], "content must be"),
        (["not a dict"], "must be an object"),
    ],
)
def test_chat_errors_are_tokenizer_errors(tok: Tokenizer, messages: list, message: str) -> None:
    with pytest.raises(TokenizerError, match=message):
        tok.apply_chat_template(messages)


def test_kwargs_reach_the_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    template = "{{ bos_token }}{{ greeting }}{{ strftime_now('%Y') | length }}{{ [1] | tojson }}"
    (tmp_path / "chat_template.jinja").write_text(template)
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.apply_chat_template([], greeting="hé") == "<|begin_of_text|>hé4[1]"


def test_chat_template_jinja_wins_over_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "from-config"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template([]) == "from-config"
    (tmp_path / "chat_template.jinja").write_text("from-file")
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template([]) == "from-file"


def test_tokenizer_json_decides_bos_as_in_transformers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    shutil.copy(tiny_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config.update(add_bos_token=False, add_eos_token=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_pretrained(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.encode("hi there") == theirs.encode("hi there")
    assert ours.encode("hi there")[0] == 0 and ours.encode("hi there")[-1] != 1


def test_missing_files_and_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        Tokenizer.from_pretrained(tmp_path)
    shutil.copy(tiny_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    bare = Tokenizer.from_pretrained(tmp_path)
    assert bare.bos_token_id is None and bare.eos_token_ids == frozenset()
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(TokenizerError, match="does not compile"):
        Tokenizer.from_pretrained(tmp_path).apply_chat_template([])


# ---- incremental detokenizer ---------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int], **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, tok.encode("The answer is"), **kwargs)
    deltas, start = [], 0
    for size in chunks:
        deltas.append(detok.step(ids[start : start + size]))
        start += size
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("text", TEXTS[4:])
def test_one_token_at_a_time_never_breaks_a_character(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _stream(tok, ids, [1] * len(ids), skip_special_tokens=False)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=False)
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[-1] == ""  # nothing was left for flush


def test_multibyte_characters_are_held_then_emitted_whole(tok: Tokenizer) -> None:
    text = "x🦩鑫𝔘"  # rare characters: split over several byte tokens each
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) >= 10
    deltas = _stream(tok, ids, [1] * len(ids))
    assert [d for d in deltas if d] == ["x", "🦩", "鑫", "𝔘"]


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>hi 😀<|im_end|>", add_special_tokens=True)
    assert "".join(_stream(tok, ids, [1] * len(ids))) == "hi 😀"
    kept = "".join(_stream(tok, ids, [1] * len(ids), skip_special_tokens=False))
    assert kept == "<|begin_of_text|><|im_start|>hi 😀<|im_end|>"


def test_random_tokens_in_random_chunks_equal_decode(tok: Tokenizer) -> None:
    rng = random.Random(0)
    byte_tokens = [i for i in range(tok.vocab_size) if len(tok.convert_ids_to_tokens(i)) == 1]
    for trial in range(200):
        pool = byte_tokens if trial % 2 else range(tok.vocab_size)
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 50))]
        chunks = [rng.randint(1, 4) for _ in ids]
        skip = trial % 3 != 0
        deltas = _stream(tok, ids, chunks, skip_special_tokens=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), ids


def test_incomplete_tail_waits_for_flush(tok: Tokenizer) -> None:
    ids = tok.encode("ab😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    assert detok.step(ids[:-1]) == "ab"
    assert detok.flush() == "\ufffd"
    assert detok.text == "ab\ufffd" == tok.decode(ids[:-1])
    assert detok.step([]) == ""
