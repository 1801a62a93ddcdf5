"""Speculative rounds and thinking budgets at TP4 over gloo (vocabulary 301, which 4 does
not divide, and the scripted checkpoint's 41): every rank runs the same engine without its
thread (Engine.run_offline plans the same submissions on every rank), so each rank's frames
can be watched. Tokens and logprobs equal speculation off and TP1, and transformers."""

from __future__ import annotations

import pytest

from tests.checkpoints import write_qwen2
from tests.distributed.harness import run_ranks
from tests.scripted_checkpoint import THINK, encode, write_scripted
from tests.spec_helpers import (
    JOBS,
    assert_matches_transformers,
    assert_same_results,
    split_events,
)

pytestmark = pytest.mark.slow

THINKING = [  # (text, max_tokens, budget): a span in the prompt, one the output opens, none
    (f"q{THINK}ab", 8, 4),
    (f"x{THINK}abcab", 12, 8),
    ("k", 9, 2),
    ("abcab", 6, 0),
]


def rank_main(model_dir: str, jobs, counts: tuple[int, ...], overrides: dict) -> dict:
    """Every N of ``counts`` on this rank: its events, and what its frame watch saw."""
    from helios_logprobs.collectives.groups import world_group
    from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
    from helios_logprobs.runtime.engine.config import RuntimeConfig
    from tests.spec_helpers import FrameWatch

    out = {}
    for n in counts:
        config = RuntimeConfig(model_dir=model_dir, **{
            "capacity": 4, "max_model_len": 96, "speculative_tokens": n, "ngram_min": 1,
            "ngram_max": 3, **overrides})
        engine = build_engine(config, load_rank(config, world_group()))
        watch = FrameWatch(engine.step)
        events = engine.run_offline(jobs)
        out[n] = {"events": events, "problems": watch.problems, "counts": watch.counts(),
                  "forced": sum(bin(r[5]).count("1") for _, r in watch.rounds)}
    return out


def run(world: int, model_dir, jobs, counts, **overrides) -> list[dict]:
    return run_ranks(rank_main, world, str(model_dir), jobs, counts, overrides,
                     timeout_s=600)


def test_random_qwen2_tp4_equals_tp1_and_speculation_off(tmp_path):
    model_dir = write_qwen2(tmp_path / "qwen2")
    tp4 = run(4, model_dir, JOBS, (0, 2, 4))
    (tp1,) = run(1, model_dir, JOBS, (0, 4))
    for rank in tp4:
        for n, result in rank.items():
            assert result["problems"] == [], (n, result["problems"][:4])
        # Every rank committed the same records and decoded the same payload.
        assert_same_results(tp4[0][4]["events"], rank[4]["events"])
        assert rank[4]["counts"] == tp4[0][4]["counts"]
    offered, accepted = tp4[0][4]["counts"]
    assert 0 < accepted < offered
    assert tp4[0][0]["counts"] == (0, 0)
    for n in (2, 4):
        assert_same_results(tp4[0][0]["events"], tp4[0][n]["events"])
    assert_same_results(tp1[0]["events"], tp4[0][4]["events"])
    assert_same_results(tp1[4]["events"], tp4[0][4]["events"])
    for (prompt, params), events in zip(JOBS, tp4[0][4]["events"], strict=True):
        tokens, _ = split_events(events)
        assert len(tokens) == params.max_tokens
        assert_matches_transformers(model_dir, prompt, tokens, params)


def test_thinking_budget_tp4_forced_tokens_have_no_entries(tmp_path):
    from helios_logprobs.runtime.engine.client import SamplingParams

    model_dir = write_scripted(tmp_path / "scripted", {"c": "a", "m": THINK})
    jobs = [(encode(model_dir, text), SamplingParams(
        temperature=0.0, max_tokens=max_tokens, thinking_token_budget=budget, logprobs=20))
        for text, max_tokens, budget in THINKING]
    tp4 = run(4, model_dir, jobs, (0, 4), reasoning_parser="qwen3", ngram_min=2)
    for rank in tp4:
        assert rank[0]["problems"] == [] and rank[4]["problems"] == []
        assert_same_results(tp4[0][4]["events"], rank[4]["events"])
    assert_same_results(tp4[0][0]["events"], tp4[0][4]["events"])
    forced = 0
    for (prompt, params), events in zip(jobs, tp4[0][4]["events"], strict=True):
        tokens, _ = split_events(events)
        assert len(tokens) == params.max_tokens
        forced += sum(t.logprob is None for t in tokens)
        assert all(t.alternatives == () for t in tokens if t.logprob is None)
        assert_matches_transformers(model_dir, prompt, tokens, params)
    assert forced == 3  # one </think> in each of the first three jobs
    assert tp4[0][4]["forced"] >= 1  # at least one forced position inside a round


def test_launch_generate_tp4_over_the_control_plane(tmp_path):
    """Plans with proposals and budgets travel to the peers over ZeroMQ (msgpack): the
    command-line flags give the same tokens and entries as speculation off."""
    import json

    from tests.distributed.launcher import run_ranks as run_module

    model_dir = write_scripted(tmp_path / "scripted", {"c": "a", "m": THINK})
    reqs = [{"prompt_ids": encode(model_dir, text), "params": {
        "max_tokens": max_tokens, "temperature": 0.0, "thinking_token_budget": budget,
        "logprobs": 3}} for text, max_tokens, budget in THINKING]
    reqs.append({"prompt_ids": encode(model_dir, "abcab"), "params": {
        "max_tokens": 6, "temperature": 0.0, "logprobs": 1, "speculative": False}})
    (tmp_path / "req.json").write_text(json.dumps(reqs))
    outs = []
    for flags in ([], ["--speculative-tokens", "4", "--ngram-min", "2", "--ngram-max", "3"]):
        out = tmp_path / f"out{len(flags)}.json"
        run_module("helios_logprobs.launch.generate", [
            "--model", str(model_dir), "--requests", str(tmp_path / "req.json"),
            "--output", str(out), "--capacity", "4", "--reasoning-parser", "qwen3", *flags], 4)
        outs.append(json.loads(out.read_text()))
    assert outs[0]["healthy"] and outs[1]["healthy"]
    assert outs[0]["results"] == outs[1]["results"]  # JSON floats: equal to the last digit
    forced = [sum(t["logprob"] is None for t in r["tokens"]) for r in outs[1]["results"]]
    assert forced == [1, 1, 1, 0, 0]


def test_batch_invariant_tp4_speculation_on_and_off_report_identical_bits(tmp_path):
    """With --batch-invariant the rows of a round, a lone decode and a busy batch round the
    same way (padded linear layers, key-block attention, rank-ordered sums): == , not close."""
    model_dir = write_qwen2(tmp_path / "qwen2")
    tp4 = run(4, model_dir, JOBS, (0, 4), batch_invariant=True)
    for rank in tp4:
        assert rank[0]["problems"] == [] and rank[4]["problems"] == []
    offered, accepted = tp4[0][4]["counts"]
    assert 0 < accepted < offered
    for (prompt, params), off, on in zip(JOBS, tp4[0][0]["events"], tp4[0][4]["events"],
                                         strict=True):
        (tokens_off, finish_off), (tokens_on, finish_on) = split_events(off), split_events(on)
        assert finish_off == finish_on
        assert [(t.token_id, t.logprob, t.alternatives) for t in tokens_off] == [
            (t.token_id, t.logprob, t.alternatives) for t in tokens_on]
        assert_matches_transformers(model_dir, prompt, tokens_on, params)
