"""GeneratedToken.last from the frame reader: True on the token the finish rides on, False
where no finish can come before another token, None where a stop token sampled next could
end the request without one."""

from __future__ import annotations

import pytest

from helios_logprobs.runtime.engine.bootstrap import build_engine, load_rank
from helios_logprobs.runtime.engine.client import SamplingParams
from helios_logprobs.runtime.engine.config import RuntimeConfig
from tests.checkpoints import write_llama


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = write_llama(tmp_path_factory.mktemp("llama"))
    config = RuntimeConfig(model_dir=model_dir, capacity=2, max_model_len=64)
    engine = build_engine(config, load_rank(config, None)).start()
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("logprobs", [None, 3])
def test_requests_without_stop_tokens_know_their_last_token(engine, logprobs):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    tokens, finished = engine.generate_sync([5, 6, 7], params)
    assert finished.reason == "length" and len(tokens) == 5
    assert [t.last for t in tokens] == [False, False, False, False, True]


def test_a_possible_stop_token_leaves_each_frames_last_token_unknown(engine):
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = [t.token_id for t in engine.generate_sync([5, 6, 7], plain)[0]]
    stop = next(i for i in range(engine.info.vocab_size) if i not in ids)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                            stop_token_ids=(stop,), logprobs=1)
    tokens, finished = engine.generate_sync([5, 6, 7], params)
    assert [t.token_id for t in tokens] == ids and finished.reason == "length"
    assert [t.last for t in tokens] == [None] * 5 + [True]

    ended = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                           stop_token_ids=(ids[3],))
    tokens, finished = engine.generate_sync([5, 6, 7], ended)
    assert finished.stop_token_id == ids[3] and len(tokens) == ids.index(ids[3])
    assert all(t.last is None for t in tokens)
