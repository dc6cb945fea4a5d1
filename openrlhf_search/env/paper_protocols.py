"""The papers' protocols: R1-Searcher's and Search-R1's tags, released prompt texts, passage lines and query cleaning,
and two shorter Search-R1 instructions of the CPU main job (``searchr1_short``, ``searchr1_bare``).

The interface they implement and the registry (``get_protocol``) are in :mod:`openrlhf_search.env.protocol`;
``openrlhf_search.env`` imports this module once, which registers them.
"""

from __future__ import annotations

from typing import Optional, Sequence

from openrlhf_search.env.protocol import Protocol, register_protocol
from openrlhf_search.env.types import Passage

__all__ = ["R1SearcherProtocol", "SearchR1Protocol", "SearchR1ShortProtocol", "SearchR1BareProtocol"]


def _tsv_field(field: str) -> str:
    """``field`` as a minimally quoted TSV cell (Python ``csv``, tab delimiter): quoted, inner quotes doubled, when it
    holds a double quote, a tab or a line break; unchanged otherwise."""
    import csv
    import io

    buf = io.StringIO()
    csv.writer(buf, delimiter="\t", lineterminator="\n").writerow([field])
    return buf.getvalue()[:-1]


# ---------------------------------------------------------------------------------------------------- R1-Searcher
# Prompt text as released in R1-Searcher's OpenRLHF-RAG/openrlhf/datasets/prompts_dataset.py (verbatim).
_R1_BASE_INSTRUCTIONS = (
    "The User asks a question, and the Assistant solves it.\n"
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with the final "
    "answer.\n"
    "The output format of reasoning process and final answer are enclosed within <think> </think> and <answer> "
    "</answer> tags, respectively, i.e., \"<think> reasoning process here </think>\n\n<answer> final answer here "
    "</answer>\".\n"
    "During the thinking process, **the Assistant can perform searching** for uncertain knowledge if necessary with "
    "the format of \"<|begin_of_query|> search query (only list keywords, such as **\"keyword_1 keyword_2 ...\"**)"
    "<|end_of_query|>\". **A query must involve only a single triple**.\n"
    "Then, the search system will provide the Assistant with the retrieval information with the format of "
    "\"<|begin_of_documents|> ...search results... <|end_of_documents|>\"."
)
_R1_CHAT_SYSTEM = (
    "You are a helpful assistant.\n"
    "Given a question, you should answer it by first thinking about the reasoning process in the mind and then "
    "providing the final answer.\n"
    "The output format of reasoning process and final answer are enclosed within <think> </think> and <answer> "
    "</answer> tags, respectively, i.e., \"<think> reasoning process here </think>\n\n<answer> final answer here "
    "</answer>\".\n"
    "During the thinking process, **you can perform searching for uncertain knowledge** if necessary with the format "
    "of \"<|begin_of_query|> search query (only list keywords, such as **\"keyword_1 keyword_2 ...\"**)"
    "<|end_of_query|>\". **A query must involve only a single triple**.\n"
    "Then, the search system will provide you with the retrieval information with the format of "
    "\"<|begin_of_documents|> ...search results... <|end_of_documents|>\"."
)


# The prompt of R1-Searcher's released evaluation, ``base_prompt_v0`` of evaluation/eval_search_loacl.py:58-62
# (selected by evaluation/gen_search.sh:1 ``--prompt_type v0``, used at eval_search_loacl.py:85-88); it differs
# from the training prompt above ("(only keywords) here", "the system will provide ... with helpful information").
_R1_EVAL_V0 = (
    "The User asks a question, and the Assistant solves it.\n"
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with the final "
    "answer.\n"
    "The output format of reasoning process and final answer are enclosed within <think> </think> and <answer> "
    "</answer> tags, respectively, i.e., \"<think> reasoning process here </think>\n\n<answer> final answer here "
    "</answer>\".\n"
    "During the thinking process, the Assistant can perform searching for uncertain knowledge if necessary with the "
    "format of \"<|begin_of_query|> search query (only keywords) here <|end_of_query|>\". **A query must involve only "
    "a single triple**.\n"
    "Then, the system will provide the Assistant with helpful information with the format of "
    "\"<|begin_of_documents|> ...search results... <|end_of_documents|>\"."
)


@register_protocol
class R1SearcherProtocol(Protocol):
    """R1-Searcher (arXiv 2503.05592, sec. 3.1 "Data selection / Training Template" and app. A).

    Template "train" (``OpenRLHF-RAG/openrlhf/datasets/prompts_dataset.py``): base model
    ``{instructions}\\n\\nUser:{question}\\nAssistant: <think>`` (lines 24-35); chat model (``chat=True``): the
    instructions in the second person as system message, the question as user message, ``<think>`` after the
    generation prompt (lines 10-20).
    Template "eval": ``base_prompt_v0`` of the released eval script (``evaluation/eval_search_loacl.py:58-62``), plain
    text for every model, instruct ones included (the script passes the string to ``vllm.LLM.generate``, line 186,
    which applies no chat template); ``chat=True`` with it is refused.
    The question goes in as written (stripped); no "?" is added.
    Documents, as in their rollouts (checked against their Llama-3.1-8B Bamboogle trace):
    ``<|end_of_query|>`` + ``\\n\\n<|begin_of_documents|>\\n(1)Title   text\\n(2)...\\n<|end_of_documents|>\\n\\n``
    for KILT passages (``passage_format`` "kilt"), ``(1)Title: T Text:  abstract`` for the HotpotQA abstracts that
    released training serves ("hotpotqa_abstracts"; :meth:`format_passage`).
    There is no environment message: an invalid turn ends the trajectory.
    """

    name = "r1searcher"
    query_open = "<|begin_of_query|>"
    query_close = "<|end_of_query|>"
    doc_open = "\n\n<|begin_of_documents|>\n"
    doc_close = "<|end_of_documents|>\n\n"
    default_chat = False
    prompt_opens_think = True
    # Title and text are joined by three spaces in their retriever's passages (KILT 100-word chunks).
    title_separator = "   "
    passage_formats = ("kilt", "hotpotqa_abstracts")
    query_cleanings = ("r1searcher_train", "r1searcher_eval")

    def instructions(self) -> str:
        return _R1_CHAT_SYSTEM

    prompt_templates = ("train", "eval")

    def build_prompt(self, question: str, tokenizer=None, chat: Optional[bool] = False,
                     template: str = "train") -> str:
        question = self.normalize_question(question)
        self._check_template(template)
        use_chat = self.resolve_chat(chat, tokenizer)
        if template == "eval":
            if use_chat:
                raise ValueError("protocol r1searcher: the released eval prompt (base_prompt_v0) is plain text for "
                                 "every model; drop the chat template or use the training template")
            return f"{_R1_EVAL_V0}\n\nUser:{question}\nAssistant: {self.think_open}"
        if use_chat:
            messages = [{"role": "system", "content": _R1_CHAT_SYSTEM}, {"role": "user", "content": question}]
            return self._apply_chat(tokenizer, messages) + self.think_open
        return f"{_R1_BASE_INSTRUCTIONS}\n\nUser:{question}\nAssistant: {self.think_open}"

    def format_passage(self, index: int, passage: Passage) -> str:
        """One passage line, as R1-Searcher's released client writes the corpus line its retriever returns (minus the
        leading id: ``re.sub(r'^\\d+\\s+', '', doc)`` then ``f"({j+1}){doc_now}\\n"``,
        ``OpenRLHF-RAG/openrlhf/trainer/ppo_utils/experience_maker.py:1200-1201``,
        ``evaluation/eval_search_loacl.py:278-279``); newlines inside a passage become spaces (one passage per line).

        ``passage_format``:
            "kilt" (default): ``(i)Title   text`` (the KILT 100-word TSV line, ``split_kilt_to_100.py:47``);
            "hotpotqa_abstracts": ``(i)Title: T Text:  abstract``, the line of the HotpotQA 2017 abstracts TSV that
            released training serves (``train/wiki_corpus_load.py:55-56``, read whole at lines 12-16): the field is
            TSV-quoted as that file is (in double quotes, inner quotes doubled, when it holds a double quote or a
            tab: Python ``csv`` minimal quoting reproduces every one of the 12,270 abstract lines of R1-Searcher's
            published HotpotQA traces, ``data/eval_results/hotpotqa_{llama,qwen}.jsonl``).
        """
        text = " ".join(passage.text.split("\n")).strip()
        title = passage.title.strip()
        if self.passage_format == "hotpotqa_abstracts":
            return f"({index}){_tsv_field(f'Title: {title} Text:  {text}')}\n"
        body = f"{title}{self.title_separator}{text}" if title else text
        return f"({index}){body}\n"

    def clean_query(self, query: str) -> str:
        """``query_cleaning``: "r1searcher_train" removes double quotes, strips and collapses whitespace (the released
        rollout loop, ``experience_maker.py:1143-1145``); "r1searcher_eval" removes double and single quotes, turns
        tabs into spaces and removes "..." (``evaluation/eval_search_loacl.py:227-228``); "" leaves it unchanged.
        The executor treats a query that cleans to "" as an invalid action, as both released loops end the
        trajectory there (``experience_maker.py:1146,1161``; ``eval_search_loacl.py:229,242-251``)."""
        if self.query_cleaning == "r1searcher_train":
            return " ".join(query.replace('"', "").strip().split())
        if self.query_cleaning == "r1searcher_eval":
            return query.replace('"', "").replace("'", "").replace("\t", " ").replace("...", "")
        return query

    def format_passages(self, passages: Sequence[Passage]) -> str:
        return "".join(self.format_passage(i + 1, p) for i, p in enumerate(self.escape_passages(passages)))


# ------------------------------------------------------------------------------------------------------ Search-R1
_SEARCHR1_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get new "
    "information. After reasoning, if you find you lack some knowledge, you can call a search engine by <search> "
    "query </search> and it will return the top searched results between <information> and </information>. You can "
    "search as many times as your want. If you find no further external knowledge needed, you can directly provide "
    "the answer inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing "
    "</answer>. Question: {question}\n"
)
_SEARCHR1_INVALID = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.\n"
)


@register_protocol
class SearchR1Protocol(Protocol):
    """Search-R1 (arXiv 2503.09516, sec. 3.1-3.2 and table 1 template; ``search_r1/llm_agent/generation.py``).

    Prompt, as the released pipeline builds it for training and evaluation alike: the question stripped and
    completed with "?" when it lacks one (``scripts/data_process/qa_search_train_merge.py:65-67``,
    ``qa_search_test_merge.py:75-77``, ``nq_search.py:61-63``, ``infer.py:13-15``), put into the table-1 template
    (``qa_search_test_merge.py:32-36``) as the only, user, message, rendered with the POLICY's own chat template
    whenever its tokenizer has one, base models included (``verl/utils/dataset/rl_dataset.py:128-131``,
    ``infer.py:88-89``): Qwen2.5's template then adds its default system turn ("You are a helpful assistant." for
    the base models, "You are Qwen, created by Alibaba Cloud. ..." for instruct; ``shared/data/traces/
    searchr1_case.txt``). ``chat=None`` does exactly that and needs the policy's tokenizer. Documents:
    ``\\n\\n<information>Doc 1(Title: T) text\\nDoc 2(Title: T) text</information>\\n\\n``
    (their ``_passages2string`` then ``.strip()``); wiki-18 titles are written in double quotes, as in their corpus.
    An invalid action gets their environment message and the loop continues.
    """

    name = "searchr1"
    query_open = "<search>"
    query_close = "</search>"
    doc_open = "\n\n<information>"
    doc_close = "</information>\n\n"
    default_chat = True
    # wiki-18 ``contents`` start with the title in double quotes; Search-R1 writes that first line as the title.
    quote_titles = True
    # the user message, table 1 of the paper ({question} filled in); subclasses may swap it
    template_text = _SEARCHR1_TEMPLATE

    def instructions(self) -> str:
        return self.template_text.format(question="").rstrip()

    def normalize_question(self, question: str) -> str:
        """Stripped, with "?" appended when the last character is not one (their data scripts and ``infer.py``)."""
        question = self._check_question(question)
        return question if question.endswith("?") else question + "?"

    def resolve_chat(self, chat: Optional[bool], tokenizer=None) -> bool:
        """``chat=None``: the chat template exactly when the policy's tokenizer has one (``rl_dataset.py:128-131``).

        Raises:
            ValueError: ``chat=None`` without a tokenizer: whether and how to render depends on the policy's own
                tokenizer, which is not guessed.
        """
        if chat is None:
            if tokenizer is None:
                raise ValueError("protocol searchr1: prompts are rendered with the policy's own chat template; give "
                                 "the policy's tokenizer (--tokenizer PATH) or ask for the plain-text prompt "
                                 "(--no_chat_template)")
            return bool(getattr(tokenizer, "chat_template", None))
        return super().resolve_chat(chat, tokenizer)

    def build_prompt(self, question: str, tokenizer=None, chat: Optional[bool] = False,
                     template: str = "train") -> str:
        self._check_template(template)  # one prompt for training and evaluation (evaluate.sh reads test.parquet)
        content = self.template_text.format(question=self.normalize_question(question))
        if self.resolve_chat(chat, tokenizer):
            return self._apply_chat(tokenizer, [{"role": "user", "content": content}])
        return content

    def format_passage(self, index: int, passage: Passage) -> str:
        """``Doc i(Title: "T") text`` (their ``_passages2string``); the title is quoted unless it already is."""
        title = passage.title.strip()
        if self.quote_titles and title and not (len(title) >= 2 and title[0] == title[-1] == '"'):
            title = f'"{title}"'
        return f"Doc {index}(Title: {title}) {passage.text.strip()}"

    def format_passages(self, passages: Sequence[Passage]) -> str:
        return "\n".join(self.format_passage(i + 1, p) for i, p in enumerate(self.escape_passages(passages)))

    def invalid_action_message(self) -> Optional[str]:
        return _SEARCHR1_INVALID


# ------------------------------------------------------------------------------------------- Search-R1, short prompt
_SEARCHR1_SHORT_TEMPLATE = (
    "Answer the question. Think inside <think> and </think>. To search, write <search> query </search>; the results "
    "come back between <information> and </information>. Give the final answer between <answer> and </answer>, "
    "e.g. <answer> Beijing </answer>. Question: {question}\n"
)


@register_protocol
class SearchR1ShortProtocol(SearchR1Protocol):
    """Search-R1's tags, documents block, "?" completion and invalid-action message with a shorter instruction (57
    tokens instead of 110 with SmolLM2's tokenizer): every trajectory of the CPU main job re-reads the prompt at each
    turn and in every log-prob pass, and on 2 CPU cores the prompt is a large share of the step time. Not a paper
    setting: the launchers and the evaluation of the papers' tables use ``searchr1`` (table 1's template, verbatim)."""

    name = "searchr1_short"
    template_text = _SEARCHR1_SHORT_TEMPLATE


# ------------------------------------------------------------------------------ Search-R1, short prompt, bare answer
_SEARCHR1_BARE_TEMPLATE = (
    "Answer the question. Think inside <think> and </think>. To search, write <search> query </search>; the results "
    "come back between <information> and </information>. Give the final answer between <answer> and </answer>: only "
    "the name or code as written in the results, no sentence, e.g. <answer> Beijing </answer>. Question: {question}\n"
)


@register_protocol
class SearchR1BareProtocol(SearchR1ShortProtocol):
    """``searchr1_short`` whose instruction asks for the bare answer span (the name or code as the results write it,
    no sentence), the form Search-R1's exact-match reward (arXiv 2503.09516 eq. 4) and EM scoring need; everything
    else (tags, documents block, "?" completion, invalid-action message) is ``searchr1_short``'s. Not a paper setting:
    an instruction variant of the CPU main job (``--search.protocol searchr1_bare``)."""

    name = "searchr1_bare"
    template_text = _SEARCHR1_BARE_TEMPLATE


# ------------------------------------------------------------------------------ the same without the search tool
_SEARCHR1_BARE_NOSEARCH_TEMPLATE = (
    "Answer the question. Think inside <think> and </think>. Give the final answer between <answer> and </answer>: "
    "only the name or code, no sentence, e.g. <answer> Beijing </answer>. Question: {question}\n"
)


@register_protocol
class SearchR1BareNoSearchProtocol(SearchR1BareProtocol):
    """``searchr1_bare`` whose instruction offers no search tool: the policy answers from what it knows. With
    ``--search.max_turns 1`` no search is ever made (a trajectory that writes one ends unanswered), as in Search-R1's
    RL-without-search baseline (arXiv 2503.09516, "R1"). Not a paper setting: the CPU main job's no-search arm."""

    name = "searchr1_bare_nosearch"
    template_text = _SEARCHR1_BARE_NOSEARCH_TEMPLATE
