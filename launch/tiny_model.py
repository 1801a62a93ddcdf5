"""Build the embedded tiny Llama checkpoint: a byte-level BPE tokenizer and deterministic weights.

Nothing is trained by gradient descent. The tokenizer is BPE-trained on ``data/corpus.txt``; the
embedding and LM head are a low-rank (SVD) fit of the corpus's smoothed bigram log-probabilities,
so the model continues text plausibly; the transformer layers are small seeded random weights
that perturb the residual stream a little. Deterministic for a given machine and library versions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

MODEL_NAME = "tiny-llama-v1"
CORPUS = Path(__file__).with_name("data") / "corpus.txt"
BOS, EOS, HEADER_START, HEADER_END, EOT = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
SPECIAL_TOKENS = (BOS, EOS, HEADER_START, HEADER_END, EOT)
VOCAB_SIZE = 1031
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 768, 4, 4, 2
MAX_POSITIONS, ROPE_THETA, RMS_EPS = 2048, 10000.0, 1e-5
SEED = 20240611
_BUILD_LOCK = threading.Lock()
LAYER_STD = 0.02
BIGRAM_ALPHA = 0.1
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)


def default_cache_root() -> Path:
    return Path(os.environ.get("HELIOS_CACHE") or Path.home() / ".cache" / "helios")


def ensure_tiny_model(cache_dir: str | Path | None = None) -> Path:
    """Return ``<cache root>/tiny-llama-v1``, building it atomically on first use.

    The root is ``cache_dir``, else ``$HELIOS_CACHE``, else ``~/.cache/helios``. Concurrent callers
    each build into a private temporary directory; the first rename wins.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / MODEL_NAME
    if _complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=root))
    try:
        build_tiny_model(staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not _complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not _complete(target):
        raise RuntimeError(f"incomplete tiny model at {target}; delete it and retry")
    return target


def _complete(path: Path) -> bool:
    return all((path / name).is_file() for name in FILES)


def build_tiny_model(out_dir: str | Path) -> None:
    """Write every checkpoint file into the existing directory ``out_dir``."""
    with _BUILD_LOCK:
        _build(Path(out_dir))


def _build(out: Path) -> None:
    text = CORPUS.read_text(encoding="utf-8")
    tokenizer = train_tokenizer(text)
    vocab = tokenizer.get_vocab_size()
    ids = {name: tokenizer.token_to_id(name) for name in SPECIAL_TOKENS}
    tensors = build_weights(corpus_ids(tokenizer, text), vocab, ids[BOS])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    eos_ids = [ids[EOS], ids[EOT]]
    _write_json(out / "config.json", model_config(vocab, ids[BOS], eos_ids))
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": ids[BOS], "eos_token_id": eos_ids, "pad_token_id": ids[EOS]},
    )
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": EOS,
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": MAX_POSITIONS,
            "clean_up_tokenization_spaces": False,
        },
    )


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def model_config(vocab: int, bos_id: int, eos_ids: list[int]) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        "initializer_range": LAYER_STD,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def train_tokenizer(text: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return tokenizer


def corpus_ids(tokenizer: Tokenizer, text: str) -> list[list[int]]:
    """One sequence per document (documents are separated by two blank lines), BOS ... EOS."""
    documents = [d.strip() for d in text.split("\n\n\n") if d.strip()]
    return [tokenizer.encode(d).ids + [tokenizer.token_to_id(EOS)] for d in documents]


def build_weights(sequences: list[list[int]], vocab: int, bos_id: int) -> dict[str, torch.Tensor]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        embed, head = _bigram_factors(sequences, vocab, bos_id)
        gen = torch.Generator().manual_seed(SEED)
        tensors = {
            "model.embed_tokens.weight": embed,
            "lm_head.weight": head,
            "model.norm.weight": torch.ones(HIDDEN),
        }
        head_dim = HIDDEN // HEADS
        out_std = LAYER_STD / math.sqrt(2 * LAYERS)
        shapes = {
            "self_attn.q_proj.weight": ((HEADS * head_dim, HIDDEN), LAYER_STD),
            "self_attn.k_proj.weight": ((KV_HEADS * head_dim, HIDDEN), LAYER_STD),
            "self_attn.v_proj.weight": ((KV_HEADS * head_dim, HIDDEN), LAYER_STD),
            "self_attn.o_proj.weight": ((HIDDEN, HEADS * head_dim), out_std),
            "mlp.gate_proj.weight": ((INTERMEDIATE, HIDDEN), LAYER_STD),
            "mlp.up_proj.weight": ((INTERMEDIATE, HIDDEN), LAYER_STD),
            "mlp.down_proj.weight": ((HIDDEN, INTERMEDIATE), out_std),
        }
        for layer in range(LAYERS):
            prefix = f"model.layers.{layer}."
            tensors[prefix + "input_layernorm.weight"] = torch.ones(HIDDEN)
            tensors[prefix + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
            for name, (shape, std) in shapes.items():
                tensors[prefix + name] = torch.randn(shape, generator=gen) * std
    finally:
        torch.set_num_threads(threads)
    return {name: t.to(torch.float32).contiguous() for name, t in tensors.items()}


def _bigram_factors(
    sequences: list[list[int]], vocab: int, bos_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embedding/head whose product is the centred log-bigram table (rank HIDDEN - 1).

    Every embedding row gets the same norm (a filler coordinate), so the RMSNorms leave the
    product unchanged: ``head @ norm(embed[x]) ~ log P(next | x)`` up to a per-row constant.
    """
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    unigram = torch.ones(vocab, dtype=torch.float64)
    for ids in sequences:
        seq = torch.tensor(ids)
        counts.index_put_((seq[:-1], seq[1:]), torch.ones(len(ids) - 1, dtype=torch.float64), True)
        unigram.index_add_(0, seq, torch.ones(len(ids), dtype=torch.float64))
    unigram[bos_id] = 0.5
    unigram = unigram / unigram.sum()
    table = torch.log(counts + BIGRAM_ALPHA * unigram) - torch.log(
        counts.sum(dim=1, keepdim=True) + BIGRAM_ALPHA
    )
    table = table - table.mean(dim=1, keepdim=True)
    u, s, vh = torch.linalg.svd(table, full_matrices=False)
    rank = HIDDEN - 1
    left = u[:, :rank] * s[:rank]
    right = vh[:rank].t()
    norms = left.norm(dim=1)
    radius = float(norms.max())
    filler = (radius**2 - norms**2).clamp_min(0).sqrt().unsqueeze(1)
    scale = math.sqrt(HIDDEN) / radius
    embed = torch.cat([left, filler], dim=1) * scale
    head = torch.cat([right, torch.zeros(vocab, 1, dtype=torch.float64)], dim=1) / scale
    return embed.float(), head.float()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build (once) and print the tiny model path.")
    parser.add_argument("--cache-dir", default=None, help="cache root (default: $HELIOS_CACHE)")
    args = parser.parse_args(argv)
    print(ensure_tiny_model(args.cache_dir))


if __name__ == "__main__":
    main()
