"""The search environment OpenRLHF's agent rollout runs: the executor (agent), the protocols (tags, native tool
calls), rewards, the retrieval client, the search settings (SearchConfig) and shared types.

The package registers its protocols here, where it is assembled: every protocol module is imported once, so
``get_protocol(name)`` knows each of them wherever :mod:`openrlhf_search.env.protocol` is imported.
"""

from openrlhf_search.env import chat_tools as _chat_tools  # noqa: F401  (registers chat_tools, chat_tools_nothink)
from openrlhf_search.env import paper_protocols as _paper_protocols  # noqa: F401  (r1searcher, searchr1, ...)
