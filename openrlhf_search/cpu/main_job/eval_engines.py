"""The CPU engines lent to evaluation (:class:`openrlhf_search.evaluation.engines.CPUEngines`): its
``HFEngine`` and the models this package ships. The CLI entry points pass :data:`CPU_ENGINES` to
``build_engine``; the evaluation package itself never imports this one."""

from typing import Optional, Tuple


class _CPUMainJobEngines:
    def packaged_model(self, name: str) -> Optional[str]:
        """Local folder of the packaged SmolLM2-135M-Instruct for its aliases; None for any other name."""
        from cpu_demo.offline_assets import is_smollm2_alias, smollm2_checkpoint

        return smollm2_checkpoint() if is_smollm2_alias(name) else None

    def load_hf(self, model: str, tokenizer_path: Optional[str], seed: int,
                max_model_len: Optional[int]) -> Tuple[object, object]:
        """(``HFEngine``, tokenizer). ``model="tiny"``: the tiny random Qwen2 built in memory with the Qwen2.5
        tokenizer, or ``tokenizer_path``'s chat template over the same vocabulary.

        Raises:
            ValueError: a ``tokenizer_path`` whose vocabulary is not the tiny model's; transformers' OSError /
                ValueError for a model or tokenizer that cannot load.
        """
        from cpu_demo import offline_assets
        from openrlhf_search.cpu.main_job import engine

        if model != "tiny":
            hf, tok = offline_assets.load_hf_policy(model, tokenizer_path)
            return engine.HFEngine(hf, tok, seed=seed, max_model_len=max_model_len), tok
        tok = offline_assets.load_qwen_tokenizer()
        if tokenizer_path:  # the same vocabulary under another chat template (prompt-rendering checks)
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tokenizer_path)
            if len(tok) != len(offline_assets.load_qwen_tokenizer()):
                raise ValueError(f"--tokenizer {tokenizer_path} does not share the tiny model's Qwen vocabulary")
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token
        hf = offline_assets.build_tiny_qwen2(tok, seed=seed)
        return engine.HFEngine(hf, tok, seed=seed, max_model_len=max_model_len), tok


CPU_ENGINES = _CPUMainJobEngines()
