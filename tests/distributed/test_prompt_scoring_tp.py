"""Scored prefill on vocabulary shards at TP2 and TP4 (gloo): every rank runs the scheduler's
plans for a mix of scored, unscored and decoding requests; rank 0's decoded prompt entries
equal transformers' log_softmax, ranks included, and every rank writes the same rows. The
collectives that run per scored block are two 64-word all-gathers."""

from __future__ import annotations

import pytest

from tests.checkpoints import hf_logprobs, write_qwen2
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow

TOL = 1e-4
NEAR_TIE = 1e-5
PROMPTS = {
    "long": [(11 * i + 4) % 290 + 5 for i in range(300)],  # two chunks: 256 + 44
    "one": [17],
    "two": [17, 42],
    "plain": [3, 9, 27],
}


def rank_main(model_dir: str) -> dict:
    import torch

    from helios_logprobs.collectives.groups import world_group
    from helios_logprobs.ranks.plan import RequestSpec
    from helios_logprobs.ranks.sampler.params import RowSampling
    from helios_logprobs.runtime.engine.bootstrap import load_rank
    from helios_logprobs.runtime.engine.client import SamplingParams
    from helios_logprobs.runtime.engine.config import RuntimeConfig
    from helios_logprobs.runtime.engine.prompt_reader import decode_prompt_rows
    from helios_logprobs.runtime.engine.scheduler import Request, Scheduler

    config = RuntimeConfig(model_dir=model_dir, capacity=4, max_model_len=512, chunk_size=256,
                           prompt_logprobs=True)
    step = load_rank(config, world_group())
    scheduler = Scheduler(config.scheduler_config(512))
    requests = {}
    for ordinal, (name, prompt) in enumerate(PROMPTS.items(), start=1):
        scored = name != "plain"
        spec = RequestSpec(ordinal, max_tokens=0 if name == "two" else 2,
                           sampling=RowSampling(seed=ordinal, position=0, temperature=0.0),
                           scores_prompt=scored)
        requests[name] = Request(ordinal, prompt, SamplingParams(), spec, sink=None)
        scheduler.add(requests[name])
    entries: dict[str, list] = {name: [] for name in PROMPTS}
    rows_seen = []
    for _ in range(40):
        nxt = scheduler.next_plan()
        if nxt is None:
            break
        plan, carried = nxt
        step.run(plan)
        if plan.scored is not None:
            work = plan.scored
            owner = next(n for n, r in requests.items() if r.slot == work.slot and r in carried)
            n = len(work.targets)
            rows = step.scorer.frames_for(n).prompt_logprobs[plan.frame, :n].clone()
            rows_seen.append(rows)
            entries[owner] += [
                (e.position, e.token_id, e.logprob, e.rank,
                 tuple(tuple(a) for a in e.alternatives))
                for e in decode_prompt_rows(rows.numpy(), work, 20, step.model.vocab_size)
            ]
        records = step.outputs.completion_records[plan.frame]
        for work in plan.work:
            r = next(r for r in carried if r.slot == work.slot)
            if work.samples:
                r.generated.append(int(records[work.slot, 16]))
                if len(r.generated) >= r.spec.max_tokens:
                    scheduler.finish(r)
            elif work.targets and r.prefilled == len(r.prompt) and r.spec.max_tokens == 0:
                scheduler.finish(r)
    return {"entries": entries, "rows": torch.cat(rows_seen) if rows_seen else None,
            "bytes": step.scorer.scoring.bytes_sent,
            "calls": (step.scorer.scoring.exchange1.calls, step.scorer.scoring.exchange2.calls)}


def check(model_dir, prompt, entries) -> None:
    rows = hf_logprobs(model_dir, prompt)
    assert [e[0] for e in entries] == list(range(1, len(prompt)))
    for position, token_id, value, rank, alternatives in entries:
        row = rows[position - 1]
        assert token_id == prompt[position]
        want = float(row[token_id])
        assert abs(value - want) <= TOL
        assert 1 + int((row > want + NEAR_TIE).sum()) <= rank <= int((row > want - NEAR_TIE).sum())
        assert len(alternatives) == 20
        for alt_id, alt_value in alternatives:
            assert abs(alt_value - float(row[alt_id])) <= TOL
        rest = row.clone()
        rest[[a for a, _ in alternatives]] = float("-inf")
        assert float(rest.max()) <= alternatives[-1][1] + TOL


@pytest.mark.parametrize("world", [2, 4])
def test_scored_prefill_on_shards_matches_transformers(tmp_path, world):
    model_dir = write_qwen2(tmp_path / "qwen2", vocab_size=301)  # 4 does not divide 301
    results = run_ranks(rank_main, world, str(model_dir), timeout_s=300)
    first = results[0]
    for other in results[1:]:
        assert other["entries"] == first["entries"]
        assert other["rows"].equal(first["rows"])  # every rank writes the same rows
    for name, prompt in PROMPTS.items():
        if name == "plain":
            assert first["entries"][name] == []
        else:
            check(model_dir, prompt, first["entries"][name])
    # Scored blocks: 64-row blocks of the chunks (256 -> 4, 44 -> 1, 1 -> 1, 2 -> 1), two
    # exchanges each, 64 int32 words per row per rank.
    blocks = 4 + 1 + 1 + 1
    assert first["calls"] == (blocks, blocks)
    rows = 256 + 44 + 1 + 2
    assert first["bytes"] == 2 * rows * 64 * 4
