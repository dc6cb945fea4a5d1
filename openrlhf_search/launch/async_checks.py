"""Async-mode argument checks and the GPU split, for the CLI (no OpenRLHF import: ``--dry_run`` stays fast).

The async trainer itself is :mod:`openrlhf_search.rl.async_trainer`.
"""

from typing import Dict, List

from openrlhf_search.rl.shared_reference import starts_reference_model


def check_async_args(args) -> None:
    """Raise ValueError (one line) on an async setting this module does not run."""
    if not getattr(args.train, "async_enable", False):
        return
    if getattr(args.train, "async_queue_size", 1) < 1:
        raise ValueError(f"--train.async_queue_size must be >= 1, got {args.train.async_queue_size}")


def gpu_layout(args) -> Dict[str, object]:
    """GPUs each role asks Ray for under OpenRLHF 0.11.2's ``train()`` (``train_ppo_ray.py:40-141``), for the dry run.

    Colocated roles share one placement group (``--train.colocate_actor_ref`` / ``colocate_all``: actor, reference
    and, with ``colocate_all``, critic; ``colocate_critic_reward``: critic and reward model). In async mode vLLM is
    never in the placement group (``train_ppo_ray.py:56,75``), so its engines need GPUs of their own.

    Returns:
        {"mode", "groups": [{"roles", "gpus"}], "total_gpus", "line"}.
    """
    a = args
    per = lambda role: getattr(a, role).num_nodes * getattr(a, role).num_gpus_per_node
    is_async = bool(getattr(a.train, "async_enable", False))
    kl_ref = starts_reference_model(a)
    critic = bool(getattr(a.critic, "model_name_or_path", None))
    reward_model = not getattr(a.reward, "remote_url", None)
    vllm = (a.vllm.num_engines or 0) * a.vllm.tensor_parallel_size
    groups: List[Dict[str, object]] = []
    if a.train.colocate_all or a.train.colocate_actor_ref:
        roles = ["actor"] + (["ref"] if kl_ref else [])
        if a.train.colocate_all:
            roles += (["critic"] if critic else []) + (["reward"] if reward_model else [])
            if vllm and not is_async:
                roles.append("vllm")
        groups.append({"roles": roles, "gpus": per("actor")})
    else:
        groups.append({"roles": ["actor"], "gpus": per("actor")})
        if kl_ref:
            groups.append({"roles": ["ref"], "gpus": per("ref")})
    placed = {r for g in groups for r in g["roles"]}
    if critic and "critic" not in placed:
        if a.train.colocate_critic_reward and reward_model:
            groups.append({"roles": ["critic", "reward"], "gpus": per("critic")})
            placed.add("reward")
        else:
            groups.append({"roles": ["critic"], "gpus": per("critic")})
    if reward_model and "reward" not in placed:
        groups.append({"roles": ["reward"], "gpus": per("reward")})
    if vllm and "vllm" not in {r for g in groups for r in g["roles"]}:
        groups.append({"roles": ["vllm"], "gpus": vllm})
    total = sum(int(g["gpus"]) for g in groups)
    mode = "async" if is_async else "sync"
    text = " + ".join(f"{'/'.join(g['roles'])} {g['gpus']}" for g in groups)
    line = f"{mode}: {text} = {total} GPUs"
    if is_async:
        line += (f"; vLLM generates while DeepSpeed trains (queue of {a.train.async_queue_size} batch(es)"
                 f"{', partial rollouts' if getattr(a.train, 'partial_rollout_enable', False) else ''})")
    return {"mode": mode, "groups": groups, "total_gpus": total, "line": line}
