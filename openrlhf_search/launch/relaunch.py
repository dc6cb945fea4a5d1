"""What a launch checks before it trains, so that a relaunch resumes or refuses and never silently starts over.

OpenRLHF 0.11.2 deletes the checkpoint it evicts (``--ckpt.max_num``) before the new save is written, and its load
(``--ckpt.load_enable``) only warns when it finds nothing, then trains from step 0. A save killed midway (disk full,
a preempted node) can leave ``_actor/latest`` naming a tag that was just deleted, or ``_actor/`` without ``latest``.
:func:`resume_tag` refuses both in one line naming the folder; :func:`disk_problem` refuses a launch whose
checkpoints cannot fit on the disk of ``--ckpt.path``.

``python -m openrlhf_search.launch.relaunch CKPT_PATH`` prints the tag a relaunch resumes from (exit 0) or the refusal
(exit 2); the launchers' ``resume_args`` (examples/scripts/common.sh) calls it.
"""

import os
import sys
from typing import Optional

STATE_DIRS = ("_actor", "_critic")  # OpenRLHF's DeepSpeed state folders under --ckpt.path (critic: PPO only)


class ResumeError(ValueError):
    """A checkpoint folder a run cannot resume from; the message is one line naming the folder."""


def _complete(tag_dir: str) -> bool:
    """DeepSpeed wrote this tag's model states (``mp_rank_00_model_states.pt`` at ZeRO-0..2,
    ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` at ZeRO-3)."""
    return os.path.isdir(tag_dir) and any(f.endswith("model_states.pt") for f in os.listdir(tag_dir))


def _tags(state_dir: str) -> list:
    return sorted(d for d in os.listdir(state_dir) if os.path.isdir(os.path.join(state_dir, d)))


def resume_tag(ckpt_path: str) -> Optional[str]:
    """The tag (``global_step<N>``) a ``--ckpt.load_enable`` run resumes from in ``ckpt_path``, None when it holds
    no DeepSpeed state (``_actor/`` absent). Raises :class:`ResumeError` when ``_actor/`` (or ``_critic/``) has no
    ``latest``, when ``latest`` names a tag whose folder is missing or holds no model states, or when the critic's
    ``latest`` differs from the actor's (a save that died between the two)."""
    actor = os.path.join(ckpt_path, "_actor")
    if not os.path.isdir(actor):
        return None
    found = {}
    for name in STATE_DIRS:
        state_dir = os.path.join(ckpt_path, name)
        if not os.path.isdir(state_dir):
            continue
        latest = os.path.join(state_dir, "latest")
        have = ", ".join(_tags(state_dir)) or "no tag folders"
        if not os.path.isfile(latest):
            raise ResumeError(f"{state_dir} holds DeepSpeed states ({have}) but no 'latest' file (a save died "
                              f"before finishing): write the tag to resume from into {latest}, or FRESH=1 to start "
                              "over")
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
        if not _complete(os.path.join(state_dir, tag)):
            raise ResumeError(f"{latest} names {tag or '(nothing)'}, which {state_dir} does not hold complete "
                              f"(present: {have}; a save died after the older checkpoint was rotated away): write "
                              f"a complete tag into {latest}, or FRESH=1 to start over")
        found[name] = tag
    if "_critic" in found and found["_critic"] != found["_actor"]:
        raise ResumeError(f"{ckpt_path}: _actor/latest is {found['_actor']} but _critic/latest is "
                          f"{found['_critic']} (a save died between them): write one tag both hold into both "
                          "'latest' files, or FRESH=1 to start over")
    return found["_actor"]


def load_problem(args) -> Optional[str]:
    """The line refusing a ``--ckpt.load_enable`` launch that would load nothing or a broken checkpoint; None when
    the flag is off or ``--ckpt.path`` resumes (:func:`resume_tag`)."""
    if not getattr(args.ckpt, "load_enable", False):
        return None
    try:
        tag = resume_tag(args.ckpt.path)
    except ResumeError as e:
        return str(e)
    if tag is None:
        return (f"--ckpt.load_enable but {os.path.join(args.ckpt.path, '_actor')} holds no checkpoint: nothing "
                "to resume (drop the flag to start at step 0, or point --ckpt.path at the run to resume)")
    critic = os.path.join(args.ckpt.path, "_critic")
    if getattr(getattr(args, "critic", None), "model_name_or_path", None) and not os.path.isdir(critic):
        return (f"--ckpt.load_enable with a critic but {critic} does not exist: the actor would resume at {tag} "
                "beside an untrained critic (point --ckpt.path at the PPO run to resume, or start over)")
    return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m openrlhf_search.launch.relaunch CKPT_PATH", file=sys.stderr)
        return 2
    try:
        tag = resume_tag(argv[0])
    except ResumeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(tag or "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
