"""Paper parity: the released training settings of R1-Searcher and Search-R1 (``reference``), each launcher's
resolved configuration compared with them (``check``), and ``docs/parity.md`` generated from both (``report``)."""
