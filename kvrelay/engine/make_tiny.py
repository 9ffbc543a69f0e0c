"""Random-initialised checkpoints in Hugging Face format, for tests and benchmarks.

``make_tiny(dir, arch, size)`` writes ``config.json``, ``model.safetensors``,
``tokenizer.json`` (a byte-level BPE trained here, in about a second, on a corpus built here),
``tokenizer_config.json``, ``chat_template.jinja`` (ChatML) and ``generation_config.json``, as
transformers 5 would for ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM``.
The same arguments give the same bytes. Qwen2 ties the output head to the embedding and has
q/k/v biases; Llama and Mistral have a separate ``lm_head`` and no biases.

``make_classifier(src, dir, labels)`` turns a causal LM checkpoint (a tiny one, or a real one)
into a ``*ForSequenceClassification`` of the same decoder with a random ``score`` head: a
reranker or classifier of the right shape for tests and benchmarks, not a trained one.

======  =====  ======  ======  =====  ========  =====  ============  ============  ============
size    vocab  hidden  layers  heads  kv heads  inter  llama         mistral       qwen2
======  =====  ======  ======  =====  ========  =====  ============  ============  ============
tiny    2048   128     4       4      2         768    1,901,696     1,901,696     1,640,576
small   8192   512     8       8      4         1536   33,563,136    33,563,136    29,377,024
medium  16384  768     12      12     4         2304   107,760,384   107,760,384   95,192,832
======  =====  ======  ======  =====  ========  =====  ============  ============  ============

Token ids: 0 ``<|begin_of_text|>`` (bos, added by the tokenizer), 1 ``<|end_of_text|>`` (eos, pad),
2 ``<|im_start|>``, 3 ``<|im_end|>`` (end of a chat turn, an eos in generation_config.json).
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvrelay.engine.config import DTYPES, ConfigError
from kvrelay.engine.identity import IDENTITY_FILE, record_identity, weight_files

logger = logging.getLogger(__name__)

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)  # ids 0..3
MAX_POSITION_EMBEDDINGS = 4096
TRANSFORMERS_VERSION = "5.0.0"  # written into the json files, as transformers does
INIT_STD = 0.02  # std of matrices and biases
NORM_NOISE_STD = 0.05  # norm weights are 1 + this noise, so swapped norms are caught

CHAT_TEMPLATE = """\
{%- macro render_content(content) %}
{%- if content is string %}{{- content }}
{%- elif content is iterable %}
{{- content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('\\n') }}
{%- endif %}
{%- endmacro %}
{{- bos_token }}
{%- set has_system = messages and messages[0]['role'] == 'system' %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if has_system %}{{- render_content(messages[0]['content']) + '\\n\\n' }}{%- endif %}
{{- 'You can call these tools:' }}
{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif has_system %}
{{- '<|im_start|>system\\n' + render_content(messages[0]['content']) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}
{%- if not loop.first %}{{- raise_exception('a system message must come first') }}{%- endif %}
{%- elif message['role'] in ['user', 'assistant', 'tool'] %}
{{- '<|im_start|>' + message['role'] + '\\n' + render_content(message['content']) }}
{%- if message['tool_calls'] is defined %}{{- '\\n' + message['tool_calls'] | tojson }}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- raise_exception('unknown role: ' + message['role']) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


@dataclass(frozen=True, slots=True)
class ModelShape:
    vocab_size: int  # tokenizer vocabulary = embedding rows
    hidden_size: int  # model width
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads
    intermediate_size: int  # MLP width

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SIZES = {
    "tiny": ModelShape(2048, 128, 4, 4, 2, 768),
    "small": ModelShape(8192, 512, 8, 8, 4, 1536),
    "medium": ModelShape(16384, 768, 12, 12, 4, 2304),
}
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_tiny(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Writes a random-initialised checkpoint into ``out_dir`` (created if needed).

    Args:
        out_dir: directory to write; existing files of the same names are replaced.
        arch: ``llama``, ``qwen2`` or ``mistral``.
        size: ``tiny``, ``small`` or ``medium`` (see the module docstring).
        seed: seed of the weights; the tokenizer depends only on the vocabulary size.
        dtype: ``float32``, ``bfloat16`` or ``float16`` (weights are drawn in float32, then cast).

    Returns:
        The checkpoint directory.

    Raises:
        ConfigError: an unknown arch, size or dtype.
    """
    shape = _validate(arch, size, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", _model_config(arch, shape, dtype))
    tensors = {
        name: t.to(_TORCH_DTYPES[dtype]) for name, t in _init_weights(arch, shape, seed).items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _train_tokenizer(shape.vocab_size).save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    _write_json(out / "generation_config.json", _generation_config())
    record_identity(out, dtype)  # last: it covers the files above
    logger.info("wrote %s %s checkpoint (%s, seed %d) to %s", size, arch, dtype, seed, out)
    return out


def expected_param_count(arch: str, size: str) -> int:
    """Parameters of a ``make_tiny`` checkpoint, computed from its shape."""
    shape = _validate(arch, size, "float32")
    hidden, kv_dim = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    attention = 2 * hidden * hidden + 2 * hidden * kv_dim
    if arch == "qwen2":
        attention += hidden + 2 * kv_dim
    mlp = 3 * hidden * shape.intermediate_size
    per_layer = attention + mlp + 2 * hidden
    embeddings = shape.vocab_size * hidden * (1 if arch == "qwen2" else 2)
    return embeddings + shape.num_layers * per_layer + hidden


def param_count(model_dir: str | Path) -> int:
    """Parameters stored in ``model_dir/model.safetensors`` (reads only the header)."""
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118


def _validate(arch: str, size: str, dtype: str) -> ModelShape:
    if arch not in ARCHS:
        raise ConfigError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ConfigError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return SIZES[size]


# ---- config files --------------------------------------------------------------------------


def _model_config(arch: str, shape: ModelShape, dtype: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [ARCHS[arch]],
        "model_type": arch,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": None,
        "dtype": dtype,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": INIT_STD,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "num_attention_heads": shape.num_heads,
        "num_hidden_layers": shape.num_layers,
        "num_key_value_heads": shape.num_kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": arch == "qwen2",
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": shape.vocab_size,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if arch in ("llama", "mistral"):
        config["head_dim"] = shape.head_dim
    if arch == "mistral":
        config["sliding_window"] = MAX_POSITION_EMBEDDINGS
    if arch == "qwen2":
        config.update(
            layer_types=["full_attention"] * shape.num_layers,
            max_window_layers=shape.num_layers,
            sliding_window=None,
            use_sliding_window=False,
        )
    return config


def _tokenizer_config() -> dict[str, Any]:
    return {
        "bos_token": BOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "pad_token": EOS_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": [SPECIAL_TOKENS.index(EOS_TOKEN), SPECIAL_TOKENS.index(IM_END_TOKEN)],
        "transformers_version": TRANSFORMERS_VERSION,
    }


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ---- weights -------------------------------------------------------------------------------


def _weight_shapes(arch: str, shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes, in the order they are drawn from the generator."""
    hidden, kv_dim = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, hidden)}
    for i in range(shape.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        shapes[f"{attn}.q_proj.weight"] = (hidden, hidden)
        shapes[f"{attn}.k_proj.weight"] = (kv_dim, hidden)
        shapes[f"{attn}.v_proj.weight"] = (kv_dim, hidden)
        if arch == "qwen2":
            shapes[f"{attn}.q_proj.bias"] = (hidden,)
            shapes[f"{attn}.k_proj.bias"] = (kv_dim,)
            shapes[f"{attn}.v_proj.bias"] = (kv_dim,)
        shapes[f"{attn}.o_proj.weight"] = (hidden, hidden)
        shapes[f"{mlp}.gate_proj.weight"] = (shape.intermediate_size, hidden)
        shapes[f"{mlp}.up_proj.weight"] = (shape.intermediate_size, hidden)
        shapes[f"{mlp}.down_proj.weight"] = (hidden, shape.intermediate_size)
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (hidden,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if arch != "qwen2":
        shapes["lm_head.weight"] = (shape.vocab_size, hidden)
    return shapes


def _init_weights(arch: str, shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, dims in _weight_shapes(arch, shape).items():
        tensor = torch.empty(dims, dtype=torch.float32)
        if "norm" in name:
            tensor.normal_(1.0, NORM_NOISE_STD, generator=generator)
        else:
            tensor.normal_(0.0, INIT_STD, generator=generator)
        tensors[name] = tensor
    return tensors


# ---- tokenizer -----------------------------------------------------------------------------


def _train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE with exactly ``vocab_size`` ids, special tokens first."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _build_corpus(vocab_size)
    tokenizer.train_from_iterator(corpus, trainer, length=len(corpus))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, SPECIAL_TOKENS.index(BOS_TOKEN))],
    )
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"trained {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}: corpus too small"
        )
    return tokenizer


_ENGLISH = """\
The router reads each request, applies the chat template and turns the text into tokens. \
It then asks which prefill worker already holds most of the prompt in its cache, and which \
decode worker has the most free memory. The prefill worker computes the keys and values of \
every prompt token, samples the first token of the answer and sends it back at once, so the \
user sees the first word quickly. The decode worker pulls the cached keys and values, checks \
that they arrived intact, and then produces one token after another until the answer is \
complete. When a worker is busy, new requests wait in a queue; when the queue grows too long, \
the autoscaler starts another worker, which attaches to the shared weights in a few \
milliseconds instead of reading them from the disk again.
Once upon a time there was a small village at the edge of a great forest. The people who lived \
there were farmers and weavers, and every morning they walked to the river to fetch water. \
One day a traveller arrived with a map, a lantern and a book of stories. She asked the children \
what they wanted to learn, and they said: everything! So she taught them numbers, letters, \
the names of the stars, and how to build a bridge over the water.
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve a model.")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    for index, value in enumerate(range(10)):
        print(f"{index}: {value * 2}")
    return 0
{"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
"""
_MULTILINGUAL = """\
Café, naïve, résumé, façade, jalapeño, Straße, Ærø, smörgåsbord, crème brûlée.
你好，世界！今天天气很好，我们一起去公园散步吧。机器学习模型需要大量的数据。
こんにちは、世界。今日はいい天気ですね。東京の桜はとても美しいです。
안녕하세요, 세계! 오늘은 날씨가 좋습니다.
Привет, мир! Сегодня хорошая погода. Γειά σου κόσμε! مرحبا بالعالم. שלום עולם. नमस्ते दुनिया
Emoji: 😀 😃 😄 🎉 🚀 👍 ❤️ 🔥 ✨ 🤖 🌍 🍕 ∑ ∫ √ π ≈ ≠ ≤ ≥ → ← ★ ♪ € £ ¥ © ®
"""
_ONSETS = (
    *("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w"),
    *("st", "tr", "pl", "ch", "sh", "th", "br", "gr", "qu"),
)
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "io", "ou", "y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "nd", "ng", "rt", "st", "x")
_CORPUS_SEED = 20240611
_SEPARATORS = (" ",) * 14 + (", ", ". ", "\n", "\n    ", "(", ") ", ": ", "_", ".")
_WORDS_PER_VOCAB_ENTRY = 16  # synthetic words per vocabulary entry: enough pairs to reach it
_PIECE_CHARS = 2000  # corpus strings handed to the trainer


def _build_corpus(vocab_size: int) -> list[str]:
    """Embedded English, code and multilingual text, plus seeded synthetic sentences.

    Everything is built from constants and a fixed-seed ``random.Random``, so the corpus, and
    the trained tokenizer, are the same on every machine and Python version.
    """
    rng = random.Random(_CORPUS_SEED)
    real_words = re.findall(r"[A-Za-z]+", _ENGLISH)
    syllables = [o + v + c for o in _ONSETS for v in _VOWELS for c in _CODAS]
    parts = []
    for _ in range(_WORDS_PER_VOCAB_ENTRY * vocab_size):
        parts.append(_synthetic_word(rng, real_words, syllables))
        parts.append(rng.choice(_SEPARATORS))
    synthetic = "".join(parts)
    pieces = [synthetic[i : i + _PIECE_CHARS] for i in range(0, len(synthetic), _PIECE_CHARS)]
    return [_ENGLISH, _MULTILINGUAL] * max(1, vocab_size // 256) + pieces


def _synthetic_word(rng: random.Random, real_words: list[str], syllables: list[str]) -> str:
    """A real word (45%), a number (5%) or a pseudo-word of Zipf-distributed syllables."""
    roll = rng.random()
    if roll < 0.45:
        return rng.choice(real_words)
    if roll < 0.5:
        return str(rng.randrange(10 ** rng.randint(1, 5)))
    num_syllables = 1 + min(int(rng.expovariate(0.8)), 4)
    ranks = [min(int(rng.expovariate(1 / 60)), len(syllables) - 1) for _ in range(num_syllables)]
    return "".join(syllables[r] for r in ranks)


def make_classifier(
    src_dir: str | Path, out_dir: str | Path, labels: tuple[str, ...] = ("LABEL_0",), seed: int = 0
) -> Path:
    """Writes ``src_dir``'s decoder with a random ``score`` head of ``len(labels)`` rows as a
    ``*ForSequenceClassification`` checkpoint into ``out_dir`` (one label: a cross-encoder,
    whose sigmoid is a pair's relevance). The tokenizer files are copied; the LM head, if
    any, is dropped. The same arguments give the same bytes."""
    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    arch = str((config.get("architectures") or [""])[0])
    if not arch.endswith("ForCausalLM"):
        raise ConfigError(f"{src}: make_classifier needs a *ForCausalLM checkpoint, got {arch!r}")
    skip = {"config.json", "model.safetensors.index.json", IDENTITY_FILE}
    for path in src.iterdir():
        if (
            path.is_file()
            and path.name not in skip
            and not path.name.startswith("kvrelay")
            and (not path.name.endswith(".safetensors"))
        ):
            shutil.copyfile(path, out / path.name)
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(src):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name != "lm_head.weight":
                    tensors[name] = f.get_tensor(name)
    embed = tensors["model.embed_tokens.weight"]
    gen = torch.Generator().manual_seed(seed)
    head = torch.randn(len(labels), embed.shape[1], generator=gen) * 0.02
    tensors["score.weight"] = head.to(embed.dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["architectures"] = [arch.replace("ForCausalLM", "ForSequenceClassification")]
    config["id2label"] = {str(i): label for i, label in enumerate(labels)}
    config["label2id"] = {label: i for i, label in enumerate(labels)}
    config.pop("tie_word_embeddings", None)
    _write_json(out / "config.json", config)
    record_identity(out)
    logger.info("wrote a %d-label classifier of %s to %s", len(labels), src, out)
    return out
