"""The time of a weight update from a checkpoint (POST /update_weights) at TP1 on the CPU,
against the start-up load of the same checkpoint in the same process.

    python bench/weight_update.py [--model tiny default ...] [--repeat 3]

For each model (``default`` is launch.serve's default, SmolLM2-135M, served as a Q4_1 GGUF:
transformers dequantizes it to an FP32 safetensors folder A) it writes B, a copy of A whose
every tensor is redrawn, builds an engine on A and times, median of ``--repeat``: the
start-up weight load of A (ShardedCausalLM.load, the baseline, on the engine's step thread
as the update is), the header check alone, and a whole update (pause, check, load, commit,
resume through runtime.engine.weight_update, alternately to B and back to A). A GGUF model
gets a second row, ``<name>-gguf``: the engine serves the GGUF file itself (as launch.serve
does) and is updated alternately from the safetensors folder B and back from its GGUF file
(the load and check columns are the GGUF's). Prints seconds and the update's ratio to the
start-up load.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def safetensors_folder(name: str, work: Path) -> Path:
    """A safetensors folder of the model (the GGUF default dequantized by transformers)."""
    from helios_logprobs.launch.model_source import resolve_model

    source = resolve_model(None if name == "default" else name, None).path
    if (source / "model.safetensors").is_file():
        return source
    from transformers import AutoModelForCausalLM

    target = work / f"{name}-a"
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file="model.gguf",
                                                 dtype="float32")
    # (transformers will not save_pretrained a model it read from GGUF: write the tensors)
    from safetensors.torch import save_file

    target.mkdir()
    model.config.save_pretrained(target)
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()
               if not (model.config.tie_word_embeddings and name == "lm_head.weight")}
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        if (source / extra).is_file():
            shutil.copy(source / extra, target / extra)
    return target


def gguf_served(name: str) -> Path | None:
    """The folder launch.serve serves for a GGUF model (None for a safetensors one)."""
    from helios_logprobs.launch.model_source import resolve_model
    from helios_logprobs.ranks.model.weight_update import gguf_file

    source = resolve_model(None if name == "default" else name, None).path
    return source if gguf_file(source) is not None else None


def redrawn(source: Path, target: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    generator = torch.Generator().manual_seed(1)
    tensors = {name: t + 0.1 * t.float().std() * torch.randn(t.shape, generator=generator)
               .to(t.dtype) for name, t in load_file(str(target / "model.safetensors")).items()}
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(a: Path, b: Path, repeat: int) -> tuple[float, float, float]:
    """Medians: start-up load of A, header check, whole update (alternately to B and A)."""
    from helios_logprobs.ranks.model import ShardedCausalLM
    from helios_logprobs.ranks.model.weight_update import check_same_tensors
    from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
    from helios_logprobs.runtime.engine.config import RuntimeConfig
    from helios_logprobs.runtime.engine.weight_update import WeightControl

    config = RuntimeConfig(model_dir=a, capacity=4)
    engine = build_engine(config, load_rank(config, None)).start()
    control = WeightControl.for_engine(engine)

    def update(folder: Path) -> None:
        control.handle("pause", {"mode": "abort"})
        status, body = control.handle("update_weights",
                                      {"update_info": {"model_path": str(folder)}})
        control.handle("resume", {})
        if status != 200:
            raise RuntimeError(body)

    try:
        # (on the step thread, as the update: engine.start gave up this thread's OpenMP pool)
        loads = [engine.run_between_steps(lambda: timed(lambda: ShardedCausalLM.load(a)))
                 for _ in range(repeat)]
        checks = [timed(lambda: check_same_tensors(a, b)) for _ in range(repeat)]
        updates = [timed(lambda i=i: update(b if i % 2 == 0 else a)) for i in range(repeat)]
    finally:
        engine.shutdown()
    return tuple(statistics.median(x) for x in (loads, checks, updates))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", nargs="*", default=["tiny", "default"])
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    from helios_logprobs.ranks.model.weight_update import tensor_shapes

    print(f"TP1 CPU, median of {args.repeat}")
    print(f"{'model':>12} {'params':>8} {'load s':>8} {'check s':>8} {'update s':>9} "
          f"{'update/load':>11}")
    with tempfile.TemporaryDirectory(prefix="weight-update-") as work:
        for name in args.model:
            try:
                a = safetensors_folder(name, Path(work))
            except (SystemExit, Exception) as exc:  # noqa: BLE001 (reported, not hidden)
                print(f"{name:>12} not available here: {exc}")
                continue
            b = redrawn(a, Path(work) / f"{name}-b")
            rows = [(name, a)]
            gguf = gguf_served(name)
            if gguf is not None:
                rows.append((f"{name}-gguf", gguf))
            for label, served in rows:
                load, check, whole = measure(served, b, args.repeat)
                params = sum(math.prod(shape) for shape in tensor_shapes(served).values())
                print(f"{label:>12} {params / 1e6:>7.1f}M {load:>8.3f} {check:>8.4f} "
                      f"{whole:>9.3f} {whole / load:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
