"""The embedded data both CPU modes train on (the CPU main job and the CPU cluster mode's tiny assets).

- :mod:`openrlhf_search.cpu.data.countries`: country facts from the ``countryinfo`` package;
- :mod:`openrlhf_search.cpu.data.default_dataset`: the embedded default corpus and 1-/2-hop questions;
- :mod:`openrlhf_search.cpu.data.qa`: QA jsonl loaders of the CPU main job (R1-Searcher and FlashRAG row forms).
"""
