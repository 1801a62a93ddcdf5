from __future__ import annotations

import pytest
import torch

from helios_logprobs.ranks.contract.completion import CompletionOutputs
from helios_logprobs.ranks.contract.requests import RequestError, check_logprob_request
from helios_logprobs.ranks.contract.upload import LaneRequest, LogprobUploader, UploadResult

VOCAB = 1000
SENTINEL = 555


def uploader(capacity: int = 4, k: int = 20, supports_token_ids: bool = True) -> LogprobUploader:
    outputs = CompletionOutputs.allocate(capacity, 2)
    return LogprobUploader(outputs, VOCAB, k, supports_token_ids)


def refused(lanes: dict[int, LaneRequest], **kwargs) -> RequestError:
    target = uploader(**kwargs)
    target.outputs.logprob_token_ids.fill_(SENTINEL)
    with pytest.raises(RequestError) as caught:
        target.upload(lanes)
    assert torch.all(target.outputs.logprob_requested == 0)
    assert torch.all(target.outputs.logprob_token_id_counts == 0)
    assert torch.all(target.outputs.logprob_token_ids == SENTINEL)
    return caught.value


def test_upload_writes_full_flag_and_count_vectors():
    target = uploader(capacity=5)
    result = target.upload(
        {
            0: LaneRequest(natural_alternatives=3),
            2: LaneRequest(token_ids=(7, 3, 9)),
            3: LaneRequest(),
        }
    )
    assert target.outputs.logprob_requested.tolist() == [1, 0, 1, 0, 0]
    assert target.outputs.logprob_token_id_counts.tolist() == [0, 0, 3, 0, 0]
    assert result == UploadResult(requesting_slots=(0, 2), copy_width=20)


def test_next_submission_clears_lanes_it_does_not_contain():
    target = uploader()
    target.upload({1: LaneRequest(token_ids=(4, 5)), 3: LaneRequest(natural_alternatives=0)})
    result = target.upload({0: LaneRequest(natural_alternatives=1)})
    assert target.outputs.logprob_requested.tolist() == [1, 0, 0, 0]
    assert target.outputs.logprob_token_id_counts.tolist() == [0, 0, 0, 0]
    assert result.requesting_slots == (0,)


def test_only_each_selecting_slots_prefix_is_written():
    target = uploader()
    target.outputs.logprob_token_ids.fill_(SENTINEL)
    target.upload({1: LaneRequest(token_ids=(10, 2, 33)), 2: LaneRequest(natural_alternatives=5)})
    ids = target.outputs.logprob_token_ids
    assert ids[1, :3].tolist() == [10, 2, 33]
    assert torch.all(ids[1, 3:] == SENTINEL)
    assert torch.all(ids[[0, 2, 3]] == SENTINEL)


def test_copy_width_is_the_larger_of_k_and_the_largest_count():
    target = uploader()
    result = target.upload({0: LaneRequest(token_ids=tuple(range(30))),
                            1: LaneRequest(natural_alternatives=2)})
    assert result.copy_width == 30
    assert result.payload_words == 62


def test_copy_width_is_k_for_natural_requests():
    result = uploader(k=20).upload({2: LaneRequest(token_ids=(1,))})
    assert result.copy_width == 20
    assert result.payload_words == 42


def test_submission_without_requesting_lanes_copies_nothing():
    target = uploader()
    target.upload({0: LaneRequest(natural_alternatives=1)})
    result = target.upload({0: LaneRequest(), 1: LaneRequest()})
    assert result == UploadResult(requesting_slots=(), copy_width=0)
    assert result.payload_words == 0
    assert torch.all(target.outputs.logprob_requested == 0)


def test_selected_ids_set_the_flag_with_their_count():
    target = uploader()
    target.upload({3: LaneRequest(token_ids=[8, 1])})
    assert int(target.outputs.logprob_requested[3]) == 1
    assert int(target.outputs.logprob_token_id_counts[3]) == 2


def test_natural_core_serves_k_and_its_copy_width():
    target = uploader(k=5, supports_token_ids=False)
    result = target.upload({0: LaneRequest(natural_alternatives=5)})
    assert result.copy_width == 5


def test_logprobs_above_k_are_refused():
    error = refused({0: LaneRequest(natural_alternatives=6)}, k=5, supports_token_ids=False)
    assert error.param == "logprobs"
    assert error.message == "Requested sample logprobs of 6, which is greater than max allowed: 5"


def test_negative_logprobs_are_refused():
    error = refused({1: LaneRequest(natural_alternatives=-2)})
    assert (error.param, error.message) == (
        "logprobs", "`logprobs` must be a positive value or -1.")
    whole = refused({1: LaneRequest(natural_alternatives=-1)})  # vLLM's whole vocabulary
    assert whole.message == (
        f"Requested sample logprobs of {VOCAB}, which is greater than max allowed: 20")
    with pytest.raises(RequestError, match="-1 \\(the whole vocabulary\\) is not served"):
        check_logprob_request(-1, None, vocab_size=10, k=20, supports_token_ids=True)


def test_boolean_logprobs_are_refused():
    error = refused({1: LaneRequest(natural_alternatives=True)})
    assert error.param == "logprobs"
    assert "must be an integer in [0, 20], got True" in error.message


def test_token_ids_on_a_core_without_id_inputs_are_refused():
    error = refused({0: LaneRequest(token_ids=(1, 2))}, k=5, supports_token_ids=False)
    assert error.param == "logprob_token_ids"
    assert "declares no token-id inputs" in error.message


def test_empty_token_ids_are_refused():
    error = refused({0: LaneRequest(token_ids=())})
    assert (error.param, error.message) == (
        "logprob_token_ids", "`logprob_token_ids` must not be an empty list.")


def test_more_than_128_token_ids_are_refused():
    error = refused({0: LaneRequest(token_ids=tuple(range(129)))})
    assert error.message == "must hold 1..128 ids, got 129"


def test_repeated_token_ids_are_refused():
    error = refused({0: LaneRequest(token_ids=(4, 9, 4))})
    assert (error.param, error.message) == (
        "logprob_token_ids",
        "ids must be distinct, repeated: [4]",
    )


def test_token_ids_at_or_above_vocab_size_are_refused():
    error = refused({0: LaneRequest(token_ids=(3, VOCAB))})
    assert error.message == (f"ids [{VOCAB}] are out of vocabulary: an id must be greater than "
                             f"or equal to 0 and less than {VOCAB}")


def test_negative_token_ids_are_refused():
    error = refused({0: LaneRequest(token_ids=(-1, 3))})
    assert error.message == ("ids [-1] are out of vocabulary: an id must be greater than or "
                             f"equal to 0 and less than {VOCAB}")


def test_non_integer_token_ids_are_refused():
    error = refused({0: LaneRequest(token_ids=(1, 2.0))})
    assert error.message == "ids must be integers, got [2.0]"


def test_core_without_logprobs_refuses_logprobs():
    error = refused({0: LaneRequest(natural_alternatives=0)}, k=0, supports_token_ids=False)
    assert error.param == "logprobs"
    assert "allow_logprobs: false" in error.message


def test_core_without_logprobs_refuses_token_ids():
    # A core without logprob outputs names `logprobs` for any logprob request: the whole
    # feature is off, not just the selected IDs.
    error = refused({0: LaneRequest(token_ids=(1,))}, k=0, supports_token_ids=False)
    assert error.param == "logprobs"
    assert "declares no logprob outputs" in error.message


def test_one_refused_lane_writes_nothing_for_the_others():
    target = uploader()
    target.upload({0: LaneRequest(natural_alternatives=1)})
    with pytest.raises(RequestError):
        target.upload({1: LaneRequest(natural_alternatives=2),
                       2: LaneRequest(natural_alternatives=21)})
    assert target.outputs.logprob_requested.tolist() == [1, 0, 0, 0]


def test_slot_outside_capacity_is_an_internal_error():
    with pytest.raises(ValueError, match="slot: expected 0..3, got 4") as caught:
        uploader().upload({4: LaneRequest(natural_alternatives=1)})
    assert not isinstance(caught.value, RequestError)


def test_upload_error_is_a_value_error_naming_its_param():
    error = RequestError("logprobs", "must be in [0, 20], got 21")
    assert isinstance(error, ValueError)
    assert str(error) == "logprobs: must be in [0, 20], got 21"


def test_check_request_accepts_what_the_core_serves():
    check_logprob_request(20, None, VOCAB, 20, True)
    check_logprob_request(None, list(range(128)), VOCAB, 20, True)
    check_logprob_request(None, None, VOCAB, 0, False)


def test_check_request_refuses_before_admission():
    with pytest.raises(RequestError, match="logprob_token_ids: ids must be distinct"):
        check_logprob_request(None, [1, 1], VOCAB, 20, True)


def test_lane_request_refuses_a_string_of_ids():
    with pytest.raises(TypeError, match="token_ids: expected a sequence of ints"):
        LaneRequest(token_ids="12")


def test_uploader_refuses_token_ids_below_k20():
    with pytest.raises(ValueError, match="supports_token_ids requires k=20, got k=5"):
        LogprobUploader(CompletionOutputs.allocate(1), VOCAB, 5, True)


def test_a_lane_object_is_validated_once_and_a_new_one_again(monkeypatch):
    target = uploader()
    checked = []
    check = target.check
    monkeypatch.setattr(target, "check", lambda lane: checked.append(lane) or check(lane))
    lane = LaneRequest(token_ids=(4, 5))
    for _ in range(3):
        target.upload({1: lane})
    assert checked == [lane]
    target.upload({1: LaneRequest(token_ids=(4, 5))})  # an equal lane, another object
    assert len(checked) == 2
    with pytest.raises(RequestError):  # the same slot, a bad lane: refused as before
        target.upload({1: LaneRequest(natural_alternatives=21)})
    assert target.outputs.logprob_token_id_counts.tolist() == [0, 2, 0, 0]
