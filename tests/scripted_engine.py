"""A scripted policy behind vLLM's token-in / token-out ``generate`` for executor tests.

``ScriptedEngine`` replays a scripted text for each turn of each prompt and then EOS, scripted PAST the stop strings
(fake documents, text after the answer). It applies vLLM's per-token stop rules (``max_tokens``; EOS, the generation
config's other EOS ids and ``stop_token_ids`` kept in ``token_ids`` and out of ``text``; stop strings through vLLM's
own ``check_stop_strings`` on the detokenised text, ``include_stop_str_in_output``), so what reaches a trajectory is
exactly what vLLM would return for these tokens.
"""

import math
from typing import Dict, List, Optional, Sequence

from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.engine.detokenizer import check_stop_strings


class ScriptedEngine:
    """``scripts``: prompt text -> the model's turn texts. The turn index is the number of environment blocks already
    in the context (found with the protocol), so the engine is stateless and concurrent samples are safe. Every
    scripted token gets log-prob ``peak - log(exp(peak) + V - 1)`` (a logit of ``peak`` against 0 for the other
    ``V - 1`` tokens): a small negative number. ``generation_eos``: the model's generation-config ``eos_token_id``
    list, which vLLM adds to every request's stop ids (``SamplingParams.update_from_generation_config``) whatever the
    caller asks; default the tokenizer's EOS alone.

    Raises (from ``generate``):
        RuntimeError: the context starts with no scripted prompt (and no ``default`` turns are given).
    """

    def __init__(self, tokenizer, protocol, scripts: Dict[str, Sequence[str]], peak: float = 20.0,
                 generation_eos: Sequence[int] = (), default: Optional[Sequence[str]] = None):
        self.tok, self.proto = tokenizer, protocol
        self.generation_eos = {int(t) for t in generation_eos}
        self.scripts = {prompt: self._encode(turns) for prompt, turns in scripts.items()}
        # ``default``: the turns of any other prompt (a context no scripted prompt starts is a new prompt)
        self.default = None if default is None else self._encode(default)
        vocab = len(tokenizer)
        self.logprob = peak - (peak + math.log1p((vocab - 1) * math.exp(-peak)))

    def _encode(self, turns: Sequence[str]) -> List[List[int]]:
        return [self.tok(t, add_special_tokens=False).input_ids for t in turns]

    def _script(self, prompt_token_ids: List[int]) -> List[int]:
        text = self.tok.decode(prompt_token_ids, skip_special_tokens=False)
        prompt = next((p for p in self.scripts if text.startswith(p)), None)
        if prompt is None and self.default is not None:
            prompt = text
            self.scripts[prompt] = self.default
        if prompt is None:
            raise RuntimeError(f"ScriptedEngine: context starts with no scripted prompt: {text[:80]!r}")
        turn = sum(s.kind == "environment" for s in self.proto.split_turns(text[len(prompt):]))
        turns = self.scripts[prompt]
        return (turns[turn] if turn < len(turns) else []) + [self.tok.eos_token_id]

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None) -> RequestOutput:
        params, tok = sampling_params, self.tok
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        eos = set() if params.ignore_eos else {tok.eos_token_id} | self.generation_eos
        eos |= {int(t) for t in (params.stop_token_ids or ())}
        token_ids, logprobs, text = [], [] if params.logprobs is not None else None, ""
        finish, stop_reason = "length", None
        for token in self._script(list(prompt_token_ids)):
            if params.max_tokens is not None and len(token_ids) >= params.max_tokens:
                break
            token_ids.append(token)
            if logprobs is not None:
                logprobs.append({token: Logprob(logprob=self.logprob, rank=1, decoded_token=tok.decode([token]))})
            if token in eos:  # kept in token_ids, left out of text unless asked for
                shown = token_ids if params.include_stop_str_in_output else token_ids[:-1]
                text = tok.decode(shown, skip_special_tokens=params.skip_special_tokens)
                finish = "stop"
                stop_reason = None if token == tok.eos_token_id else token  # vLLM: a stop id is the stop reason
                break
            new_text = tok.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
            same = next((i for i, (a, b) in enumerate(zip(text, new_text)) if a != b), min(len(text), len(new_text)))
            new_chars, text = len(new_text) - same, new_text
            hit = check_stop_strings(text, new_chars, stops, params.include_stop_str_in_output) if stops else None
            if hit is not None:
                stop_reason, truncate_to = hit
                text = text if truncate_to == -1 else text[:truncate_to]
                finish = "stop"
                break
        out = CompletionOutput(index=0, text=text, token_ids=token_ids,
                               cumulative_logprob=self.logprob * len(token_ids) if logprobs is not None else None,
                               logprobs=logprobs, finish_reason=finish, stop_reason=stop_reason)
        return RequestOutput(request_id="scripted", prompt=None, prompt_token_ids=list(prompt_token_ids),
                             prompt_logprobs=None, outputs=[out], finished=True)


def search_then_answer(protocol, query: str = "film", answer: str = "film") -> List[str]:
    """Two turns for any question: a search for ``query`` (text written past the closing tag, as a model would),
    then ``answer`` in the protocol's answer tags."""
    return [f" I need to search. {protocol.query_open} {query} {protocol.query_close} fake documents",
            f" Found it. {protocol.think_close} {protocol.answer_open} {answer} {protocol.answer_close} more text"]


def scripted_build_engine(protocol_name: str, turns=None, built: Optional[list] = None):
    """A stand-in for ``openrlhf_search.evaluation.engines.build_engine`` (same arguments) that loads only the
    tokenizer of the model folder (or ``tokenizer_path``) and returns a :class:`ScriptedEngine` playing ``turns``
    (default :func:`search_then_answer`) for every prompt, with backend name "scripted"; each engine is appended to
    ``built``."""
    from openrlhf_search.env.protocol import get_protocol
    from openrlhf_search.evaluation import engines

    proto = get_protocol(protocol_name)

    def build_engine(model, tokenizer_path=None, *args, **kwargs):
        tok = engines._load_tokenizer(tokenizer_path or model)
        engine = ScriptedEngine(tok, proto, {}, default=search_then_answer(proto) if turns is None else turns)
        if built is not None:
            built.append(engine)
        return engine, tok, "scripted"

    return build_engine
