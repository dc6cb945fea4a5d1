"""The CPU engine lent to evaluation: :mod:`.engine` and :mod:`.eval_engines`: ``HFEngine`` (vLLM's
token-in/token-out ``generate`` over a ``transformers`` model), ``cli.eval`` / ``cli.prepare_data``'s CPU default
engine. The CPU main job itself (``make demo``) is ``cpu_demo.run`` in the checkout.
"""
