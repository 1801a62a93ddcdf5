from __future__ import annotations

import pytest

from helios_logprobs.ranks.contract.declarations import (
    BufferDecl,
    CoreDeclarations,
    DeclarationError,
    GraphDecl,
    LogprobCapabilities,
    validate,
)

CAPACITY = 4
T = 8
FLAG = ("logprob_requested",)
IDS = ("logprob_token_ids", "logprob_token_id_counts")
OUTPUTS = ("completion_records", "completion_logprobs")


def records(t: int = T, dtype: str = "int64") -> BufferDecl:
    return BufferDecl("completion_records", dtype, (2, CAPACITY, 16 + t))


def payload(words: int, shape: tuple[int, ...] | None = None, dtype: str = "int32") -> BufferDecl:
    return BufferDecl("completion_logprobs", dtype, shape or (2, CAPACITY, T, words))


def flags(dtype: str = "int32", slots: int = CAPACITY) -> BufferDecl:
    return BufferDecl("logprob_requested", dtype, (slots,))


def token_ids(shape: tuple[int, ...] = (CAPACITY, 128)) -> BufferDecl:
    return BufferDecl("logprob_token_ids", "int32", shape)


def counts(dtype: str = "int32") -> BufferDecl:
    return BufferDecl("logprob_token_id_counts", dtype, (CAPACITY,))


def sampling(inputs=FLAG + IDS, outputs=OUTPUTS, name="decode", kind="sampling") -> GraphDecl:
    return GraphDecl(name, kind, ("tokens", *inputs), outputs)


def full(*extra_buffers: BufferDecl, graphs: tuple[GraphDecl, ...] = ()) -> CoreDeclarations:
    buffers = (records(), payload(258), flags(), token_ids(), counts(), *extra_buffers)
    return CoreDeclarations(buffers, (sampling(), *graphs))


def natural(words: int) -> CoreDeclarations:
    return CoreDeclarations((records(), payload(words), flags()), (sampling(inputs=FLAG),))


def scoring(rows: int = 256) -> tuple[BufferDecl, BufferDecl, GraphDecl]:
    return (
        BufferDecl("prompt_logprobs", "int32", (2, rows, 43)),
        BufferDecl("prompt_target_tokens", "int32", (rows,)),
        GraphDecl(
            "score", "scored_prefill", ("tokens", "prompt_target_tokens"), ("prompt_logprobs",)
        ),
    )


def rejected(decl: CoreDeclarations, token_capacity: int | None = T) -> str:
    with pytest.raises(DeclarationError) as caught:
        validate(decl, CAPACITY, token_capacity)
    return str(caught.value)


def test_core_without_logprob_buffers_has_k_zero_and_loads():
    decl = CoreDeclarations(
        (records(),), (GraphDecl("decode", "sampling", ("tokens",), OUTPUTS[:1]),)
    )
    capabilities = validate(decl, CAPACITY, T)
    assert capabilities == LogprobCapabilities(k=0, supports_token_ids=False)
    assert not capabilities.allow_logprobs
    assert not capabilities.prompt_scoring
    assert capabilities.payload_words == 0


def test_empty_declarations_have_k_zero():
    assert validate(CoreDeclarations((), ()), CAPACITY, None).k == 0


@pytest.mark.parametrize(("words", "k"), [(4, 1), (12, 5), (22, 10), (42, 20)])
def test_k_derives_from_the_last_extent_without_id_inputs(words, k):
    capabilities = validate(natural(words), CAPACITY, T)
    assert (capabilities.k, capabilities.supports_token_ids) == (k, False)
    assert capabilities.allow_logprobs
    assert capabilities.payload_words == words


def test_all_five_buffers_give_k20_with_token_ids():
    capabilities = validate(full(), CAPACITY, T)
    assert (capabilities.k, capabilities.supports_token_ids) == (20, True)
    assert capabilities.payload_words == 258


@pytest.mark.parametrize("token_capacity", [None, 0])
def test_omitted_or_zero_token_capacity_means_eight(token_capacity):
    assert validate(full(), CAPACITY, token_capacity).k == 20


def test_last_extent_200_is_refused():
    message = rejected(natural(200))
    assert message == (
        "completion_logprobs: declared int32[2, 4, 8, 200], expected last extent 2+2K with 1<=K<=20"
    )


def test_odd_last_extent_is_refused():
    assert "declared int32[2, 4, 8, 13], expected last extent 2+2K" in rejected(natural(13))


def test_last_extent_for_k_zero_is_refused():
    assert "declared int32[2, 4, 8, 2], expected last extent 2+2K with 1<=K<=20" in rejected(
        natural(2)
    )


def test_last_extent_for_k21_is_refused():
    assert "declared int32[2, 4, 8, 44], expected last extent 2+2K with 1<=K<=20" in rejected(
        natural(44)
    )


def test_id_inputs_require_last_extent_258():
    decl = CoreDeclarations((records(), payload(42), flags(), token_ids(), counts()), (sampling(),))
    message = rejected(decl)
    assert message.startswith("completion_logprobs: declared int32[2, 4, 8, 42]")
    assert "expected last extent 258 (K=20) with the ID inputs declared" in message


def test_only_token_ids_without_counts_is_refused():
    decl = CoreDeclarations((records(), payload(258), flags(), token_ids()), ())
    message = rejected(decl)
    assert message.startswith("logprob_token_ids: declared without logprob_token_id_counts")
    assert "must declare all five buffers" in message


def test_only_counts_without_token_ids_is_refused():
    decl = CoreDeclarations((records(), payload(258), flags(), counts()), ())
    assert rejected(decl).startswith("logprob_token_id_counts: declared without logprob_token_ids")


def test_id_inputs_without_payload_and_flags_are_refused():
    decl = CoreDeclarations((records(), token_ids(), counts()), ())
    message = rejected(decl)
    assert message.startswith(
        "logprob_token_ids, logprob_token_id_counts: declared without completion_logprobs, "
        "logprob_requested"
    )


def test_payload_without_flag_vector_is_refused():
    decl = CoreDeclarations((records(), payload(42)), ())
    assert rejected(decl).startswith("completion_logprobs: declared without logprob_requested")


def test_flag_vector_without_payload_is_refused():
    decl = CoreDeclarations((records(), flags()), ())
    assert rejected(decl).startswith("logprob_requested: declared without completion_logprobs")


def test_logprob_buffers_without_records_are_refused():
    decl = CoreDeclarations((payload(42), flags()), ())
    message = rejected(decl)
    assert message.startswith("completion_records: not declared, expected int64[2, 4, 24]")
    assert "completion_logprobs, logprob_requested" in message


def test_flag_vector_with_wrong_dtype_is_refused():
    decl = CoreDeclarations((records(), payload(42), flags(dtype="int64")), ())
    assert rejected(decl) == "logprob_requested: declared int64[4], expected int32[4]"


def test_flag_vector_with_wrong_slot_count_is_refused():
    decl = CoreDeclarations((records(), payload(42), flags(slots=8)), ())
    assert rejected(decl) == "logprob_requested: declared int32[8], expected int32[4]"


def test_payload_with_wrong_dtype_is_refused():
    decl = CoreDeclarations((records(), payload(42, dtype="float32"), flags()), ())
    message = rejected(decl)
    assert message.startswith("completion_logprobs: declared float32[2, 4, 8, 42]")
    assert "expected int32[2, 4, 8, 2+2K] with 1<=K<=20" in message


def test_payload_with_three_frames_is_refused():
    decl = CoreDeclarations((records(), payload(42, shape=(3, CAPACITY, T, 42)), flags()), ())
    message = rejected(decl)
    assert "completion_logprobs: declared int32[3, 4, 8, 42], expected int32[2, 4, 8, 2+2K]" in (
        message
    )
    assert "(2 frames, 4 slots)" in message


def test_payload_with_wrong_slot_count_is_refused():
    decl = CoreDeclarations((records(), payload(42, shape=(2, 5, T, 42)), flags()), ())
    assert "declared int32[2, 5, 8, 42], expected int32[2, 4, 8, 2+2K]" in rejected(decl)


def test_payload_with_token_capacity_other_than_records_is_refused():
    decl = CoreDeclarations((records(), payload(42, shape=(2, CAPACITY, 6, 42)), flags()), ())
    assert "declared int32[2, 4, 6, 42], expected int32[2, 4, 8, 2+2K]" in rejected(decl)


def test_payload_with_id_inputs_and_wrong_geometry_names_258():
    decl = CoreDeclarations(
        (records(), payload(258, shape=(2, CAPACITY, 4, 258)), flags(), token_ids(), counts()), ()
    )
    assert "declared int32[2, 4, 4, 258], expected int32[2, 4, 8, 258]" in rejected(decl)


def test_records_with_other_token_capacity_are_refused():
    decl = CoreDeclarations((records(t=5), payload(42), flags()), ())
    assert (
        rejected(decl) == "completion_records: declared int64[2, 4, 21], expected int64[2, 4, 24]"
    )


def test_records_with_wrong_dtype_are_refused():
    decl = CoreDeclarations((records(dtype="int32"),), ())
    assert (
        rejected(decl) == "completion_records: declared int32[2, 4, 24], expected int64[2, 4, 24]"
    )


def test_token_ids_with_wrong_width_are_refused():
    decl = CoreDeclarations(
        (records(), payload(258), flags(), token_ids(shape=(CAPACITY, 64)), counts()), ()
    )
    assert rejected(decl) == "logprob_token_ids: declared int32[4, 64], expected int32[4, 128]"


def test_counts_with_wrong_dtype_are_refused():
    decl = CoreDeclarations((records(), payload(258), flags(), token_ids(), counts("int64")), ())
    assert rejected(decl) == ("logprob_token_id_counts: declared int64[4], expected int32[4]")


def test_sampling_graph_without_flag_vector_is_refused():
    decl = CoreDeclarations((records(), payload(42), flags()), (sampling(inputs=()),))
    message = rejected(decl)
    assert message.startswith("graph 'decode' (sampling): inputs lack logprob_requested")
    assert "sampling graphs bind the flag vector" in message


def test_sampling_graph_with_one_id_input_is_refused():
    decl = CoreDeclarations(
        (records(), payload(258), flags(), token_ids(), counts()),
        (sampling(inputs=FLAG + IDS[:1]),),
    )
    message = rejected(decl)
    assert message.startswith("graph 'decode' (sampling): inputs lack logprob_token_id_counts")
    assert "expected logprob_requested, logprob_token_ids, logprob_token_id_counts" in message


def test_speculative_graph_without_flag_vector_is_refused():
    decl = CoreDeclarations(
        (records(), payload(42), flags()), (sampling(inputs=(), name="verify", kind="speculative"),)
    )
    assert rejected(decl).startswith("graph 'verify' (speculative): inputs lack logprob_requested")


def test_graph_binding_the_payload_as_input_is_refused():
    graph = GraphDecl("decode", "sampling", FLAG + ("completion_logprobs",), OUTPUTS[:1])
    decl = CoreDeclarations((records(), payload(42), flags()), (graph,))
    message = rejected(decl)
    assert message.startswith("graph 'decode' (sampling): binds completion_logprobs as an input")
    assert "the output buffer cannot be uploaded" in message


def test_graph_binding_flags_as_output_is_refused():
    graph = GraphDecl("decode", "sampling", FLAG, OUTPUTS + FLAG)
    decl = CoreDeclarations((records(), payload(42), flags()), (graph,))
    assert "binds logprob_requested as an output, expected it among the inputs" in rejected(decl)


def test_graph_binding_flags_without_payload_output_is_refused():
    graph = GraphDecl("decode", "sampling", FLAG, OUTPUTS[:1])
    decl = CoreDeclarations((records(), payload(42), flags()), (graph,))
    assert rejected(decl).startswith("graph 'decode' (sampling): outputs lack completion_logprobs")


def test_prefill_graph_writing_the_payload_must_bind_flags():
    graph = GraphDecl("prefill", "prefill", ("tokens",), OUTPUTS)
    decl = CoreDeclarations((records(), payload(42), flags()), (sampling(inputs=FLAG), graph))
    assert rejected(decl).startswith("graph 'prefill' (prefill): inputs lack logprob_requested")


def test_graph_binding_an_undeclared_contract_buffer_is_refused():
    decl = CoreDeclarations((records(),), (sampling(inputs=FLAG, outputs=OUTPUTS[:1]),))
    assert rejected(decl) == (
        "graph 'decode' (sampling): binds logprob_requested, which is not declared"
    )


def test_prompt_scoring_with_all_pieces_reports_its_capacity():
    capabilities = validate(full(*scoring()[:2], graphs=scoring()[2:]), CAPACITY, T)
    assert capabilities.prompt_scoring
    assert capabilities.prompt_capacity == 256
    assert capabilities.k == 20


def test_prompt_logprobs_without_targets_and_graph_is_refused():
    message = rejected(full(scoring()[0]))
    assert message.startswith(
        "prompt scoring: declared prompt_logprobs without prompt_target_tokens, "
        "a scored_prefill graph"
    )


def test_prompt_targets_without_output_is_refused():
    graph = GraphDecl("score", "scored_prefill", ("tokens", "prompt_target_tokens"), ())
    message = rejected(full(scoring()[1], graphs=(graph,)))
    assert message.startswith(
        "prompt scoring: declared prompt_target_tokens, graph 'score' without prompt_logprobs"
    )


def test_scored_graph_writing_an_undeclared_prompt_output_is_refused():
    message = rejected(full(scoring()[1], graphs=scoring()[2:]))
    assert message == "graph 'score' (scored_prefill): binds prompt_logprobs, which is not declared"


def test_prompt_buffers_without_scored_graph_are_refused():
    assert "without a scored_prefill graph" in rejected(full(*scoring()[:2]))


def test_scored_graph_without_prompt_buffers_is_refused():
    graph = GraphDecl("score", "scored_prefill", ("tokens",), ())
    message = rejected(full(graphs=(graph,)))
    assert message.startswith(
        "prompt scoring: declared graph 'score' without prompt_logprobs, prompt_target_tokens"
    )


def test_prompt_logprobs_with_wrong_row_width_is_refused():
    wrong = BufferDecl("prompt_logprobs", "int32", (2, 256, 42))
    decl = full(wrong, scoring()[1], graphs=scoring()[2:])
    assert (
        rejected(decl) == "prompt_logprobs: declared int32[2, 256, 42], expected int32[2, 256, 43]"
    )


def test_prompt_logprobs_with_other_capacity_than_targets_is_refused():
    decl = full(scoring(128)[0], scoring(256)[1], graphs=scoring()[2:])
    assert rejected(decl) == (
        "prompt_logprobs: declared int32[2, 128, 43], expected int32[2, 256, 43]"
    )


def test_prompt_targets_with_wrong_dtype_are_refused():
    wrong = BufferDecl("prompt_target_tokens", "int64", (256,))
    decl = full(scoring()[0], wrong, graphs=scoring()[2:])
    assert rejected(decl) == (
        "prompt_target_tokens: declared int64[256], expected int32[C] with C >= 1"
    )


def test_prompt_scoring_with_natural_k_below_20_is_refused():
    base = natural(12)
    decl = CoreDeclarations(base.buffers + scoring()[:2], base.graphs + scoring()[2:])
    assert rejected(decl) == (
        "prompt_logprobs: prompt scoring requires K=20 generation logprob outputs, declared K=5"
    )


def test_prompt_scoring_with_natural_k20_loads():
    """The contract asks K=20 generation outputs of prompt scoring, not the ID inputs."""
    base = natural(2 + 2 * 20)
    decl = CoreDeclarations(base.buffers + scoring()[:2], base.graphs + scoring()[2:])
    caps = validate(decl, CAPACITY, T)
    assert (caps.k, caps.supports_token_ids, caps.prompt_capacity) == (20, False, 256)


def test_prompt_scoring_without_generation_logprobs_is_refused():
    decl = CoreDeclarations((records(), *scoring()[:2]), scoring()[2:])
    assert "declared K=0" in rejected(decl)


def test_scored_graph_not_binding_targets_is_refused():
    graph = GraphDecl("score", "scored_prefill", ("tokens",), ("prompt_logprobs",))
    message = rejected(full(*scoring()[:2], graphs=(graph,)))
    assert message.startswith("graph 'score' (scored_prefill): inputs ['tokens']")
    assert "expected prompt_target_tokens among the inputs" in message


def test_ordinary_graph_binding_prompt_targets_is_refused():
    prefill = GraphDecl("prefill", "prefill", ("tokens", "prompt_target_tokens"), ())
    message = rejected(full(*scoring()[:2], graphs=(*scoring()[2:], prefill)))
    assert message.startswith("graph 'prefill' (prefill): binds prompt_target_tokens")


def test_json_round_trip_preserves_declarations():
    decl = full(*scoring()[:2], graphs=scoring()[2:])
    text = decl.to_json()
    assert CoreDeclarations.from_json(text) == decl
    assert validate(CoreDeclarations.from_json(text), CAPACITY, T).prompt_capacity == 256


def test_from_json_refuses_invalid_json():
    with pytest.raises(DeclarationError, match="declarations: not valid JSON"):
        CoreDeclarations.from_json("{buffers")


def test_from_json_refuses_missing_keys():
    with pytest.raises(DeclarationError, match=r"buffer: missing keys \['shape'\]"):
        CoreDeclarations.from_json('{"buffers": [{"name": "a", "dtype": "int32"}], "graphs": []}')


def test_from_json_refuses_non_list_shape():
    text = '{"buffers": [{"name": "a", "dtype": "int32", "shape": 4}], "graphs": []}'
    with pytest.raises(DeclarationError, match="a: shape must be a JSON list, got 4"):
        CoreDeclarations.from_json(text)


def test_buffer_refuses_unknown_dtype():
    with pytest.raises(DeclarationError, match="x: dtype 'int31' is not one of"):
        BufferDecl("x", "int31", (1,))


def test_buffer_refuses_negative_extent():
    with pytest.raises(DeclarationError, match=r"x: shape must be a tuple of ints >= 0: \(2, -1\)"):
        BufferDecl("x", "int32", (2, -1))


def test_graph_refuses_unknown_kind():
    with pytest.raises(DeclarationError, match="graph 'g': kind 'decoding' is not one of"):
        GraphDecl("g", "decoding", (), ())


def test_graph_refuses_repeated_inputs():
    with pytest.raises(DeclarationError, match="graph 'g': inputs repeat a buffer"):
        GraphDecl("g", "sampling", ("a", "a"), ())


def test_declarations_refuse_repeated_buffer_names():
    with pytest.raises(DeclarationError, match=r"buffer names declared more than once: \['x'\]"):
        CoreDeclarations((BufferDecl("x", "int32", (1,)), BufferDecl("x", "int64", (1,))), ())


def test_capabilities_refuse_token_ids_below_k20():
    with pytest.raises(ValueError, match="supports_token_ids requires k=20, got k=5"):
        LogprobCapabilities(k=5, supports_token_ids=True)


def test_capabilities_refuse_scoring_below_k20():
    with pytest.raises(ValueError, match="prompt scoring requires K=20"):
        LogprobCapabilities(k=12, supports_token_ids=False, prompt_capacity=128)
    assert LogprobCapabilities(k=20, supports_token_ids=False, prompt_capacity=128).prompt_scoring
