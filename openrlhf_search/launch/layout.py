"""GPU layouts of the training launchers: which GPUs train, which generate, and whether the batch sizes fit them.

Two checks a run would otherwise meet only after Ray, DeepSpeed and vLLM have started (minutes, on booked GPUs):
DeepSpeed's ``train_batch_size == micro_batch x gradient_accumulation x world_size`` (``deepspeed/runtime/config.py``
``_batch_assertion``; the world is the actor's data-parallel ranks), and rollout micro-batches of a step that divide
evenly over those ranks (``PPORayActorGroup.async_run_method_batch``) in whole updates (``--train.batch_size``).

:func:`batch_layout_problems` lists what fails; :func:`working_layouts` names the NNODES x GPUS layouts that pass;
:func:`choose_layout` is what ``examples/scripts/common.sh`` runs: every GPU colocated (with sleep mode) when the
batch sizes fit all of them, else the most actor GPUs per node that fit, vLLM on the rest (no critic: a synchronous
PPO critic would need GPUs of its own). Asynchronous (``ASYNC=1``): vLLM on GPUs of its own, the DeepSpeed models
colocated on the others, the split closest to half that fits.
"""

import argparse
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from openrlhf_search.rl.shared_reference import starts_reference_model


CANDIDATE_NODES = (1, 2, 4)
CANDIDATE_GPUS = tuple(range(1, 9))


class LayoutError(ValueError):
    """A layout the batch sizes cannot use; the message is one line naming the flag and the layouts that work."""


def batch_layout_problems(ranks: int, train_batch: int, train_micro: int, rollout_samples: int,
                          rollout_micro: int) -> List[str]:
    """Why ``ranks`` data-parallel actor ranks cannot run these batch sizes (empty list: they can).

    Args:
        ranks: actor data-parallel ranks (GPUs / ring size / DeepSpeed TP).
        train_batch: ``--train.batch_size`` (samples per optimizer step).
        train_micro: ``--train.micro_batch_size`` (samples per rank per forward).
        rollout_samples: samples per training step (``--rollout.batch_size x --rollout.n_samples_per_prompt``).
        rollout_micro: ``--rollout.micro_batch_size``.
    """
    out = []
    if train_batch % (train_micro * ranks):
        out.append(f"--train.batch_size {train_batch} is not a multiple of --train.micro_batch_size {train_micro} x "
                   f"{ranks} actor ranks (DeepSpeed: train_batch_size == micro x grad_accum x world)")
    if rollout_samples % train_batch:
        out.append(f"the {rollout_samples} samples of a step (--rollout.batch_size x --rollout.n_samples_per_prompt) "
                   f"are not whole updates of --train.batch_size {train_batch}")
    if rollout_samples % rollout_micro:
        out.append(f"the {rollout_samples} samples of a step are not a multiple of --rollout.micro_batch_size "
                   f"{rollout_micro}")
    elif (rollout_samples // rollout_micro) % ranks:
        out.append(f"the {rollout_samples // rollout_micro} rollout micro-batches of a step "
                   f"(--rollout.micro_batch_size {rollout_micro}) do not divide over {ranks} actor ranks")
    return out


def working_layouts(train_batch: int, train_micro: int, rollout_samples: int, rollout_micro: int,
                    ranks_per_gpu: float = 1.0, nodes: Sequence[int] = CANDIDATE_NODES,
                    gpus: Sequence[int] = CANDIDATE_GPUS) -> List[Tuple[int, int]]:
    """(nodes, actor GPUs per node) pairs whose ranks pass :func:`batch_layout_problems`."""
    ok = []
    for n in nodes:
        for g in gpus:
            ranks = int(n * g * ranks_per_gpu)
            if ranks >= 1 and n * g * ranks_per_gpu == ranks and not batch_layout_problems(
                    ranks, train_batch, train_micro, rollout_samples, rollout_micro):
                ok.append((n, g))
    return ok


def format_layouts(layouts: Sequence[Tuple[int, int]], limit: int = 12) -> str:
    text = ", ".join(f"{n}x{g}" for n, g in layouts[:limit])
    return (text + ", ...") if len(layouts) > limit else (text or "none up to 4x8")


# Sizes and counts that must be positive when given (0 or a negative value is a typo, not a setting).
POSITIVE_FLAGS = (
    "train.batch_size", "train.micro_batch_size", "rollout.batch_size", "rollout.micro_batch_size",
    "rollout.n_samples_per_prompt", "rollout.vllm_generate_batch_size", "rollout.max_new_tokens",
    "eval.n_samples_per_prompt", "data.max_len", "train.num_episodes", "train.max_epochs", "train.max_steps",
    "actor.num_nodes", "actor.num_gpus_per_node", "ref.num_nodes", "ref.num_gpus_per_node", "critic.num_nodes",
    "critic.num_gpus_per_node", "vllm.tensor_parallel_size", "ds.ring_attn_size", "ds.tensor_parallel_size",
    "ckpt.max_num", "search.topk", "search.max_turns", "search.max_new_tokens_per_turn",
)


def check_positive_sizes(flat_args) -> None:
    """Refuse a non-positive value of any :data:`POSITIVE_FLAGS` flag (flat ``argparse`` namespace, before
    OpenRLHF's validation, whose messages do not name the flag); raises :class:`LayoutError` naming it."""
    values = vars(flat_args)
    for name in POSITIVE_FLAGS:
        value = values.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
            raise LayoutError(f"--{name} must be a positive number, got {value}")


def check_args(args) -> None:
    """The batch checks on parsed (nested) ``train_ppo_ray`` arguments; raises :class:`LayoutError` (one line)."""
    if getattr(args.train, "dynamic_batch_enable", False):
        return  # token-budget micro-batches: OpenRLHF balances them itself
    split = (args.ds.ring_attn_size or 1) * (args.ds.tensor_parallel_size or 1)
    gpus = args.actor.num_nodes * args.actor.num_gpus_per_node
    ranks = gpus // split
    samples = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    problems = batch_layout_problems(ranks, args.train.batch_size, args.train.micro_batch_size, samples,
                                     args.rollout.micro_batch_size)
    if problems:
        good = working_layouts(args.train.batch_size, args.train.micro_batch_size, samples,
                               args.rollout.micro_batch_size, ranks_per_gpu=1.0 / split)
        raise LayoutError(f"{problems[0]}: actor layout {args.actor.num_nodes}x{args.actor.num_gpus_per_node} "
                          f"(--actor.num_nodes x --actor.num_gpus_per_node; launchers: NNODES x GPUS_PER_NODE or "
                          f"ACTOR_GPUS_PER_NODE); actor layouts that work: {format_layouts(good)}, or change the "
                          "batch sizes")


@dataclass
class Layout:
    """What common.sh's ``layout_args`` passes: actor (and reference, critic) GPUs per node, vLLM engines;
    ``asynchronous``: vLLM on GPUs of its own while the DeepSpeed models share theirs (``--train.colocate_all`` under
    ``--train.async_enable`` colocates only the DeepSpeed models, ``train_ppo_ray.py`` passes no placement group to
    vLLM then)."""

    nnodes: int
    gpus_per_node: int
    actor_gpus_per_node: int
    vllm_engines: int
    vllm_tp: int
    asynchronous: bool = False
    critic: bool = False

    @property
    def colocated(self) -> bool:
        return self.actor_gpus_per_node == self.gpus_per_node

    def describe(self) -> str:
        models = "actor, reference" + (", critic" if self.critic else "")
        if self.colocated:
            return (f"{self.nnodes} node(s) x {self.gpus_per_node} GPUs, all colocated: actor, reference (critic) and "
                    f"{self.vllm_engines} vLLM engine(s) x TP {self.vllm_tp} share every GPU (sleep mode)")
        return (f"{self.nnodes} node(s) x {self.gpus_per_node} GPUs{' (async)' if self.asynchronous else ''}: "
                f"{models} on {self.actor_gpus_per_node} GPUs per node, {self.vllm_engines} vLLM engine(s) x TP "
                f"{self.vllm_tp} on the other {self.gpus_per_node - self.actor_gpus_per_node} per node")


def _async_order(gpus_per_node: int) -> List[int]:
    """Actor GPUs per node tried in async mode: every split leaving vLLM at least one GPU, closest to half first
    (training and generation run at once), the larger share first on a tie."""
    return sorted(range(1, gpus_per_node), key=lambda a: (abs(2 * a - gpus_per_node), -a))


def _why_not(nnodes: int, gpus_per_node: int, vllm_tp: int, a: int, sizes: Tuple[int, int, int, int], critic: bool,
             asynchronous: bool) -> Optional[str]:
    """Why ``a`` actor GPUs per node cannot run (None: they can); one clause, the true reason."""
    problem = batch_layout_problems(nnodes * a, *sizes)
    if problem:
        return problem[0]
    if a == gpus_per_node:
        if asynchronous:
            return ("ASYNC=1 keeps vLLM off the training GPUs (OpenRLHF's async mode never colocates it), so the "
                    "actor cannot take all GPUS_PER_NODE")
        if (nnodes * gpus_per_node) % vllm_tp:
            return f"VLLM_TP {vllm_tp} does not divide the {nnodes * gpus_per_node} colocated GPUs"
        return None
    rest = gpus_per_node - a
    if critic and not asynchronous:
        return ("a synchronous PPO critic trains only in the colocated layout (vLLM sleeps while the actor, reference "
                "and critic train; a split layout leaves the critic no GPUs; ASYNC=1 runs it beside the actor with "
                "vLLM on GPUs of its own)")
    if rest % vllm_tp:
        return f"VLLM_TP {vllm_tp} does not divide the {rest} GPUs per node left for vLLM"
    return None


def choose_layout(nnodes: int, gpus_per_node: int, vllm_tp: int, train_batch: int, train_micro: int,
                  rollout_samples: int, rollout_micro: int, actor_gpus_per_node: Optional[int] = None,
                  critic: bool = False, asynchronous: bool = False) -> Layout:
    """The launcher's layout (see the module doc); raises :class:`LayoutError` naming the true reason and what works.

    Args:
        actor_gpus_per_node: force this many actor GPUs per node (``ACTOR_GPUS_PER_NODE``); equal to
            ``gpus_per_node`` means colocated.
        critic: a PPO critic is trained. Synchronous: only colocated (split layouts are refused). Asynchronous: it
            shares the actor's GPUs with the reference (``--train.colocate_all``), vLLM keeps its own.
        asynchronous: ``ASYNC=1``: vLLM never shares the training GPUs; without ``actor_gpus_per_node`` the split
            closest to half that fits is taken.
    """
    for name, value in (("NNODES", nnodes), ("GPUS_PER_NODE", gpus_per_node), ("VLLM_TP", vllm_tp)):
        if value <= 0:
            raise LayoutError(f"{name} must be a positive integer, got {value}")
    sizes = (train_batch, train_micro, rollout_samples, rollout_micro)
    names = format_layouts(working_layouts(*sizes))
    everything = _async_order(gpus_per_node) if asynchronous else list(range(gpus_per_node, 0, -1))

    if actor_gpus_per_node is not None:
        a = actor_gpus_per_node
        if not 1 <= a <= gpus_per_node:
            raise LayoutError(f"ACTOR_GPUS_PER_NODE {a} must be in 1..GPUS_PER_NODE {gpus_per_node}")
        candidates = [a]
    else:
        candidates = everything
    for a in candidates:
        if _why_not(nnodes, gpus_per_node, vllm_tp, a, sizes, critic, asynchronous) is None:
            engines = nnodes * (gpus_per_node if a == gpus_per_node else gpus_per_node - a) // vllm_tp
            return Layout(nnodes, gpus_per_node, a, engines, vllm_tp, asynchronous, critic)
    if not candidates:
        why = (f"ASYNC=1 needs at least 2 GPUs per node (vLLM on GPUs of its own), GPUS_PER_NODE is "
               f"{gpus_per_node}")
    else:
        why = _why_not(nnodes, gpus_per_node, vllm_tp, candidates[0], sizes, critic, asynchronous)
        fitting = [a for a in candidates if not batch_layout_problems(nnodes * a, *sizes)]
        if len(candidates) > 1 and fitting:  # the batch sizes fit some split: name what stops that one
            other = _why_not(nnodes, gpus_per_node, vllm_tp, fitting[0], sizes, critic, asynchronous)
            why = f"{other} (at {fitting[0]} actor GPUs per node; at {candidates[0]}: {why})"
    here = [a for a in everything if a not in candidates
            and _why_not(nnodes, gpus_per_node, vllm_tp, a, sizes, critic, asynchronous) is None]
    fix = f"ACTOR_GPUS_PER_NODE={here[0]} works here; " if here else ""
    raise LayoutError(f"{why}: no layout on NNODES={nnodes} x GPUS_PER_NODE={gpus_per_node} with VLLM_TP={vllm_tp}"
                      f"{f' and ACTOR_GPUS_PER_NODE={actor_gpus_per_node}' if actor_gpus_per_node else ''}"
                      f"{' (ASYNC=1)' if asynchronous else ''}; {fix}actor layouts that work for these batch sizes "
                      f"(NNODES x actor GPUs per node): {names}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="choose a launcher's GPU layout (prints shell assignments)")
    for name in ("nnodes", "gpus_per_node", "vllm_tp", "train_batch", "train_micro", "rollout_samples",
                 "rollout_micro"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--actor_gpus_per_node", type=int, default=None)
    p.add_argument("--critic", action="store_true")
    p.add_argument("--async_mode", action="store_true", help="ASYNC=1: vLLM on GPUs of its own")
    a = p.parse_args(argv)
    try:
        lay = choose_layout(a.nnodes, a.gpus_per_node, a.vllm_tp, a.train_batch, a.train_micro, a.rollout_samples,
                            a.rollout_micro, a.actor_gpus_per_node, a.critic, a.async_mode)
    except LayoutError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(f"ACTOR_GPUS={lay.actor_gpus_per_node}\nVLLM_ENGINES={lay.vllm_engines}\n"
          f"COLOCATED={int(lay.colocated)}\nLAYOUT_DESC='{lay.describe()}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def gpus_needed(args) -> int:
    """GPUs OpenRLHF's ``train()`` places for ``args``: the actor group (reference and critic on it when
    colocated; under async ``colocate_all`` the engines apart), else each model group plus the vLLM engines
    (``train_ppo_ray.py:39-110``)."""
    actor = args.actor.num_nodes * args.actor.num_gpus_per_node
    engines = (args.vllm.num_engines or 0) * args.vllm.tensor_parallel_size
    if args.train.colocate_all and not getattr(args.train, "async_enable", False):
        return actor
    shared = args.train.colocate_actor_ref or args.train.colocate_all  # async colocate_all: the DeepSpeed models
    ref = 0 if (shared or not starts_reference_model(args)) else args.ref.num_nodes * args.ref.num_gpus_per_node
    critic = (args.critic.num_nodes * args.critic.num_gpus_per_node
              if getattr(args.critic, "model_name_or_path", None) and not args.train.colocate_all else 0)
    return actor + ref + critic + engines


def wait_for_free_gpus(args, timeout_s: float = 60.0, poll_s: float = 2.0) -> None:
    """Wait until the running Ray has the GPUs the layout places (``ray.available_resources``), at most
    ``timeout_s``; raise :class:`LayoutError` (one line) otherwise, instead of OpenRLHF waiting forever in
    ``ray.get(pg.ready())``. Serve replicas and other jobs holding GPUs count as taken."""
    import time

    import ray

    if not ray.is_initialized():
        return  # nothing to ask
    need = gpus_needed(args)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            free = ray.available_resources().get("GPU", 0.0)
        except (ray.exceptions.RaySystemError, RuntimeError):
            return  # no connected Ray to ask (a driver that has not started one)
        if free + 1e-6 >= need:
            return
        if time.monotonic() >= deadline:
            total = ray.cluster_resources().get("GPU", 0.0)
            raise LayoutError(f"the layout places {need} GPUs (actor {args.actor.num_nodes}x"
                              f"{args.actor.num_gpus_per_node}, {args.vllm.num_engines} vLLM engine(s) x TP "
                              f"{args.vllm.tensor_parallel_size}) but Ray has {free:g} free of {total:g} after "
                              f"{timeout_s:g} s (Serve replicas or other jobs hold the rest): set NNODES / "
                              "GPUS_PER_NODE to what is free, or free GPUs (PLACEMENT_WAIT_S sets the wait)")
        time.sleep(poll_s)
