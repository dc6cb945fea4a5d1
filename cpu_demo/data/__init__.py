"""The embedded data both CPU modes train on (the CPU main job and the CPU cluster mode's tiny assets).

- :mod:`cpu_demo.data.countries`: country facts from the ``countryinfo`` package;
- :mod:`cpu_demo.data.default_dataset`: the embedded default corpus and 1-/2-hop questions;
- :mod:`cpu_demo.data.qa`: QA jsonl loaders of the CPU main job (R1-Searcher and FlashRAG row forms).
"""
