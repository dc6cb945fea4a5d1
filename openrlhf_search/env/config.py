"""Configuration of the search environment, one object shared by every rollout process.

Every field documents its unit, default and where the default comes from (TRL style). The config travels to the
executors inside vLLM Ray actors as JSON in the environment variable ``OPENRLHF_SEARCH_CONFIG`` (the actors build
``AgentExecutor()`` with no arguments, so the environment is the one channel into them).
"""

import argparse
import dataclasses
import json
import math
import os
import typing
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional

ENV_VAR = "OPENRLHF_SEARCH_CONFIG"


class ConfigError(ValueError):
    """A search config field has an invalid value; the message names the field."""


def _is_http_url(url) -> bool:
    """``http(s)://host[:port][/path]`` with a host and, if given, a valid port."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        return False
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # raises ValueError on a port that is not a number in [0, 65535]
    except ValueError:
        return False
    return bool(parts.hostname)


@dataclass
class SearchConfig:
    """Search environment and reward settings.

    Attributes:
        protocol: tag set and prompt, "r1searcher" (R1-Searcher, arXiv 2503.05592 sec. 3) or "searchr1"
            (Search-R1, arXiv 2503.09516 sec. 3); any name registered with ``protocol.register_protocol``.
        chat_template: True to wrap the prompt with the tokenizer's chat template (instruct models), False for the
            base-model prompt. None: "searchr1" uses the chat template, "r1searcher" the base prompt.
        retriever_urls: base URLs of retriever services (``http://127.0.0.1:8000``); requests are spread over them.
        topk: passages per query. 3 in both papers' training.
        max_turns: maximum model turns (generation calls) per trajectory. Search-R1 uses 4; R1-Searcher allows up
            to 8 retrievals.
        max_new_tokens_per_turn: cap on tokens generated in one turn. 500 in Search-R1.
        max_obs_tokens: cap on tokens of one retrieved-documents block (cut as ``obs_cut`` says); None or 0: no
            cap, the block is appended whole (R1-Searcher's released rollout loop,
            ``OpenRLHF-RAG/openrlhf/trainer/ppo_utils/experience_maker.py:1196-1207``, and eval,
            ``evaluation/eval_search_loacl.py:275-285``). 500 in Search-R1 (``max_obs_length``). 0 is stored as None.
        obs_cut: how a block over ``max_obs_tokens`` is cut. "body" (default): the passages are cut and the closing
            tag kept, so the policy always sees a closed block. "block": the first ``max_obs_tokens`` tokens of the
            whole block, tokenised as one string, closing tag included in what can be cut (Search-R1's released
            ``_process_next_obs``, ``search_r1/llm_agent/generation.py:80-89``, over the block of line 391).
        passage_format: how the protocol writes one passage; "" = the protocol's default. R1-Searcher: "kilt"
            (default, ``(i)Title   text``: its KILT TSV line, ``wiki_corpus_index_bulid/split_kilt_to_100.py:47``) or
            "hotpotqa_abstracts" (``(i)Title: T Text:  abstract``, the HotpotQA 2017 abstracts TSV line its released
            training serves, TSV-quoted as that file is; ``Protocol.passage_formats``).
        query_cleaning: what the protocol does to a query before retrieval; "" = nothing beyond stripping.
            R1-Searcher: "r1searcher_train" (double quotes removed, whitespace collapsed: the released rollout loop,
            ``experience_maker.py:1143-1145``) or "r1searcher_eval" (quotes, tabs and "..." removed:
            ``evaluation/eval_search_loacl.py:227-228``); ``Protocol.query_cleanings``.
        mask_retrieved: True (default): the loss covers only the tokens the policy sampled; the documents blocks
            and other environment tokens get none (Search-R1 sec. 3.1, released ``state_masking=true``,
            ``train_ppo.sh:61``; R1-Searcher sec. 3.2). False: every response token after the prompt is an action
            token, the "w/o retrieved-token masking" ablation of Search-R1 (its table 4). Do not combine with the
            off-policy correction (``--algo.advantage.is_correction_*``): environment tokens have no sampled
            log-prob.
        group_norm_zero_pad: with ``--algo.advantage.estimator group_norm``, normalise each prompt's samples in rows
            of n_samples_per_prompt values holding n/2 of its samples and n/2 zeros, as R1-Searcher's released Llama
            stage 1 did (its reward server returns ``[score, 0]`` per sample,
            ``train/reward_server_llama_stage1.py:226``; ``openrlhf_search.rl.advantages.zero_padded_group_norm``).
        max_tool_calls_per_turn: native tool-call protocols (``chat_tools``): the calls of one assistant message
            that are run; each call after them gets an invalid-call tool message and is neither searched nor paid
            (a policy that writes 40 calls in one message must not cost 40 web searches). Default 4; the papers'
            tag protocols search once per turn and ignore it.
        max_query_chars: queries longer than this are cut before retrieval (characters). Default 1000.
        retrieval_timeout_s: wall-clock deadline of one request attempt to the retriever (sending to the parsed
            answer; a server that keeps dribbling bytes is cut off at it), seconds. Default 30.
        retrieval_max_retries: retries of a failed request (with exponential backoff) before the samples waiting on
            it are marked failed. Default 4.
        retrieval_backoff_s: first backoff delay in seconds, doubled on each retry. Default 0.5.
        coalesce_window_ms: queries from concurrent samples that arrive within this window go out in one HTTP
            request, milliseconds. Default 5.
        max_batch_queries: most queries in one HTTP request. Default 256.
        reward_scheme: name of the reward function in ``openrlhf_search.env.rewards.REWARD_SCHEMES``.
        answer_max_words: R1-Searcher's format rule: an answer longer than this many words is a format error.
        stop_at_answer: True (default): a turn also stops at the answer's closing tag (``protocol.stop_strings``).
            False: only at the end-of-query tag, as R1-Searcher's released rollout loop does
            (``OpenRLHF-RAG/openrlhf/trainer/ppo_utils/experience_maker.py:1087,1105``): the policy may write on
            after ``</answer>`` until EOS or the turn's token cap, and the released format checks score that text.
    """

    # metadata["help"]: the one line ``--help`` shows for ``--search.<field>`` (unit; the papers' released values,
    # docs/parity.md gives file and line); the Attributes above say more.
    protocol: str = field(default="r1searcher", metadata={
        "help": "tag set and prompt, a registered name; papers: r1searcher (R1-Searcher), searchr1 (Search-R1)"})
    chat_template: Optional[bool] = field(default=None, metadata={
        "help": "wrap the prompt in the tokenizer's chat template, true/false/auto (auto: searchr1 true, "
                "r1searcher false); papers: Search-R1 true, R1-Searcher Qwen false, Llama true"})
    retriever_urls: List[str] = field(default_factory=lambda: ["http://127.0.0.1:8000"], metadata={
        "help": "retriever base URLs, comma-separated, requests spread over them; papers: one server"})
    topk: int = field(default=3, metadata={"help": "passages per query; papers: 3"})
    max_turns: int = field(default=8, metadata={
        "help": "generation calls per trajectory; papers: Search-R1 5 (4 with search + 1), R1-Searcher 9"})
    max_new_tokens_per_turn: int = field(default=500, metadata={
        "help": "tokens one generation call may sample; papers: Search-R1 500, R1-Searcher 512"})
    max_obs_tokens: Optional[int] = field(default=500, metadata={
        "help": "tokens of one documents block, 0 = no cap; papers: Search-R1 500, R1-Searcher no cap"})
    max_tool_calls_per_turn: int = field(default=4, metadata={
        "help": "chat_tools: tool calls of one message that are run, the others get an invalid-call message; "
                "papers: one search per turn"})
    max_query_chars: int = field(default=1000, metadata={
        "help": "characters a query is cut to before retrieval; not a paper setting"})
    retrieval_timeout_s: float = field(default=30.0, metadata={
        "help": "seconds one retriever request attempt may take in all; not a paper setting"})
    retrieval_max_retries: int = field(default=4, metadata={
        "help": "retries of a failed retriever request before its samples fail; not a paper setting"})
    retrieval_backoff_s: float = field(default=0.5, metadata={
        "help": "seconds before the first retry, doubled on each; not a paper setting"})
    coalesce_window_ms: float = field(default=5.0, metadata={
        "help": "milliseconds in which concurrent queries join one request; papers batch per turn instead"})
    max_batch_queries: int = field(default=256, metadata={
        "help": "most queries in one retriever request; not a paper setting"})
    reward_scheme: str = field(default="r1searcher_stage2", metadata={
        "help": "reward function, a name in openrlhf_search.env.rewards.REWARD_SCHEMES; papers: Search-R1 searchr1_em, "
                "R1-Searcher r1searcher_stage1 then r1searcher_stage2"})
    answer_max_words: int = field(default=10, metadata={
        "help": "words an answer may have before R1-Searcher's format check fails it; paper: 10"})
    stop_at_answer: bool = field(default=True, metadata={
        "help": "a turn also stops at the answer's closing tag, true/false; R1-Searcher released: false"})
    obs_cut: str = field(default="body", metadata={
        "help": "how a block over max_obs_tokens is cut: body (closing tag kept) or block; Search-R1 released: "
                "block"})
    passage_format: str = field(default="", metadata={
        "help": "how one passage is written, '' = the protocol's; R1-Searcher released training: "
                "hotpotqa_abstracts"})
    query_cleaning: str = field(default="", metadata={
        "help": "what is done to a query before retrieval, '' = strip only; R1-Searcher released: r1searcher_train "
                "(training), r1searcher_eval (evaluation)"})
    mask_retrieved: bool = field(default=True, metadata={
        "help": "retrieved tokens get no loss, true/false; false trains on the whole response (the masking "
                "ablation); papers: true (Search-R1 released state_masking=true, train_ppo.sh:61; R1-Searcher "
                "retrieve-mask)"})
    group_norm_zero_pad: bool = field(default=False, metadata={
        "help": "group_norm over each group padded with as many zeros, true/false; R1-Searcher released: true for "
                "Llama stage 1 only"})

    def __post_init__(self):
        self.validate()

    def validate(self) -> "SearchConfig":
        """Check every field; raises ConfigError naming the first bad field."""
        if self.max_obs_tokens == 0 and not isinstance(self.max_obs_tokens, bool):
            self.max_obs_tokens = None  # 0 on the command line: no cap
        positive_ints = ["topk", "max_turns", "max_new_tokens_per_turn", "max_query_chars", "max_tool_calls_per_turn",
                         "max_batch_queries", "answer_max_words"] + (["max_obs_tokens"] if self.max_obs_tokens
                                                                      is not None else [])
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"search config: {name} must be a positive integer, got {value!r}")
        # finite: an infinite backoff or coalescing window would hang every rollout; NaN compares False to all
        for name in ["retrieval_timeout_s", "retrieval_backoff_s", "coalesce_window_ms"]:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value < 0 or (name == "retrieval_timeout_s" and value == 0):
                kind = "positive" if name == "retrieval_timeout_s" else "non-negative"
                raise ConfigError(f"search config: {name} must be a finite {kind} number, got {value!r}")
        if not isinstance(self.retrieval_max_retries, int) or isinstance(self.retrieval_max_retries, bool) \
                or self.retrieval_max_retries < 0:
            raise ConfigError(f"search config: retrieval_max_retries must be >= 0, got {self.retrieval_max_retries!r}")
        if not isinstance(self.stop_at_answer, bool):
            raise ConfigError(f"search config: stop_at_answer must be true or false, got {self.stop_at_answer!r}")
        if not isinstance(self.group_norm_zero_pad, bool):
            raise ConfigError(f"search config: group_norm_zero_pad must be true or false, "
                              f"got {self.group_norm_zero_pad!r}")
        if self.obs_cut not in ("body", "block"):
            raise ConfigError(f"search config: obs_cut must be 'body' or 'block', got {self.obs_cut!r}")
        for name in ("passage_format", "query_cleaning"):  # the protocol checks the names (Protocol.with_options)
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"search config: {name} must be a name, got {getattr(self, name)!r}")
        if self.chat_template is not None and not isinstance(self.chat_template, bool):  # "false" is truthy
            raise ConfigError(f"search config: chat_template must be true, false or null, got {self.chat_template!r}")
        if isinstance(self.retriever_urls, str):  # "URL1, URL2" from a command line
            self.retriever_urls = [u.strip() for u in self.retriever_urls.split(",") if u.strip()]
        if not isinstance(self.retriever_urls, list) or not self.retriever_urls \
                or not all(_is_http_url(u) for u in self.retriever_urls):
            raise ConfigError(f"search config: retriever_urls must be http(s) URLs with a host, "
                              f"got {self.retriever_urls!r}")
        if not isinstance(self.protocol, str) or not self.protocol:
            raise ConfigError(f"search config: protocol must be a name, got {self.protocol!r}")
        return self

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "SearchConfig":
        """Build from a dict; unknown keys raise ConfigError (a typo must not be silently ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"search config: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "SearchConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"search config: not valid JSON ({e})") from e
        if not isinstance(data, dict):
            raise ConfigError("search config: JSON must be an object")
        return cls.from_dict(data)

    @classmethod
    def from_file(cls, path: str) -> "SearchConfig":
        """Read a JSON object of fields (what :meth:`to_json` writes; unset fields keep their defaults).
        Raises ConfigError naming the file when it cannot be read or holds a bad field."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"search config file {path}: {e.strerror or e}") from None
        try:
            return cls.from_json(text)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_env(cls, default: Optional["SearchConfig"] = None) -> "SearchConfig":
        """Read ``OPENRLHF_SEARCH_CONFIG``; without it return ``default`` (or the defaults)."""
        text = os.environ.get(ENV_VAR)
        if not text:
            return default if default is not None else cls()
        return cls.from_json(text)


def field_default(name: str) -> Any:
    """The default of SearchConfig field ``name`` (the one place it is declared). Raises KeyError for no such
    field."""
    fields = {f.name: f for f in dataclasses.fields(SearchConfig)}
    if name not in fields:
        raise KeyError(f"SearchConfig has no field {name!r}")
    f = fields[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def flag_help(name: str, default_note: Optional[str] = None) -> str:
    """The one-line ``--help`` text of a search flag: the field's ``metadata["help"]`` (what it sets, its unit, the
    papers' values) and its default as typed on the command line (``default_note``: what an unset flag means
    instead, for a command that starts from other values, e.g. ``cli.eval``'s paper settings).

    Raises:
        KeyError: ``name`` is not a SearchConfig field, or the field has no help text.
    """
    default = field_default(name)
    f = next(f for f in dataclasses.fields(SearchConfig) if f.name == name)
    if not f.metadata.get("help"):
        raise KeyError(f"SearchConfig.{name} has no metadata['help']: give it a one-line help")
    if isinstance(default, bool):
        shown = str(default).lower()
    elif isinstance(default, list):
        shown = ",".join(default)
    else:
        shown = {None: "auto", "": "''"}.get(default, default)
    if default_note:
        return f"{f.metadata['help']} (default {default_note}; SearchConfig's: {shown})"
    return f"{f.metadata['help']} (default {shown})"


def parse_bool_or_auto(text: str) -> Optional[bool]:
    """A command-line boolean: true/false (1/0, yes/no, on/off) or auto (None). Raises ArgumentTypeError."""
    value = text.strip().lower()
    if value in ("auto", "none", ""):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false/auto, got {text!r}")


def _flag_type(name: str):
    """The argparse ``type`` of a field's flag, from its annotation."""
    hint = typing.get_type_hints(SearchConfig)[name]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool or (origin is typing.Union and bool in args):
        return parse_bool_or_auto
    if hint in (int, float, str):
        return hint
    if origin is typing.Union and int in args:  # Optional[int]: the field's doc says what 0 means
        return int
    return str  # retriever_urls: comma-separated, split by SearchConfig.validate


def search_flag_dest(name: str, prefix: str = "--search.", names: Optional[Mapping[str, str]] = None) -> str:
    """The argparse ``dest`` of field ``name``'s flag (``search.max_turns``; ``max_new_tokens`` where ``names``
    spells ``max_new_tokens_per_turn`` so)."""
    return (prefix + (names or {}).get(name, name)).lstrip("-").replace("-", "_")


def add_search_config_arguments(parser, prefix: str = "--search.", only: Optional[Iterable[str]] = None,
                                names: Optional[Mapping[str, str]] = None, switches: bool = False,
                                field_defaults: bool = False, notes: Optional[Mapping[str, str]] = None,
                                default_note: Optional[str] = None) -> Dict[str, str]:
    """Add one flag per SearchConfig field to ``parser`` (an ArgumentParser or an argument group): the one place a
    command declares search settings, so every flag's default and help are the field's own.

    Args:
        prefix: ``--search.`` (``cli.train``: ``--search.max_turns``) or ``--`` (``cli.eval``: ``--max_turns``).
        only: these fields, in this order (default: all of them).
        names: field -> flag name after the prefix where a command spells it otherwise
            (``max_new_tokens_per_turn`` -> ``max_new_tokens``; :data:`FLAT_FLAG_NAMES`).
        switches: booleans as a ``--X`` / ``--no_X`` pair (default: one flag taking true/false/auto).
        field_defaults: the flags default to the field's default (shown by ``--help``); otherwise to None, "unset",
            which :func:`search_config_from_args` fills from its ``base`` (SearchConfig's defaults, or a command's
            deliberate overrides such as the papers' eval settings).
        notes: field -> text appended to its help (what the command does with the value beyond SearchConfig).
        default_note: what an unset flag means when it is not SearchConfig's default (``flag_help``).
    Returns:
        field -> argparse dest of its flag.
    Raises:
        KeyError: an unknown field in ``only``.
    """
    fields = [f.name for f in dataclasses.fields(SearchConfig)]
    chosen = list(only) if only is not None else fields
    for name in chosen:
        if name not in fields:
            raise KeyError(f"SearchConfig has no field {name!r}")
    dests = {}
    for name in chosen:
        flag = prefix + (names or {}).get(name, name)
        dest = search_flag_dest(name, prefix, names)
        default = field_default(name) if field_defaults else None
        text = flag_help(name, None if field_defaults else default_note) + ((notes or {}).get(name) or "")
        kind = _flag_type(name)
        if switches and kind is parse_bool_or_auto:
            pair = parser.add_mutually_exclusive_group()
            pair.add_argument(flag, dest=dest, action="store_true", default=default, help=text)
            pair.add_argument(prefix + "no_" + flag[len(prefix):], dest=dest, action="store_false", default=default,
                              help=f"the opposite of {flag}")
        else:
            parser.add_argument(flag, dest=dest, type=kind, default=default, help=text)
        dests[name] = dest
    return dests


#: the flag names of ``cli.eval`` and ``cli.prepare_data`` (prefix ``--``) that are not their field's name
FLAT_FLAG_NAMES = {"retriever_urls": "retriever_url", "max_new_tokens_per_turn": "max_new_tokens"}


def search_config_from_args(args, prefix: str = "--search.", names: Optional[Mapping[str, str]] = None,
                            only: Optional[Iterable[str]] = None, base: Optional[SearchConfig] = None,
                            **overrides) -> SearchConfig:
    """The SearchConfig of parsed flags (:func:`add_search_config_arguments`): each flag given (not None) replaces
    ``base``'s value (default ``SearchConfig()``: every field's own default); ``overrides`` win over both.

    ``args`` may be flat (``getattr(args, "search.max_turns")``) or grouped as OpenRLHF's parser leaves it
    (``args.search.max_turns``); a field whose flag the command does not have keeps ``base``'s value.

    Raises:
        ConfigError: a value SearchConfig refuses (the message names the field).
    """
    fields = [f.name for f in dataclasses.fields(SearchConfig)]
    given: Dict[str, Any] = {}
    for name in (list(only) if only is not None else fields):
        dest = search_flag_dest(name, prefix, names)
        group, _, leaf = dest.rpartition(".")
        holder = getattr(args, group, None) if group and not hasattr(args, dest) else None
        value = getattr(holder, leaf, None) if holder is not None else getattr(args, dest, None)
        if value is not None:
            given[name] = value
    given.update(overrides)
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise ConfigError(f"search config: unknown field(s) {unknown}; known: {sorted(fields)}")
    return dataclasses.replace(base if base is not None else SearchConfig(), **given)


# One line per ``--reward.*`` flag of OpenRLHF's own parser (``openrlhf_search.cli.train``): what it does on the
# search path and what the papers' runs use. Rewards here are rule-based and computed by the executor
# (``--search.reward_scheme``); Search-R1 scores with ``qa_em.compute_score_em`` (verl/trainer/main_ppo.py:27) and
# R1-Searcher with rule-based reward servers (train/reward_server_*.py), neither with a reward model.
REWARD_FLAG_HELP = {
    "--reward.model_name_or_path": "reward model (HF name or path); unused by the search path and by both papers, "
                                   "whose rewards are rules (--search.reward_scheme)",
    "--reward.remote_url": "OpenRLHF's remote reward (HTTP URL or a reward_func .py); the search executor scores "
                           "itself, openrlhf_search/env/reward_func.py serves single-turn baselines; R1-Searcher "
                           "released: its rule-based reward server, reproduced as r1searcher_released_* schemes",
    "--reward.num_nodes": "nodes of a reward model; unused without --reward.model_name_or_path (both papers)",
    "--reward.num_gpus_per_node": "GPUs per node of a reward model; unused without --reward.model_name_or_path "
                                  "(both papers)",
    "--reward.offload": "offload the reward model to CPU; unused without --reward.model_name_or_path (both papers)",
    "--reward.normalize_enable": "normalise rewards by a running std (OpenRLHF); off in every launcher here, no paper "
                                 "value recorded",
    "--reward.clip_range": "rewards clipped to [low, high], reward units (default -10 10); the built-in schemes score "
                           "within [-2, 2], so the default never clips them; no paper value recorded",
    "--reward.stop_properly_penalty_coef": "reward of a trajectory whose last turn hit its token cap: >= 0 scales "
                                           "it, < 0 replaces it (default none: unchanged); not set by the launchers "
                                           "here, no paper value recorded",
}


def document_reward_flags(parser) -> None:
    """Replace the help of OpenRLHF's ``--reward.*`` flags listed in :data:`REWARD_FLAG_HELP` (the parser is built by
    OpenRLHF's own code); flags the parser does not have are skipped."""
    for action in parser._actions:
        for flag in action.option_strings:
            if flag in REWARD_FLAG_HELP:
                action.help = REWARD_FLAG_HELP[flag]
