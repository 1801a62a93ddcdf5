"""A scoring request's terminating stop token (RequestSpec.stop_entry, issue 39): the commit
emits it last (so the reduction scores it) without making it output, and the engine hands it
over on the finish (Finished.entry) with transformers' value, in ordinary samples and inside a
speculative round; other requests keep no entry."""

from __future__ import annotations

import pytest

from helios_logprobs.ranks.commit import RecordBatch, SlotState
from helios_logprobs.ranks.contract import abi6
from helios_logprobs.ranks.contract.requests import RequestError
from helios_logprobs.ranks.plan import RequestSpec
from helios_logprobs.ranks.sampler.params import RowSampling
from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.engine.config import RuntimeConfig
from helios_logprobs.runtime.outputs import Finished, GeneratedToken
from tests.checkpoints import hf_logprobs
from tests.scripted_checkpoint import EOS, encode, write_scripted

TOLERANCE = 1e-4


def spec(stop_entry: bool, logprobs: bool = True) -> RequestSpec:
    return RequestSpec(ordinal=1, max_tokens=10,
                       sampling=RowSampling(seed=1, position=0, temperature=0.0),
                       stop_token_ids=(9,), wants_logprobs=logprobs, stop_entry=stop_entry)


@pytest.mark.parametrize("sampled, proposals, emitted, accepted", [
    ((9,), (), 1, 0),            # an ordinary sample that stops
    ((5, 9, 7), (5, 6), 2, 1),   # a round whose correction is the stop token
    ((5, 6, 9), (5, 6), 3, 2),   # a round whose bonus token is the stop token
])
def test_the_scored_stop_token_is_emitted_last_and_is_no_output(sampled, proposals, emitted,
                                                                 accepted):
    rows = {}
    for scored in (False, True):
        state = SlotState(epoch=1, spec=spec(scored), prompt=[1, 2], length=3 + len(proposals))
        batch = RecordBatch(abi6.record_width(8), submission=1)
        assert batch.emit(0, state, sampled, proposals, first_row=0) == emitted - (not scored)
        rows[scored] = batch.rows[0]
        assert state.output == list(sampled[:emitted - 1])  # never the stop token
        assert rows[scored][abi6.FINISH_REASON] == abi6.FinishReason.STOP_TOKEN
        assert rows[scored][abi6.ACCEPTED] == accepted
        assert rows[scored][abi6.HEADER + emitted - 1] == 9
    assert rows[True][abi6.EMITTED] == rows[False][abi6.EMITTED] + 1


def test_a_scored_stop_token_needs_the_logprob_flag():
    with pytest.raises(RequestError, match="logprobs"):
        spec(True, logprobs=False)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    return write_scripted(tmp_path_factory.mktemp("stop_entry") / "model", {"c": EOS})


@pytest.mark.parametrize("speculative", [0, 3])
def test_engine_hands_the_stop_entry_over_on_the_finish(scripted, speculative):
    """"abcab" -> "c" then EOS; with speculation the history proposes (c, a, b) and the
    round's correction after "c" is the EOS."""
    config = RuntimeConfig(model_dir=scripted, capacity=4, max_model_len=96,
                           speculative_tokens=speculative, ngram_min=1, ngram_max=3)
    engine = build_engine(config, load_rank(config, None))
    prompt, eos = encode(scripted, "abcab"), encode(scripted, EOS)[0]
    jobs = [(prompt, SamplingParams(max_tokens=8, temperature=0.0, logprobs=2,
                                    stop_token_entry=scored)) for scored in (False, True)]
    (plain, scored) = engine.run_offline(jobs)
    rows = hf_logprobs(scripted, [*prompt, *encode(scripted, "c")])  # row i predicts i + 1
    for events, entry in ((plain, False), (scored, True)):
        tokens = [e for e in events if isinstance(e, GeneratedToken)]
        finish = events[-1]
        assert isinstance(finish, Finished) and finish.stop_token_id == eos
        assert [t.token_id for t in tokens] == encode(scripted, "c")
        assert abs(tokens[0].logprob - float(rows[-2, tokens[0].token_id])) <= TOLERANCE
        if not entry:
            assert finish.entry is None
            continue
        assert (finish.entry.index, finish.entry.token_id) == (1, eos)
        assert abs(finish.entry.logprob - float(rows[-1, eos])) <= TOLERANCE
        assert finish.entry.alternatives[0].token_id == eos
    if speculative:
        assert engine.speculation.offered > 0
