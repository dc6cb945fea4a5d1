"""The overlong penalty of a multi-turn search trajectory: which budget it is measured against.

DAPO's soft overlong punishment (arXiv 2503.14476 sec. 3.4), as OpenRLHF 0.11.2 implements it
(``openrlhf/trainer/ppo_utils/length_penalty.py``, ``apply_overlong_penalty``), adds to the reward of a response of
``L`` tokens, with budget ``L_max`` and buffer ``L_cache`` (``--reward.overlong_buffer_len``) and factor ``f``
(``--reward.overlong_penalty_factor``)::

    0                                          if L <= L_max - L_cache
    -min(L - (L_max - L_cache), L_cache) / L_cache * f   otherwise (at most -f)

OpenRLHF takes ``L_max = --rollout.max_new_tokens``, the limit of a single-turn response. Here ``L`` is every token
the policy sampled over all of its turns (never the retrieved passages), so the per-turn limit would punish healthy
trajectories: against ``--rollout.max_new_tokens 500`` (``examples/scripts/searchr1.sh``) with
``--reward.overlong_buffer_len 100``, three turns of 200 tokens turned a correct answer's reward 1.0 into 0.0. The
budget is therefore the most a trajectory can sample::

    L_max = --search.max_turns x --search.max_new_tokens_per_turn

applied through OpenRLHF's own ``apply_length_penalties``. A trajectory that the context limit (``--data.max_len``)
ends first is a ``context_full`` stop, not an overlong response.
"""

import copy

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)

from openrlhf_search.env.config import SearchConfig

OVERLONG_BUFFER_HELP = (
    "DAPO overlong penalty (arXiv 2503.14476 sec. 3.4): a trajectory whose policy-sampled tokens over all turns "
    "exceed L_max - buffer loses up to --reward.overlong_penalty_factor, linearly over the buffer; L_max = "
    "--search.max_turns x --search.max_new_tokens_per_turn (not --rollout.max_new_tokens; retrieved passages never "
    "count), tokens. Default: no penalty, as in both papers")
OVERLONG_FACTOR_HELP = ("largest overlong penalty, reward units, reached at L_max sampled tokens (default 1); unused "
                        "without --reward.overlong_buffer_len (both papers)")


def overlong_budget(max_turns: int, max_new_tokens_per_turn: int) -> int:
    """``L_max`` of the overlong penalty: the most tokens a trajectory can sample, ``max_turns`` generation calls of
    at most ``max_new_tokens_per_turn`` tokens each.

    Raises:
        ValueError: a count below 1.
    """
    if max_turns < 1 or max_new_tokens_per_turn < 1:
        raise ValueError(f"max_turns ({max_turns}) and max_new_tokens_per_turn ({max_new_tokens_per_turn}) must be "
                         ">= 1")
    return int(max_turns) * int(max_new_tokens_per_turn)


def overlong_budget_from_args(args) -> int:
    """:func:`overlong_budget` of ``args.search.max_turns`` / ``max_new_tokens_per_turn`` (flags left unset, None,
    take :class:`SearchConfig`'s defaults), for both the cluster and the CPU job's argument namespaces."""
    search = getattr(args, "search", None)
    turns = getattr(search, "max_turns", None)
    per_turn = getattr(search, "max_new_tokens_per_turn", None)
    return overlong_budget(SearchConfig.max_turns if turns is None else turns,
                           SearchConfig.max_new_tokens_per_turn if per_turn is None else per_turn)


def _check_buffer(buffer_len: float, budget: int) -> None:
    if not 0 < buffer_len <= budget:
        raise ValueError(f"--reward.overlong_buffer_len {buffer_len} must be in (0, {budget}], the trajectory budget "
                         "--search.max_turns x --search.max_new_tokens_per_turn")


def args_with_overlong_budget(args):
    """A shallow copy of OpenRLHF's ``args`` whose ``rollout.max_new_tokens`` is the trajectory budget, for
    OpenRLHF's ``apply_length_penalties`` (the only reader there); ``args`` itself is left as it is. Returns ``args``
    unchanged without ``--reward.overlong_buffer_len``.

    Raises:
        ValueError: the buffer is not in (0, budget].
    """
    buffer_len = getattr(getattr(args, "reward", None), "overlong_buffer_len", None)
    if buffer_len is None:
        return args
    budget = overlong_budget_from_args(args)
    _check_buffer(buffer_len, budget)
    view = copy.copy(args)
    view.rollout = copy.copy(args.rollout)
    view.rollout.max_new_tokens = budget
    return view


def check_overlong_args(args) -> None:
    """Refuse, before any rollout, a ``--reward.overlong_buffer_len`` outside (0, trajectory budget].

    Raises:
        ValueError: with a one-line message naming the flags.
    """
    buffer_len = getattr(getattr(args, "reward", None), "overlong_buffer_len", None)
    if buffer_len is not None:
        _check_buffer(buffer_len, overlong_budget_from_args(args))


def document_overlong_flags(parser) -> None:
    """Replace the help of OpenRLHF's ``--reward.overlong_*`` flags (parser built by OpenRLHF's own code) with what
    they mean for a search trajectory."""
    for action in parser._actions:
        if "--reward.overlong_buffer_len" in action.option_strings:
            action.help = OVERLONG_BUFFER_HELP
        elif "--reward.overlong_penalty_factor" in action.option_strings:
            action.help = OVERLONG_FACTOR_HELP
