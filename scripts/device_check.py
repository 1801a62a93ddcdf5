"""The Python steps of scripts/device-check.sh, one subcommand each, each ending with one
``figure:`` line that the script's summary table shows (and, with --figures FILE, writes
that line to FILE).

    python scripts/device_check.py checkpoint DIR [--vocab 151936] [--writer auto]
    python scripts/device_check.py select [--dry-run]
    python scripts/device_check.py decode --model DIR [--modes eager,graphs] [--dry-run]

``checkpoint``: a random Qwen2 checkpoint (tests/checkpoints.py write_qwen2: 2 layers, hidden
64, tied embeddings; without transformers the same layout written with safetensors alone)
with the given vocabulary, written once for the later steps.
``select``: the two GPU selection networks of the Triton reduction (tl.topk, max-extraction)
at 256 x 151,936 bf16 with 100%, 12.5% and 0% of the rows flagged, against log_softmax +
topk, and their payloads bit-equal. ``decode``: decode tokens/s at batch 1 and 16, no
logprobs against logprobs=20, eager against the captured decode step
(ranks/step/cuda_graphs.py) with and without --compile (``MODES``), on the checkpoint.

``--dry-run`` runs the same code on the CPU at small sizes (the Triton interpreter for
``select``, a CPU stand-in backend that replays the captured callables for ``decode``'s
graphs), so tests/gpu/test_device_check_script.py checks the plumbing without a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QWEN_VOCAB = 151_936


def figure(args: argparse.Namespace, text: str) -> str:
    """Print the step's summary figure; with --figures, also write it there."""
    print(f"figure: {text}", flush=True)
    if getattr(args, "figures", None):
        Path(args.figures).write_text(text + "\n")
    return text


def write_plain_qwen2(path: Path, vocab: int) -> Path:
    """The same layout as tests/checkpoints.py write_qwen2 (config.json and one safetensors
    file under Hugging Face's Qwen2 names, tied embeddings) written with torch and
    safetensors alone: the GPU machine's image may lack transformers (no network there)."""
    import json

    import torch
    from safetensors.torch import save_file

    hidden, inter, layers, heads, kv_heads = 64, 96, 2, 4, 2
    head_dim = hidden // heads
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
              "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "max_position_embeddings": 512,
              "rope_theta": 20000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
              "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "float32"}
    g = torch.Generator().manual_seed(2)

    def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden, scale=1.0),
               "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        layer = f"model.layers.{i}."
        for name, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            tensors[f"{layer}self_attn.{name}_proj.weight"] = rand(rows * head_dim, hidden)
            tensors[f"{layer}self_attn.{name}_proj.bias"] = rand(rows * head_dim)
        tensors[f"{layer}self_attn.o_proj.weight"] = rand(hidden, hidden)
        tensors[f"{layer}mlp.gate_proj.weight"] = rand(inter, hidden)
        tensors[f"{layer}mlp.up_proj.weight"] = rand(inter, hidden)
        tensors[f"{layer}mlp.down_proj.weight"] = rand(hidden, inter)
        tensors[f"{layer}input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{layer}post_attention_layernorm.weight"] = torch.ones(hidden)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def checkpoint(args: argparse.Namespace) -> str:
    started = time.perf_counter()
    writer = args.writer
    if writer == "auto":
        try:
            import transformers  # noqa: F401
            writer = "transformers"
        except ImportError:
            writer = "plain"
    if writer == "transformers":
        from tests.checkpoints import write_qwen2

        path = write_qwen2(Path(args.dir), vocab_size=args.vocab)
    else:
        path = write_plain_qwen2(Path(args.dir), args.vocab)
    return figure(args, f"vocab {args.vocab:,} ({writer}) at {path} "
                        f"({time.perf_counter() - started:.1f}s)")


def select(args: argparse.Namespace) -> str:
    import torch

    from helios_logprobs.kernels.layout import MAX_TOKEN_IDS, PAYLOAD_WORDS
    from helios_logprobs.kernels.triton.backend import PreparedReduction
    from helios_logprobs.kernels.triton.common import SELECT_EXTRACT, SELECT_TOPK

    dry = args.dry_run
    rows, vocab = (2, 300) if dry else (256, QWEN_VOCAB)
    dev = torch.device("cpu" if dry else "cuda")
    torch.manual_seed(0)
    logits = (torch.randn(rows, vocab, device=dev) * 3).to(torch.bfloat16)
    chosen = torch.randint(0, vocab, (rows,), device=dev, dtype=torch.int32)
    ids = torch.full((rows, MAX_TOKEN_IDS), -1, dtype=torch.int32, device=dev)
    counts = torch.zeros(rows, dtype=torch.int32, device=dev)
    out = torch.empty(rows, PAYLOAD_WORDS, dtype=torch.int32, device=dev)
    read = 2 * rows * vocab * logits.element_size()  # launches 1 and 3 each read the row

    def bench(fn) -> float:  # milliseconds
        if dry:
            fn()
            started = time.perf_counter()
            fn()
            return (time.perf_counter() - started) * 1e3
        from triton.testing import do_bench

        return do_bench(fn)

    base = bench(lambda: torch.log_softmax(logits.float(), dim=-1).topk(20, dim=-1))
    print(f"baseline log_softmax(fp32) + topk: {base * 1e3:8.1f} us")
    full = {}
    best = {}
    for name, mode in (("topk", SELECT_TOPK), ("extract", SELECT_EXTRACT)):
        prepared = PreparedReduction(rows, vocab, torch.bfloat16, dev, select=mode)
        for frac in (1.0, 0.125, 0.0):
            flags = (torch.arange(rows, device=dev) < int(rows * frac)).to(torch.int32)
            ms = bench(lambda p=prepared, f=flags: p(logits, chosen, ids, counts, f, 20, vocab,
                                                      out))
            gbs = read * frac / (ms * 1e-3) / 1e9
            print(f"select={name:8s} flagged={frac:5.3f}: {ms * 1e3:8.1f} us  "
                  f"{gbs:7.1f} GB/s  x{base / ms:5.2f} vs baseline")
            if frac == 1.0:
                full[name] = out.clone()
                best[name] = ms
    same = torch.equal(full["topk"], full["extract"])
    print("topk and extract payloads identical:", same)
    if not same:
        raise SystemExit("select: the two networks' payloads differ")
    return figure(args, f"all rows: topk {best['topk'] * 1e3:.0f} us, extract "
                        f"{best['extract'] * 1e3:.0f} us, baseline {base * 1e3:.0f} us")


class ReplayedCallables:
    """decode --dry-run's stand-in for CUDA graphs on the CPU: one pool, each variant's
    callable kept at capture and called at replay (ranks/step/cuda_graphs.py GraphBackend)."""

    def pool(self) -> object:
        return object()

    def capture(self, fn, pool):
        fn()

        class Graph:
            replay = staticmethod(fn)

        return Graph()


MODES = ("eager", "graphs", "compiled-graphs")
"""decode's modes: the eager step (Triton reduction); the captured reduce phase (Triton);
--compile with graphs (the compiled forward's decode buckets and the compiled reduce region
over the Triton backend's triton_ops; the dry run on a CPU compiles the torch backend's
ops)."""


def decode_engine(args: argparse.Namespace, mode: str):
    from helios_logprobs.ranks.step.cuda_graphs import DecodeGraphs, enable_decode_graphs
    from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
    from helios_logprobs.runtime.engine.config import RuntimeConfig

    dry = args.dry_run
    compiled = mode == "compiled-graphs"
    config = RuntimeConfig(model_dir=Path(args.model), device="cpu" if dry else "cuda",
                           capacity=16, max_model_len=256, compile=compiled,
                           reduction_backend="torch" if dry else "triton")
    started = time.perf_counter()
    step = load_rank(config, None)
    if mode != "eager":
        if dry:
            step.cuda_graphs = DecodeGraphs(step, ReplayedCallables())
        elif enable_decode_graphs(step) is None:
            raise SystemExit("decode: no CUDA graphs were captured")
    print(f"{mode}: step built (compiles and captures) in {time.perf_counter() - started:.1f}s")
    return build_engine(config, step).start(), step


def decode(args: argparse.Namespace) -> str:
    from bench.decode import time_batch

    tokens, repeat = (6, 1) if args.dry_run else (32, 2)
    batches = (1, 4) if args.dry_run else (1, 16)
    modes = args.modes.split(",")
    table: dict[tuple[str, int, str], float] = {}
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"decode: unknown mode {mode!r} (expected {', '.join(MODES)})")
        engine, step = decode_engine(args, mode)
        try:
            time_batch(engine, 2, 4, 20)  # (warm-up)
            for batch in batches:
                for name, k in (("none", None), ("K=20", 20)):
                    table[mode, batch, name] = statistics.median(
                        time_batch(engine, batch, tokens, k) for _ in range(repeat))
            if mode != "eager":
                replays = step.cuda_graphs.counters.replays
                print(f"{mode}: captured replays {replays}")
                if not replays["reduce"]:
                    raise SystemExit("decode: the captured reduce phase never replayed")
        finally:
            engine.shutdown()
    print(f"{'mode':>15} {'batch':>5} {'none tok/s':>10} {'K=20 tok/s':>10} {'ratio':>6}")
    for mode in modes:
        for batch in batches:
            none, k20 = table[mode, batch, "none"], table[mode, batch, "K=20"]
            print(f"{mode:>15} {batch:>5} {none:>10.1f} {k20:>10.1f} {k20 / none:>6.3f}")
    top = batches[-1]
    return figure(args, f"b{top} K=20 tok/s (x none): " + ", ".join(
        f"{mode} {table[mode, top, 'K=20']:.0f} "
        f"(x{table[mode, top, 'K=20'] / table[mode, top, 'none']:.2f})" for mode in modes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--figures", default=None, help="write the figure line here")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("checkpoint")
    p.add_argument("dir")
    p.add_argument("--vocab", type=int, default=QWEN_VOCAB)
    p.add_argument("--writer", choices=["auto", "transformers", "plain"], default="auto",
                   help="auto: transformers' Qwen2 when it imports, else the plain writer")
    p = sub.add_parser("select")
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("decode")
    p.add_argument("--model", required=True)
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if getattr(args, "dry_run", False) and args.command == "select":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton is imported)
    {"checkpoint": checkpoint, "select": select, "decode": decode}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
