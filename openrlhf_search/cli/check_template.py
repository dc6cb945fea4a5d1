"""Check a chat template against the executor: one scripted conversation rolled out token by token equals the
template's own rendering of it (``python -m openrlhf_search.cli.check_template --tokenizer PATH``).

A native-tool-call policy is trained on the tokens the executor assembled; this command shows they are the tokens
the model's template would have produced for the same conversation, and which spans the loss trains on.
"""

from __future__ import annotations

import json

from openrlhf_search.env.types import Passage

def check_template(tokenizer, protocol: str = "chat_tools", question: str = "Who wrote Hamlet?",
                   answer: str = "William Shakespeare") -> dict:
    """Roll out one scripted conversation (two search calls in one message, then the answer) through the executor
    with ``tokenizer``'s template and compare it with the template's rendering of the same conversation.

    Returns:
        {"tokens": ids, "action_ranges": spans the loss trains on, "rendered_ids": the template's ids,
        "equal": rollout == rendered minus the newline the template writes after the final end-of-turn token,
        "named_difference": "" or the one known difference (thinking off: the empty think blocks),
        "difference": "" or the first unexplained difference, "reward", "extra_logs"}.
    Raises:
        ValueError: the template does not declare tools or has no end-of-turn token (one line).
    """
    import asyncio
    from types import SimpleNamespace

    from openrlhf_search.env.agent import SearchAgentExecutor
    from openrlhf_search.env.config import SearchConfig
    from openrlhf_search.env.protocol import get_protocol

    proto = get_protocol(protocol)
    think = (lambda s: f"{proto.think_open}\n{s}\n{proto.think_close}\n\n") if proto.enable_thinking else (lambda s: "")
    queries = [question, f"{answer} author"]
    calls = "\n".join('<tool_call>\n' + json.dumps({"name": proto.function_name, "arguments": {"query": q}})
                      + '\n</tool_call>' for q in queries)
    turns = [think("I should search.") + calls + proto.end_of_turn,
             think("The passages say so.") + f"{proto.answer_open} {answer} {proto.answer_close}" + proto.end_of_turn]
    docs = {q: [Passage(str(i), f"Title {i}", f"{answer} is the answer to passage {i}.")]
            for i, q in enumerate(queries)}

    class _Client:
        async def search(self, query, topk=None):
            return docs[query]

    class _Engine:
        def __init__(self):
            self.n = 0

        async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
            ids = list(tokenizer(turns[self.n], add_special_tokens=False)["input_ids"])
            self.n += 1
            return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=None, finish_reason="stop")])

    cfg = SearchConfig(protocol=protocol, retriever_urls=["http://unused"], reward_scheme="searchr1_em",
                       max_obs_tokens=None, max_turns=4)
    prompt = proto.build_prompt(question, tokenizer)
    params = SimpleNamespace(logprobs=None, stop=None, stop_token_ids=None, max_tokens=None,
                             include_stop_str_in_output=False, output_text_buffer_length=0)
    out = asyncio.run(SearchAgentExecutor(cfg, retrieval_client=_Client()).execute(
        prompt, json.dumps([answer]), params, 100_000, tokenizer, _Engine()))
    messages = proto.messages(question) + [
        {"role": "assistant", "content": think("I should search."),
         "tool_calls": [{"type": "function", "function": {"name": proto.function_name, "arguments": {"query": q}}}
                        for q in queries]}]
    messages += [{"role": "tool", "content": proto.render_documents(docs[q])} for q in queries]
    messages += [{"role": "assistant", "content": turns[1][:-len(proto.end_of_turn)]}]
    rendered = proto._render(tokenizer, messages, add_generation_prompt=False)
    rendered_ids = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    tokens = out["observation_tokens"]
    trailing = tokenizer.decode(rendered_ids[len(tokens):], skip_special_tokens=False)
    equal = rendered_ids[:len(tokens)] == tokens and trailing.strip() == ""
    difference = named = ""
    head = proto.assistant_header
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    if not equal and not proto.enable_thinking:
        # Qwen3's template writes the empty think block after each generation prompt, but re-renders only the final
        # assistant message with it: the rollout (what the trainer sees) keeps it before every message, masked
        n = text.count(head + proto.empty_think) - 1
        if text.replace(head + proto.empty_think, head, n) == rendered.rstrip("\n"):
            named = (f"the rollout has the template's empty think block after every generation prompt; the template "
                     f"re-renders it only before the final message ({n} block(s) more in the rollout, environment "
                     f"tokens, masked)")
    if not equal and not named:
        i = next((k for k, (a, b) in enumerate(zip(tokens, rendered_ids)) if a != b), min(len(tokens),
                                                                                         len(rendered_ids)))
        difference = (f"first difference at token {i}: rollout {tokenizer.decode(tokens[i:i + 12])!r} vs template "
                      f"{tokenizer.decode(rendered_ids[i:i + 12])!r}")
    return {"tokens": tokens, "action_ranges": out["action_ranges"], "rendered_ids": rendered_ids, "equal": equal,
            "difference": difference, "named_difference": named, "reward": out["reward"],
            "extra_logs": out["extra_logs"]}


def main(argv=None) -> int:
    """``python -m openrlhf_search.cli.check_template --tokenizer PATH [--protocol chat_tools_nothink]``: render one
    scripted conversation as a rollout, print it with the spans the loss trains on in ``[[ ]]``, and say whether it
    equals the template's rendering of the same conversation. Exit 0 when equal (or for the known difference of
    thinking off), 1 when not, 2 on a template without tool support, 3 when the tokenizer cannot be loaded (not
    there, or a hub name offline and not cached: one line, no retries)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(description=main.__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="the policy's tokenizer (path or hub name)")
    p.add_argument("--protocol", default="chat_tools", help="chat_tools (thinking) | chat_tools_nothink")
    a = p.parse_args(argv)
    from openrlhf_search.cli.prepare_data import RenderingError, load_policy_tokenizer

    try:  # one hub request at most (HF_HUB_OFFLINE: none), not the hub client's minute of retries and a traceback
        tok = load_policy_tokenizer(a.tokenizer)
    except RenderingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    try:
        res = check_template(tok, a.protocol)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pieces, pos = [], 0
    for s, e in res["action_ranges"]:
        pieces.append(tok.decode(res["tokens"][pos:s], skip_special_tokens=False))
        pieces.append("[[" + tok.decode(res["tokens"][s:e], skip_special_tokens=False) + "]]")
        pos = e
    pieces.append(tok.decode(res["tokens"][pos:], skip_special_tokens=False))
    print("".join(pieces))
    print(f"\n{len(res['tokens'])} tokens, {sum(e - s for s, e in res['action_ranges'])} trained ([[ ]]), "
          f"reward {res['reward']:g}, tool calls {res['extra_logs']['tool_calls']:g}")
    if res["equal"]:
        print("rollout tokens == the template's rendering of the same conversation (but the newline after the final "
              "end-of-turn token)")
        return 0
    if res["named_difference"]:
        print(f"rollout tokens == the template's rendering but for one known difference: {res['named_difference']}")
        return 0
    print(f"rollout tokens != the template's rendering: {res['difference']}")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
