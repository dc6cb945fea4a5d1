"""Per-sample sampling seeds of the CPU job's rollouts, so that a run's tokens do not depend on timing.

The rollouts of one RL step run concurrently and meet in the engine's continuous batch in the order their
retrievals return. Drawing every row from one shared generator in batch order would make the tokens depend on that
order (retrieval latency, thread count, machine load). Instead every generation call carries its own
``SamplingParams.seed``, as a vLLM request with a seed does (vLLM then gives it its own generator;
:class:`~openrlhf_search.cpu.main_job.engine.HFEngine` does the same), derived from what identifies the call in the run:

    seed = H(run seed, step, prompt index in the step's batch, sample index in its group, turn)

with ``H`` a hash (BLAKE2b) to 63 bits. The turn is part of it because the executor sends every turn of a trajectory
as a new request; one seed for all turns would replay the same noise at every turn. Since the step is part of the
seed, a run resumed from a checkpoint at step N samples step N+1 exactly as the uninterrupted run did.
"""

import hashlib
from copy import copy


def rollout_seed(run_seed: int, step: int, prompt_index: int, sample_index: int, turn: int = 0) -> int:
    """The sampling seed of one generation call: a 63-bit int (what ``SamplingParams.seed`` and
    ``torch.Generator.manual_seed`` accept), a deterministic function of its arguments (not Python's ``hash``,
    which is salted per process)."""
    key = f"{int(run_seed)}:{int(step)}:{int(prompt_index)}:{int(sample_index)}:{int(turn)}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class SeededSample:
    """An engine seen by one trajectory: every ``generate`` call (one per turn, in order: the executor awaits each
    turn before the next) gets a copy of its sampling params with ``seed = rollout_seed(run_seed, step,
    prompt_index, sample_index, turn)``. Everything else is forwarded to the wrapped engine.

    Greedy params (temperature 0) are passed through unchanged: nothing is drawn.
    """

    def __init__(self, engine, run_seed: int, step: int, prompt_index: int, sample_index: int):
        self._engine = engine
        self._key = (run_seed, step, prompt_index, sample_index)
        self.turn = 0

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        params = sampling_params
        if sampling_params.temperature > 0:
            params = copy(sampling_params)
            params.seed = rollout_seed(*self._key, turn=self.turn)
        self.turn += 1
        return await self._engine.generate(prompt_token_ids, params, multi_modal_data=multi_modal_data)

    def __getattr__(self, name):
        return getattr(self._engine, name)
