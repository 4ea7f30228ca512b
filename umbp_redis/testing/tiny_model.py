"""Build a tiny random Llama checkpoint and tokenizer on local disk.

No model can be downloaded in tests, CI or the CPU demo, so this module writes a
complete Hugging Face model directory (config, random weights, tokenizer) that vLLM
loads like any other checkpoint. CPU attention needs ``head_dim >= 64``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_WORDS = (
    "the cache stores blocks of keys and values so engines skip recomputing long shared "
    "prompt prefixes redis keeps each object with a ttl and evicts the least recently "
    "used ones when memory runs out every worker writes its own rank local keys"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny Llama; the defaults start a vLLM CPU engine in seconds."""

    hidden_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 2
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    seed: int = 1234

    @property
    def head_dim(self) -> int:
        """Per-head width (hidden size over attention heads)."""
        return self.hidden_size // self.num_attention_heads


# A random Llama whose engines are prefill-bound on a CPU core (fp32: an object of one
# 128-token block, every layer, is 2 MiB): the benchmarks' model.
PREFILL_BOUND_SPEC = TinyModelSpec(
    hidden_size=1024,
    num_layers=8,
    num_attention_heads=16,
    num_kv_heads=4,
    intermediate_size=2816,
    max_position_embeddings=4096,
)


def _train_tokenizer(vocab_size: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [" ".join(_WORDS[i:] + _WORDS[:i]) for i in range(len(_WORDS))]
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    return tok


def build_tiny_llama(directory: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a random tiny Llama and its tokenizer into ``directory`` and return it.

    The result is deterministic for a given ``spec`` (weights come from ``spec.seed``).
    An existing complete directory is reused as it is.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    spec = spec or TinyModelSpec()
    out = Path(directory)
    marker = out / "umbp_tiny_model.json"
    wanted = json.dumps(spec.__dict__, sort_keys=True)
    if marker.exists() and marker.read_text() == wanted:
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(spec.vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=max(spec.vocab_size, len(fast)),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(dtype=torch.bfloat16)  # type: ignore[call-arg,arg-type]
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(wanted)
    return out


def sample_prompts(
    count: int, words: int, seed: int = 0, shared_prefix_words: int = 0
) -> list[str]:
    """Deterministic prompts of ``words`` words; the first ``shared_prefix_words`` are shared."""
    import random

    rng = random.Random(seed)
    prefix = [rng.choice(_WORDS) for _ in range(shared_prefix_words)]
    prompts = []
    for _ in range(count):
        tail = [rng.choice(_WORDS) for _ in range(max(0, words - shared_prefix_words))]
        prompts.append(" ".join(prefix + tail))
    return prompts
