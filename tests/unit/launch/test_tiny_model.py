from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from helios_logprobs.launch.tiny_model import CORPUS, FILES, MODEL_NAME, ensure_tiny_model
from helios_logprobs.ranks.model import ModelConfig, ShardedCausalLM

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"))


def test_build_is_deterministic_across_processes(tiny: Path, tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-m", "helios_logprobs.launch.tiny_model", "--cache-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    other = Path(result.stdout.strip())
    assert other == tmp_path / MODEL_NAME
    assert sorted(p.name for p in other.iterdir()) == sorted(FILES)
    for name in FILES:
        assert (other / name).read_bytes() == (tiny / name).read_bytes(), name


def test_ensure_reuses_and_survives_concurrent_builders(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    stamp = (tiny / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tiny.parent) == tiny
    assert (tiny / "model.safetensors").stat().st_mtime_ns == stamp
    monkeypatch.setenv("HELIOS_CACHE", str(tmp_path))
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: ensure_tiny_model(), range(2)))
    assert paths == [tmp_path / MODEL_NAME] * 2
    assert [p.name for p in tmp_path.iterdir()] == [MODEL_NAME]
    for name in FILES:
        assert (paths[0] / name).read_bytes() == (tiny / name).read_bytes(), name


def test_config_and_generation_files(tiny: Path):
    config = ModelConfig.from_model_dir(tiny)
    assert config.architecture == "llama"
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (1031, 256, 4)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == config.vocab_size
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    eos = [tokenizer.token_to_id(t) for t in ("<|end_of_text|>", "<|eot_id|>")]
    assert config.bos_token_id == bos and list(config.eos_token_ids) == eos
    generation = json.loads((tiny / "generation_config.json").read_text())
    assert generation["eos_token_id"] == eos
    assert tokenizer.encode("Hello").ids[0] == bos


def test_tokenizer_round_trips_multibyte_corpus(tiny: Path):
    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    text = CORPUS.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line]
    assert any(any(ord(ch) > 0xFFFF for ch in line) for line in lines)
    for line in lines + [text]:
        ids = tokenizer.encode(line, add_special_tokens=False).ids
        assert tokenizer.decode(ids) == line
    for sample in ("東京は日本の首都です。", "emoji 🚀🌍 and café", "unseen ☃ glyph ∮ 𝔘"):
        ids = tokenizer.encode(sample, add_special_tokens=False).ids
        assert tokenizer.decode(ids) == sample
    cjk = tokenizer.encode("東京は日本の首都です。", add_special_tokens=False).ids
    assert any("\ufffd" in tokenizer.decode([i]) for i in cjk)


def test_transformers_and_our_loader_agree(tiny: Path):
    import transformers

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    chat = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = hf_tokenizer("The keeper was", return_tensors="pt").input_ids
    assert ids[0, 0].item() == hf_tokenizer.bos_token_id
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(ids).logits[0]
    ours = ShardedCausalLM.load(tiny)
    ours.allocate_cache(capacity=1, max_seq_len=32)
    n = ids.shape[1]
    rows = torch.arange(n)
    logits = ours.forward(ids[0], rows, torch.zeros(n, dtype=torch.int64), rows)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert logits[-1].softmax(-1).max() > 0.05
