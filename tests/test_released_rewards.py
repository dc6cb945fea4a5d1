"""R1-Searcher's released Llama reward servers (train/reward_server_llama_stage{1,2}.py), reproduced exactly as
r1searcher_released_llama_stage{1,2}; the released launchers use them (docs/parity.md)."""

import pytest

from openrlhf_search.env.rewards import compute_reward

DOCS = "<|begin_of_documents|>\n(1)Title: Paris Text: Paris is the capital of France.\n<|end_of_documents|>\n\n"
RETRIEVAL = " I need to search.<|begin_of_query|> capital of France<|end_of_query|>\n\n" + DOCS


def _traj(answer="Paris", retrieval=True, tail="", think_close=True):
    body = (RETRIEVAL if retrieval else " I know it.") + " So it is done."
    body += " </think>\n\n" if think_close else "\n\n"
    if answer is not None:
        body += f"<answer> {answer} </answer>"
    return body + tail


def _r(scheme, text, golds=("Paris",)):
    return compute_reward(scheme, text, list(golds), "r1searcher").reward


@pytest.mark.parametrize("text,stage1,stage2", [
    (_traj(), 2.0, 1.0),                                  # retrieval + right answer + format
    (_traj(retrieval=False), 1.5, 1.0),                   # no retrieval: no +0.5; counts all 0 are equal
    (_traj(answer="Lyon"), 0.0, 0.0),                     # wrong answer: -1 + 0.5 + 0.5; F1 0
    (_traj(answer=None), -0.5, -1.0),                     # no answer block: -1 + 0.5; F1 0 and -1 format
    (_traj(think_close=False), 1.5, 0.0),                 # no </think>: no format +0.5; -1 format
    (_traj(answer="the city of Paris"), 2.0, 0.5),        # covers the gold; F1 = 2 x (1/3 x 1) / (4/3) = 0.5
])
def test_llama_stage1_and_stage2_values(text, stage1, stage2):
    assert _r("r1searcher_released_llama_stage1", text) == pytest.approx(stage1)
    assert _r("r1searcher_released_llama_stage2", text) == pytest.approx(stage2)


def test_unbalanced_retrieval_tags():
    text = (" <|begin_of_query|> capital of France<|end_of_query|>\n\n So it is done. </think>\n\n"
            "<answer> Paris </answer>")
    assert _r("r1searcher_released_llama_stage1", text) == pytest.approx(1.5)  # no retrieval bonus
    assert _r("r1searcher_released_llama_stage2", text) == pytest.approx(0.0)  # F1 1 - 1


def test_cjk_counts_only_outside_documents_in_stage2():
    inside = _traj().replace("Paris is the capital", "Paris 巴黎 is the capital")
    assert _r("r1searcher_released_llama_stage2", inside) == pytest.approx(1.0)
    outside = _traj().replace("So it is done.", "So it is 巴黎.")
    assert _r("r1searcher_released_llama_stage2", outside) == pytest.approx(0.0)


def test_llama_stage2_is_not_the_qwen_server():
    """The Qwen server also punishes a role word anywhere and long answers, by -2; the Llama stage-2 server does
    neither and punishes by -1."""
    role = _traj().replace("So it is done.", "The assistant says so.")
    assert _r("r1searcher_released_llama_stage2", role) == pytest.approx(1.0)
    assert _r("r1searcher_released_stage2", role) == pytest.approx(-1.0)
    long_answer = _traj(answer="Paris which is a large city in the north of France")
    assert _r("r1searcher_released_llama_stage2", long_answer) > 0
    assert _r("r1searcher_released_stage2", long_answer) < 0


def test_searchr1_tags_are_refused():
    with pytest.raises(ValueError, match="r1searcher protocol"):
        compute_reward("r1searcher_released_llama_stage1", "<answer> x </answer>", ["x"], "searchr1")


def test_released_rollout_does_not_stop_at_the_answer(qwen_tokenizer):
    """--search.stop_at_answer false (R1-Searcher's released loop stops only at <|end_of_query|>): the engine is
    asked for that stop string alone, the text the policy writes after </answer> stays in the trajectory and the
    released format checks score it."""
    import asyncio
    from types import SimpleNamespace

    from vllm import SamplingParams

    from openrlhf_search.env.agent import SearchAgentExecutor
    from openrlhf_search.env.config import SearchConfig

    turn = " So it is done. </think>\n\n<answer> Paris </answer> and more <answer> Lyon </answer>"
    ids = qwen_tokenizer(turn, add_special_tokens=False).input_ids

    class Engine:
        def __init__(self):
            self.stops = []

        async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
            self.stops.append(list(sampling_params.stop))
            out = SimpleNamespace(token_ids=ids, text=turn, finish_reason="stop", stop_reason=None, logprobs=None)
            return SimpleNamespace(outputs=[out])

    results = {}
    for stop in (True, False):
        cfg = SearchConfig(protocol="r1searcher", stop_at_answer=stop, reward_scheme="r1searcher_released_llama_stage2",
                           retriever_urls=["http://127.0.0.1:9"])
        ex = SearchAgentExecutor(config=cfg, retrieval_client=object())
        engine = Engine()
        res = asyncio.run(ex.execute("User: where?\nAssistant: <think>", "Paris", SamplingParams(max_tokens=64), 512,
                                     qwen_tokenizer, engine))
        results[stop] = (engine.stops, res)
    assert results[True][0] == [["<|end_of_query|>", "</answer>"]]
    assert results[False][0] == [["<|end_of_query|>"]]
    # two answer blocks after the first </answer>: the released checks punish (-1) and the last answer (Lyon) counts
    assert results[False][1]["reward"] == pytest.approx(-1.0)
    with pytest.raises(Exception, match="stop_at_answer"):
        SearchConfig(stop_at_answer="no")
