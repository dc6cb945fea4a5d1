"""The CPU main job's prompt for exact answers: the bare-answer instruction (``searchr1_bare``). The warm start's
answer forms are tested in tests/test_main_job.py, the reward curriculum in tests/test_cluster_wiring.py."""

from openrlhf_search.env.protocol import get_protocol


# ------------------------------------------------------------------------------------------------ instruction
def test_bare_protocol_asks_for_the_bare_span_and_keeps_searchr1_short_parsing(qwen_tokenizer):
    """searchr1_bare = searchr1_short with another instruction: catches the variant not registered, its template not
    swapped (the same prompt as searchr1_short), or different tags / parsing."""
    short, bare = get_protocol("searchr1_short"), get_protocol("searchr1_bare")
    q = "What is the capital of Tonga"
    p_short, p_bare = short.build_prompt(q, chat=False), bare.build_prompt(q, chat=False)
    assert p_short != p_bare and "no sentence" in p_bare and "no sentence" not in p_short
    assert p_bare.endswith("Question: What is the capital of Tonga?\n")  # Search-R1's "?" completion kept
    assert "e.g. <answer> Beijing </answer>" in p_bare
    assert (bare.query_open, bare.query_close, bare.doc_open, bare.doc_close) == \
        (short.query_open, short.query_close, short.doc_open, short.doc_close)
    resp = "<think> x </think>\n<search> capital Tonga </search>\n\n<information>Doc 1(Title: \"Tonga\") t" \
           "</information>\n\n<answer> Nuku'alofa </answer>"
    assert bare.extract_answer(resp) == short.extract_answer(resp) == "Nuku'alofa"
    assert bare.invalid_action_message() == short.invalid_action_message()
    chat = bare.build_prompt(q, qwen_tokenizer, chat=True)
    assert "only the name or code" in chat
